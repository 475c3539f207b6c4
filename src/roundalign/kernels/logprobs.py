"""The engine's log-prob head: ``log_softmax`` over the full row of fp32 logits, as the sampler computes it, with a
gradient and without holding a ``(tokens, vocab)`` fp32 tensor.

vLLM's sampler computes a token's log-prob as ``logits.to(float32)``, divided by the temperature in fp32, then
``log_softmax`` over the row (``vllm/v1/sample/sampler.py``); the reference engine the same
(``roundalign.engine.sampling``). Trainers compute it otherwise: TRL 1.16's fused head folds vocabulary tiles into an
online ``target - (max + log(sum exp))``, verl 0.9.1's ``logprobs_from_logits`` takes ``x - logsumexp(x)`` of fp32
logits and ``log_softmax`` of bf16 ones in bf16. The results agree to about 1e-6 nats, not bit for bit, so an exact
trainer computes the engine's formula here (``roundalign.integrations.trl_logprobs``, ``.verl.logprobs``).

The forward computes the fp32 log-softmax in row chunks; the backward recomputes each chunk
(``d log p_t / dz = onehot_t - p``, ``dH / dz = -p (log p + H)``, ``z = logits / temperature``).
"""

from __future__ import annotations

import torch

CHUNK_ELEMENTS = 1 << 24
"""fp32 elements of one chunk of the log-softmax (64 MiB): rows per chunk = this // vocab."""


def _chunks(n: int, vocab: int):
    step = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    return ((i, min(i + step, n)) for i in range(0, n, step))


def _log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The engine's per-row log-softmax (``roundalign.engine.sampling``: ``logits / temperature`` in fp32)."""
    return (logits.float() / temperature).log_softmax(-1)


class _EngineLogProbs(torch.autograd.Function):
    """``(log p[target], entropy)`` per row of ``logits``, the log-softmax in row chunks; the backward recomputes
    each chunk (``d log p_t / dz = onehot_t - p``, ``dH / dz = -p (log p + H)``, ``z = logits / temperature``)."""

    @staticmethod
    def forward(ctx, logits, targets, temperature):
        picked = logits.new_empty(logits.shape[0], dtype=torch.float32)
        entropy = torch.empty_like(picked)
        for a, b in _chunks(logits.shape[0], logits.shape[-1]):
            logp = _log_softmax(logits[a:b], temperature)
            picked[a:b] = logp.gather(-1, targets[a:b, None])[:, 0]
            entropy[a:b] = -(logp.exp() * logp).sum(-1)
        ctx.temperature = temperature
        ctx.save_for_backward(logits, targets, entropy)
        return picked, entropy

    @staticmethod
    def backward(ctx, grad_picked, grad_entropy):
        logits, targets, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for a, b in _chunks(logits.shape[0], logits.shape[-1]):
            logp = _log_softmax(logits[a:b], ctx.temperature)
            p = logp.exp()
            g = torch.zeros_like(logp)
            if grad_picked is not None:
                g -= p * grad_picked[a:b, None]
                g.scatter_add_(-1, targets[a:b, None], grad_picked[a:b, None])
            if grad_entropy is not None:
                g -= p * (logp + entropy[a:b, None]) * grad_entropy[a:b, None]
            grad[a:b] = g / ctx.temperature
        return grad, None, None


def engine_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """``(log-prob of each target, entropy)`` per row of ``(rows, vocab)`` logits, as the engine computes them."""
    return _EngineLogProbs.apply(logits, targets, float(temperature))


__all__ = ["CHUNK_ELEMENTS", "engine_logprobs"]
