#!/usr/bin/env python
"""GPU plan, NOT YET RUN: the exact trainer against vLLM on a GPU, in vLLM's batch-invariant mode.

What docs/kernels.md measures on the CPU build (vLLM's own attention and GEMM in the trainer: 100% bitwise in
enforce_eager mode), written for a CUDA machine with vLLM installed, and never run: no GPU with vLLM was available
when it was written. Read it as a plan; expect to fix names against the vLLM version you run (written against
vLLM 0.32's sources: vllm/v1/attention/backends/flash_attn.py, fa_utils.py,
vllm/model_executor/determinism/batch_invariant.py).

    VLLM_BATCH_INVARIANT=1 python scripts/gpu_exact_plan.py --model PATH --out gpu-exact

Three steps, all in this process:

1. **Dump.** ``roundalign dump --engine vllm --enforce-eager`` with ``VLLM_BATCH_INVARIANT=1`` (vLLM then runs
   FlashAttention with ``num_splits=1``, replaces aten mm/addmm/bmm/log_softmax/mean with its batch-invariant Triton
   kernels on SM80, or turns off cuBLAS split-K on SM90/SM100, and pins cuBLASLt). The sampler's and the prefill
   log-probs go to OUT/dump.
2. **Rounding rules.** ``roundalign fit --device cuda`` on the dump: vLLM's eager CUDA custom ops round as the
   ``vllm-eager`` profile says (read from source, never measured on a GPU), but batch-invariant mode swaps RMSNorm
   for its own Triton kernel (``rms_norm_batch_invariant``), whose rounding points nobody has measured: fit them.
3. **Kernels.** The trainer (the HF model on the GPU, patched with the fitted rules) takes the engine's kernels:
   ``init_batch_invariance()`` in this process (the same aten overrides and cuBLAS settings as the engine's
   workers), and attention through vLLM's FlashAttention exactly as its backend calls it for a fresh sequence:
   keys and values written by ``reshape_and_cache_flash`` into a paged cache of vLLM's block size, then
   ``flash_attn_varlen_func`` with the block table, ``seqused_k``, ``causal=True`` and ``num_splits=1``. Each
   sequence unpadded from position 0, found in the batch by ``roundalign.kernels.batch.sequences`` as on the CPU.

It prints, against the sampler's (decode) and the prefill log-probs: stock HF, the fitted rules alone, and the
fitted rules with vLLM's kernels; the last is expected to be 100% bitwise with k3_kl 0 if batch-invariant vLLM's
decode equals its prefill (the claim of vLLM's batch-invariance work) and the fitted rules are complete.

Known gaps to check first if it falls short: vLLM fuses q/k/v and gate/up into one GEMM each, which this script
does not (on the CPU build torch's fallback GEMM gave the same bits either way; cuBLAS may pick another kernel for
the fused width: fuse them as ``roundalign.kernels.project`` does for ``gemm="vllm-cpu"``); the lm_head's vocab
is padded to a multiple of 64 in vLLM; and ``BLOCK_SIZE`` below must be the engine's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

BLOCK_SIZE = 16  # vLLM's default GPU KV-cache block size; check engine.json / the engine log if it differs


def run(argv: list[str]) -> None:
    print("+", " ".join(argv), flush=True)
    subprocess.run(argv, check=True)


def dump(model: str, out: Path, num_samples: int, max_tokens: int) -> Path:
    env = dict(os.environ, VLLM_BATCH_INVARIANT="1")
    argv = [sys.executable, "-m", "roundalign", "dump", "--engine", "vllm", "--enforce-eager", "--model", model]
    argv += ["--out", str(out / "dump"), "--num-samples", str(num_samples), "--max-tokens", str(max_tokens)]
    print("+", " ".join(argv), flush=True)
    subprocess.run([*argv, "--ignore-eos"], check=True, env=env)
    return out / "dump"


def fit(model: str, dump_dir: Path, out: Path) -> Path:
    run([sys.executable, "-m", "roundalign", "fit", "--engine-logprobs", str(dump_dir), "--model", model,
         "--device", "cuda", "--out", str(out / "fit")])  # fmt: skip
    return out / "fit" / "profile.json"


def flash_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """An HF attention function: vLLM's FlashAttention on each sequence of the batch, as vLLM's FLASH_ATTN backend
    computes a fresh sequence's prefill (paged cache, block table, ``num_splits=1``). Forward only."""
    import torch
    from vllm.v1.attention.backends.fa_utils import (
        flash_attn_varlen_func,
        get_flash_attn_version,
        reshape_and_cache_flash,
    )

    from roundalign.kernels.batch import sequences

    b, heads, n, d = query.shape
    kv_heads = key.shape[1]
    seqs = sequences(attention_mask, kwargs.get("position_ids"), b, n)
    q, k, v = (seqs.pack(t.transpose(1, 2)) for t in (query, key, value))  # (tokens, heads, head_dim)
    lengths = torch.tensor(seqs.lengths, dtype=torch.int32, device=q.device)
    blocks = (lengths + BLOCK_SIZE - 1) // BLOCK_SIZE
    first = torch.cumsum(blocks, 0) - blocks
    total = int(blocks.sum())
    # vLLM's FLASH_ATTN cache: (blocks, kv_heads, block_size, 2 * head_dim), read as (blocks, block_size, kv_heads,
    # head_dim) key and value views.
    cache = torch.zeros(total, kv_heads, BLOCK_SIZE, 2 * d, dtype=q.dtype, device=q.device)
    key_cache, value_cache = cache.transpose(1, 2).split(d, dim=-1)
    slots = [torch.arange(int(m), device=q.device) + int(f) * BLOCK_SIZE for m, f in zip(lengths, first, strict=True)]
    slots = torch.cat(slots)
    scale_one = torch.ones((), dtype=torch.float32, device=q.device)
    reshape_and_cache_flash(k, v, key_cache, value_cache, slots.long(), "auto", scale_one, scale_one)
    width = int(blocks.max())
    table = (first[:, None] + torch.arange(width, device=q.device)[None]).clamp(max=total - 1).to(torch.int32)
    starts = torch.zeros(len(seqs.lengths) + 1, dtype=torch.int32, device=q.device)
    starts[1:] = torch.cumsum(lengths, 0)
    out = torch.empty_like(q)
    flash_attn_varlen_func(
        q=q, k=key_cache, v=value_cache, out=out, cu_seqlens_q=starts, max_seqlen_q=int(lengths.max()),
        seqused_k=lengths, max_seqlen_k=int(lengths.max()), softmax_scale=scaling or module.scaling, causal=True,
        block_table=table, fa_version=get_flash_attn_version(), num_splits=1,
    )  # fmt: skip
    return seqs.unpack(out, b), None


def trainer_logprobs(model_dir: str, profile, rollouts, kernels: bool) -> list:
    import torch

    import roundalign
    from roundalign.trainer import load_trainer_model

    model = load_trainer_model(model_dir).cuda()
    if profile is not None:
        roundalign.apply(model, profile)
    if kernels:
        from transformers import AttentionInterface

        AttentionInterface.register("vllm_flash_attn", flash_attention)
        model.config._attn_implementation = "vllm_flash_attn"
    out = []
    with torch.no_grad():
        for r in rollouts:
            ids = torch.tensor([r.prompt_token_ids + r.token_ids], device="cuda")
            logits = model(input_ids=ids).logits[0, len(r.prompt_token_ids) - 1 : -1].float()
            logp = logits.log_softmax(-1).gather(-1, torch.tensor(r.token_ids, device="cuda")[:, None])[:, 0]
            out.append(logp.cpu())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="HF model directory (bf16 Qwen2/Qwen3/Llama)")
    ap.add_argument("--out", default="gpu-exact")
    ap.add_argument("--num-samples", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=125)
    args = ap.parse_args()
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
    out = Path(args.out)
    dump_dir = dump(args.model, out, args.num_samples, args.max_tokens)
    fitted = fit(args.model, dump_dir, out)

    import torch
    from vllm.model_executor.determinism.batch_invariant import init_batch_invariance

    from roundalign.numerics.metrics import mismatch_metrics
    from roundalign.rollouts.dumpdir import read_dump

    init_batch_invariance()  # the trainer's GEMMs (and log_softmax, mean) as the engine's workers run them
    config = json.loads(Path(args.model, "config.json").read_text())
    data = read_dump(dump_dir, vocab_size=config["vocab_size"], max_model_len=config["max_position_embeddings"])
    sampler = [torch.tensor(r.logprobs) for r in data.rollouts]
    prefill = [torch.tensor(p) for p in data.prefill]
    rows = {
        "stock HF": trainer_logprobs(args.model, None, data.rollouts, kernels=False),
        "fitted rules": trainer_logprobs(args.model, str(fitted), data.rollouts, kernels=False),
        "fitted rules + vLLM kernels": trainer_logprobs(args.model, str(fitted), data.rollouts, kernels=True),
    }
    report = {}
    for name, lps in rows.items():
        for ref, target in (("decode", sampler), ("prefill", prefill)):
            m = mismatch_metrics(lps, target)
            report[f"{name} vs {ref}"] = m
            print(f"{name:<30} vs {ref:<8} bitwise {m['mismatch/bitwise_equal_frac']:.1%}  "
                  f"k3_kl {m['rollout_corr/k3_kl']:.2e}  rms {m['mismatch/log_ratio_rms']:.4g}")  # fmt: skip
    equal = all(torch.equal(a, b) for a, b in zip(sampler, prefill, strict=True))
    print(f"vLLM's decode equals its prefill bit for bit: {equal}")
    (out / "report.json").write_text(json.dumps(report, indent=1, default=lambda x: None if math.isnan(x) else x))


if __name__ == "__main__":
    main()
