"""The engine's attention in the trainer's forward, each sequence alone as the engine computed it, with the gradient
of standard attention.

``attention`` is an HF attention function (``AttentionInterface`` signature): the patched attention modules call it
where the profile names an engine attention kernel (``Profile.attention``: ``vllm-cpu`` or ``reference``). The engine
computes each sequence of a batch unpadded and from position 0, each sampled token's row in the decode step that
sampled it, so this finds the sequences in the trainer's padded or packed batch (``batch.sequences``, once per
forward), runs the kernel over them back to back (every row decode-shaped: ``vllm_cpu.attention``), and scatters
the result back. The kernels have no backward: ``_EngineAttention`` saves only q, k, v and HF's mask and recomputes HF's
SDPA attention in the backward, so the gradient and the memory are stock HF's.
"""

from __future__ import annotations

import weakref

import torch

from roundalign.errors import UserError
from roundalign.kernels import batch as _batch
from roundalign.kernels.autocast import no_autocast
from roundalign.profiles import AttentionKernel


class _EngineAttention(torch.autograd.Function):
    """Forward: ``run(q, k, v)`` (an engine kernel). Backward: the gradient of ``standard(q, k, v, mask)``,
    recomputed.

    The mask (HF's, or None) is saved with q, k and v, not held by ``standard``: saved tensors are released when the
    backward has used them (unless it retains the graph), while a node's other attributes live as long as the graph,
    past the backward's end, where stock HF holds no mask."""

    @staticmethod
    def forward(ctx, q, k, v, mask, run, standard):
        ctx.standard, ctx.has_mask = standard, mask is not None
        ctx.save_for_backward(q, k, v, *((mask,) if ctx.has_mask else ()))
        with no_autocast(q):
            return run(q, k, v)

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        mask = saved[3] if ctx.has_mask else None
        with torch.enable_grad():
            inputs = [
                t.detach().requires_grad_(need) for t, need in zip(saved[:3], ctx.needs_input_grad[:3], strict=True)
            ]
            out = ctx.standard(*inputs, mask)
            wanted = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        return (*(next(grads) if t.requires_grad else None for t in inputs), None, None, None)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths, scale: float) -> torch.Tensor:
    """The reference engine's decode attention, row by row: each query row against its sequence's keys up to its
    own position, in fp32, exactly as a decode step computes it (``roundalign.engine.attention.decode_attention``,
    the same function on the same shapes)."""
    from roundalign.engine.attention import AttentionSpec, decode_attention

    heads, head_dim, kv_heads = q.shape[1], q.shape[2], k.shape[1]
    spec = AttentionSpec(heads, kv_heads, head_dim, rowwise=True)
    if scale != spec.scale:
        raise UserError(f"the reference engine's attention scales by head_dim**-0.5; this model uses {scale}")
    out, start = [], 0
    for n in lengths:
        # The engine's KV cache holds the 16-bit keys and values as fp32, (kv_heads, positions, head_dim).
        k32, v32 = (t[start : start + n].float().transpose(0, 1) for t in (k, v))
        for j in range(n):
            out.append(decode_attention(q[start + j].reshape(1, -1), k32[:, : j + 1], v32[:, : j + 1], spec))
        start += n
    return torch.cat(out).view(-1, heads, head_dim)


def _packed_kernel(kernel: AttentionKernel):
    """The kernel's function of sequences packed back to back: ``(q, k, v, lengths, scale) -> out``."""
    if kernel is AttentionKernel.VLLM_CPU:
        from roundalign.kernels import vllm_cpu

        return vllm_cpu.attention
    return _reference


# The forward in progress: (mask, position_ids, shape, Sequences), the tensors held by weak reference. A strong one
# would keep HF's (batch, 1, tokens, tokens) mask alive after the forward, into the backward's peak, which stock
# HF does not hold then.
_SEQUENCES: list = []


def _ref(t):
    return None if t is None else weakref.ref(t)


def _same(ref, t) -> bool:
    """Whether ``ref`` (``_ref``'s) is to ``t`` itself; a freed tensor is no longer anything."""
    return t is None if ref is None else t is not None and ref() is t


def _sequences_of(attention_mask, position_ids, batch: int, width: int) -> _batch.Sequences:
    """``batch.sequences``, once per forward: every layer gets the same mask and position tensors."""
    if _SEQUENCES:
        mask, pos, shape, seqs = _SEQUENCES[0]
        if _same(mask, attention_mask) and _same(pos, position_ids) and shape == (batch, width):
            return seqs
    seqs = _batch.sequences(attention_mask, position_ids, batch, width)
    _SEQUENCES[:] = [(_ref(attention_mask), _ref(position_ids), (batch, width), seqs)]
    return seqs


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """An HF attention function (``AttentionInterface`` signature) that runs ``module._roundalign_attention``.

    query ``(batch, heads, tokens, head_dim)`` after RoPE, key/value ``(batch, kv_heads, tokens, head_dim)``;
    returns ``((batch, tokens, heads, head_dim), None)`` as HF's sdpa function does."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kernel = module._roundalign_attention
    if dropout:
        raise UserError(f"attention dropout {dropout}: the engine kernels compute no dropout (set attention_dropout=0)")
    b, _, n, _ = query.shape
    if key.shape[2] != n:
        raise UserError(
            f"{n} queries against {key.shape[2]} keys: the engine kernels compute whole sequences (training and "
            "scoring), not steps over HF's KV cache. Generate with the engine, or with the profile without kernels"
        )
    scale = module.scaling if scaling is None else scaling
    seqs = _sequences_of(attention_mask, kwargs.get("position_ids"), b, n)
    packed = _packed_kernel(kernel)

    def run(q, k, v):
        q, k, v = (seqs.pack(t.transpose(1, 2)) for t in (q, k, v))  # (tokens, heads, head_dim)
        return seqs.unpack(packed(q, k, v, seqs.lengths, scale), b)

    def standard(q, k, v, mask):
        return sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=scale, **kwargs)[0]

    return _EngineAttention.apply(query, key, value, attention_mask, run, standard), None
