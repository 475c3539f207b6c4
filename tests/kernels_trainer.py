"""The trainer side of tests/test_real_vllm_kernels.py, run in the engine's Python (vLLM importable there).

    python tests/kernels_trainer.py MODEL_DIR DUMP_DIR PROFILE OUT.pt

Loads MODEL_DIR as a trainer does (bf16 HF model), applies PROFILE with ``roundalign.apply`` and writes to OUT.pt the
log-probs of the dump's completion tokens, computed three ways: one unpadded sequence per forward, and all of
them in one left-padded and one right-padded batch (``position_ids`` from the mask, as verl computes them). It also
writes what the backward test needs: the gradients of vLLM's attention through ``roundalign.kernels`` and of HF's
SDPA attention at the same inputs, and of one training step with and without gradient checkpointing. The test
compares them with the dump (the engine's own numbers) and with each other.
"""

from __future__ import annotations

import sys

import torch

import roundalign
from roundalign.rollouts.dumpdir import read_dump
from roundalign.trainer import load_model


def picked(logits: torch.Tensor, completion: list[int]) -> torch.Tensor:
    logp = logits.float().log_softmax(-1)
    return logp.gather(-1, torch.tensor(completion)[:, None])[:, 0]


def batched(model, dump, left: bool) -> list[torch.Tensor]:
    seqs = [r.prompt_token_ids + r.token_ids for r in dump.rollouts]
    width = max(map(len, seqs)) + 2  # every row padded, the longest too
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols], mask[i, cols] = torch.tensor(s), 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
    out = []
    for i, (s, r) in enumerate(zip(seqs, dump.rollouts, strict=True)):
        first = (width - len(s) if left else 0) + len(r.prompt_token_ids) - 1
        out.append(picked(logits[i, first : first + len(r.token_ids)], r.token_ids))
    return out


def attention_grads(model) -> dict[str, list[torch.Tensor]]:
    """vLLM's attention (forward) through roundalign.kernels and HF's SDPA: the gradients w.r.t. q, k, v."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from roundalign import kernels

    module = model.model.layers[0].self_attn
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    g = torch.Generator().manual_seed(0)
    shapes = [(2, heads, 37, module.head_dim), (2, kv_heads, 37, module.head_dim), (2, kv_heads, 37, module.head_dim)]
    inputs = [torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes]
    upstream = torch.randn(2, 37, heads, module.head_dim, generator=g).to(torch.bfloat16)
    out = {}
    for name, fn in (("kernels", kernels.attention), ("sdpa", sdpa_attention_forward)):
        leaves = [t.clone().requires_grad_() for t in inputs]
        result = fn(module, *leaves, None, scaling=module.scaling)[0]
        result.backward(upstream)
        out[name] = [t.grad for t in leaves]
    return out


def step_grads(model, dump, checkpointing: bool) -> dict[str, torch.Tensor]:
    r = dump.rollouts[0]
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.zero_grad(set_to_none=True)
    ids = torch.tensor([r.prompt_token_ids + r.token_ids])
    logits = model(input_ids=ids).logits[0, len(r.prompt_token_ids) - 1 : -1]
    picked(logits, r.token_ids).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if checkpointing:
        model.gradient_checkpointing_disable()
    model.eval()
    return grads


def backbone_grads(model, dump) -> dict[str, dict[str, torch.Tensor]]:
    """Under ``forward='vllm-cpu-compiled'``: the parameter gradients of the backbone's compiled forward and of the
    model's own patched (eager) forward, for the same upstream gradient on the final hidden states."""
    from roundalign.profiles import ForwardKernel

    if roundalign.patched_profile(model).forward is not ForwardKernel.VLLM_CPU_COMPILED:
        return {}
    r = dump.rollouts[0]
    ids = torch.tensor([r.prompt_token_ids + r.token_ids])
    base = model.model
    upstream = torch.randn(1, ids.shape[1], model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    out = {}
    for name, forward in (("compiled", base), ("eager", lambda **kw: type(base).forward(base, **kw))):
        model.zero_grad(set_to_none=True)
        forward(input_ids=ids).last_hidden_state.backward(upstream.to(torch.bfloat16))
        out[name] = {n: p.grad.clone() for n, p in base.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def main(model_dir: str, dump_dir: str, profile: str, out: str) -> None:
    torch.manual_seed(0)
    model = load_model(model_dir).eval()
    roundalign.apply(model, profile)
    dump = read_dump(dump_dir, vocab_size=model.config.vocab_size, max_model_len=model.config.max_position_embeddings)
    with torch.no_grad():
        unpadded = []
        for r in dump.rollouts:
            logits = model(input_ids=torch.tensor([r.prompt_token_ids + r.token_ids])).logits[0]
            unpadded.append(picked(logits[len(r.prompt_token_ids) - 1 : -1], r.token_ids))
    result = {
        "profile": str(roundalign.patched_profile(model).name),
        "unpadded": unpadded,
        "left": batched(model, dump, left=True),
        "right": batched(model, dump, left=False),
        "attention_grads": attention_grads(model),
        "step": step_grads(model, dump, checkpointing=False),
        "step_checkpointed": step_grads(model, dump, checkpointing=True),
        "backbone_grads": backbone_grads(model, dump),
    }
    torch.save(result, out)


if __name__ == "__main__":
    main(*sys.argv[1:5])
