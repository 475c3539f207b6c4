"""vLLM's CPU kernels at the engine's thread count: which of them split work by thread, and what the exact trainer
needs to be told (docs/kernels.md, "The engine's thread count").

vLLM's CPU attention splits a decode step's long KV ranges among its OpenMP threads (``VLLM_CPU_ATTN_SPLIT_KV``,
on by default) and merges the parts: at 2 threads a decoded row then differs from the same row unsplit, and how it
is split depends on every sequence of the step, which a trainer does not know. Unsplit, a decoded row is the same
at any thread count and whatever else the step held, and the trainer's attention (every row as its decode step)
reproduces the engine's step-by-step decode at every position; vLLM's GEMMs give the same bits at 1 and 2 threads,
so the trainer's own thread count is free. ``roundalign dump`` and the in-process engine set
``VLLM_CPU_ATTN_SPLIT_KV=0``; the real-engine tests run vLLM at 2 threads (tests/test_real_vllm_kernels.py).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.vllm_threads import LENGTHS

SCRIPT = Path(__file__).with_name("vllm_threads.py")
SHORT = 300  # tokens: decode and prefill attention agree up to about this length (docs/kernels.md)


@pytest.fixture(scope="module")
def by_threads(engine_python, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("threads")
    out = {}
    for threads in (1, 2):
        path = tmp / f"{threads}.pt"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        proc = subprocess.run([engine_python, str(SCRIPT), str(path)], capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[threads] = torch.load(path)
        assert out[threads]["threads"] == threads
    return out


def test_split_kv_decode_depends_on_the_thread_count(by_threads):
    """The sensitivity: split at 2 threads, the long sequence's decoded row is not its prefill row (at 1 thread
    there is nothing to split)."""
    assert all(by_threads[1]["decode_equal_split_True"])
    assert not all(by_threads[2]["decode_equal_split_True"])


def test_unsplit_decode_rows_do_not_depend_on_the_thread_count(by_threads):
    """Unsplit, a decoded row is the same at 1 and 2 threads, and for sequences of a few hundred tokens it is the
    prefill's row (longer ones: docs/kernels.md, decode against prefill attention)."""
    assert torch.equal(by_threads[1]["decode_split_False"], by_threads[2]["decode_split_False"])
    for threads in (1, 2):
        equal = by_threads[threads]["decode_equal_split_False"]
        assert all(e for e, n in zip(equal, LENGTHS, strict=True) if n <= SHORT), threads


def test_the_trainers_attention_is_the_engines_decode_at_every_position(by_threads):
    """The trainer's attention (``vllm_cpu.attention``: every row as its decode step) equals the engine's decode,
    built step by step, at every position of every sequence (2,000 tokens included), at 1 and 2 threads; a prefill
    of the whole sequence does not past a few hundred positions, which is why the trainer does not compute one."""
    for threads in (1, 2):
        result = by_threads[threads]
        assert torch.equal(result["trainer"], result["engine_steps"]), threads
        assert not torch.equal(result["prefill"], result["engine_steps"]), threads


def test_the_trainers_kernels_do_not_depend_on_its_thread_count(by_threads):
    """vLLM's GEMMs at 1, 5, 17 and 300 rows, and the prefill attention of sequences of a few hundred tokens: the
    same bits at 1 and 2 threads. (A prefill of thousands of tokens is cut into per-thread work items, which moves
    its query tiles: docs/kernels.md.)"""
    one, two = by_threads[1], by_threads[2]
    start = 0
    for n in LENGTHS:
        if n <= SHORT:
            assert torch.equal(one["prefill"][start : start + n], two["prefill"][start : start + n]), n
        start += n
    assert one["gemm"].keys() == two["gemm"].keys()
    for shape, outs in one["gemm"].items():
        for a, b in zip(outs, two["gemm"][shape], strict=True):
            assert torch.equal(a, b), shape
