"""Run in the engine's Python under a given OMP_NUM_THREADS (tests/test_vllm_threads.py): vLLM's CPU attention as
the engine decodes (one query row per sequence, the whole sequence in the paged cache, vLLM's scheduler metadata
with and without split KV) against the same rows of a prefill of the whole sequences; every row decoded step by
step as a batch of requests is (``engine_steps``) against the trainer's attention (``vllm_cpu.attention``); and the
kernels' outputs (prefill attention, vLLM's GEMM at several row counts) saved for comparison across thread counts.

    python tests/vllm_threads.py OUT.pt
"""

from __future__ import annotations

import sys

import torch

from roundalign.kernels import vllm_cpu

LENGTHS = [900, 30, 2000, 5]  # a long sequence beside short ones: split KV cuts it at 2 threads
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128


def paged_cache(k, v, lengths):
    """The sequences' keys and values in a paged cache, each sequence's blocks consecutive, as vLLM's CPU backend
    writes them: ``(key_cache, value_cache, block table, each sequence's first packed row, isa)``."""
    ops = vllm_cpu.load()
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    block = vllm_cpu.BLOCK_SIZE
    sizes = torch.tensor(lengths, dtype=torch.int32)
    blocks = (sizes + block - 1) // block
    first = torch.cumsum(blocks, 0) - blocks
    slots = torch.cat([torch.arange(n) + int(b) * block for n, b in zip(lengths, first, strict=True)])
    total = int(blocks.sum())
    table = (first[:, None] + torch.arange(int(blocks.max()))[None, :]).clamp(max=total - 1).to(torch.int32)
    isa = _get_attn_isa(k.dtype, block, HEAD_DIM)
    cache = torch.zeros(total, KV_HEADS, block, 2 * HEAD_DIM, dtype=k.dtype)
    key_cache, value_cache = cache.view(total, KV_HEADS, 2 * block, HEAD_DIM).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots.to(torch.int64), isa)
    return key_cache, value_cache, table, torch.cumsum(sizes, 0) - sizes, isa


def decode_step(query, seq_lens, table, key_cache, value_cache, isa, split: bool) -> torch.Tensor:
    """One decode step as vLLM's CPU backend runs it: one query row per request (``query``), each against its
    ``table`` row of the cache up to ``seq_lens``, the scheduler metadata built for this step."""
    ops = vllm_cpu.load()
    starts = torch.arange(query.shape[0] + 1, dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=query.shape[0], num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, seq_lens=seq_lens,
        dtype=query.dtype, query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=split,
    )  # fmt: skip
    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query.contiguous(), key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts,
        seq_lens=seq_lens, scale=HEAD_DIM**-0.5, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=table.contiguous(), softcap=0.0, scheduler_metadata=metadata, s_aux=None,
    )  # fmt: skip
    return out


def decode_rows(q, k, v, lengths, split: bool) -> torch.Tensor:
    """One decode step of every sequence (its last token's query), with or without split KV."""
    key_cache, value_cache, table, seq_start, isa = paged_cache(k, v, lengths)
    sizes = torch.tensor(lengths, dtype=torch.int32)
    return decode_step(q[seq_start + sizes - 1], sizes, table, key_cache, value_cache, isa, split)


def engine_steps(q, k, v, lengths) -> torch.Tensor:
    """Every row as the engine's decode computed it: step ``t`` runs one query for every sequence that has a token at
    position ``t`` (all of them decoding together, as a batch of requests does), against the cache up to ``t``.
    What the trainer's attention must reproduce for sampled tokens, built step by step, not as its one call."""
    key_cache, value_cache, table, seq_start, isa = paged_cache(k, v, lengths)
    out = torch.empty_like(q)
    for t in range(max(lengths)):
        live = [j for j, n in enumerate(lengths) if n > t]
        rows = seq_start[live].long() + t
        seq_lens = torch.full((len(live),), t + 1, dtype=torch.int32)
        out[rows] = decode_step(q[rows], seq_lens, table[live], key_cache, value_cache, isa, split=False)
    return out


def main(out: str) -> None:
    gen = torch.Generator().manual_seed(0)
    tokens = sum(LENGTHS)
    q, k, v = (torch.randn(tokens, h, HEAD_DIM, generator=gen).bfloat16() for h in (HEADS, KV_HEADS, KV_HEADS))
    prefill = vllm_cpu.attention(q, k, v, LENGTHS, HEAD_DIM**-0.5, prompts=LENGTHS)  # each sequence as a prefill
    last = torch.cumsum(torch.tensor(LENGTHS), 0) - 1
    result = {"threads": torch.get_num_threads(), "prefill": prefill, "gemm": {},
              "trainer": vllm_cpu.attention(q, k, v, LENGTHS, HEAD_DIM**-0.5),  # the trainer's default: as decoded
              "engine_steps": engine_steps(q, k, v, LENGTHS)}  # fmt: skip
    for split in (True, False):
        rows = result[f"decode_split_{split}"] = decode_rows(q, k, v, LENGTHS, split)
        result[f"decode_equal_split_{split}"] = [torch.equal(rows[i], prefill[last[i]]) for i in range(len(LENGTHS))]
    for shape in ((1536, 512), (512, 1536), (264, 512)):
        gemm = vllm_cpu.linear(torch.randn(shape, generator=gen).bfloat16(), None)
        x = torch.randn(300, shape[1], generator=gen).bfloat16()
        result["gemm"][shape] = [gemm(x[:m]) for m in (1, 5, 17, 300)]
    torch.save(result, out)


if __name__ == "__main__":
    main(sys.argv[1])
