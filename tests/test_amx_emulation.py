"""The exact trainer where vLLM's GEMM rows depend on the call's row count, as its AMX weight-packed GEMM's do
(Intel Xeon with AMX-BF16; emulated on any CPU by tests/amx_emulation.py, which says how).

The trainer calls the GEMM vLLM's dispatch picks (here the stand-in: the graph's ``packed`` branch), with every row
of a sequence in one call as vLLM's prefill does. So its log-probs are vLLM's prefill log-probs bit for bit, and
the sampler's wherever vLLM's decode steps ran more than 4 rows (the real kernel's AMX path, as the trainer's);
where a decode step ran 4 rows or fewer (the tail of a batch, or a sampler given few requests), the sampler's rows
came from the other path and differ; so does every sampled token's lm_head row, which vLLM computes only where it
samples (one row per request of the step). docs/kernels.md states the guarantee on AMX accordingly.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from tests.wide_model import build_llama

SCRIPT = Path(__file__).with_name("amx_emulation.py")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_llama(tmp_path_factory.mktemp("amx") / "model")


def _run(engine_python, model, mode, rows, tmp) -> dict:
    out = tmp / f"{mode}-{rows}.pt"
    proc = subprocess.run([engine_python, str(SCRIPT), str(model), mode, str(rows), str(out)], capture_output=True,
                          text=True, cwd=Path(__file__).parents[1])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_exact_with_a_row_count_dependent_gemm_where_decode_steps_are_large(engine_python, llama, mode, tmp_path):
    result = _run(engine_python, llama, mode, 8, tmp_path)
    assert result["gemm"] == "packed"
    assert result["profile"].endswith("-compiled-kernels" if mode == "compiled" else "-kernels")
    for mine, sampler, prefill in zip(result["trainer"], result["sampler"], result["prefill"], strict=True):
        assert torch.equal(mine, sampler)
        assert torch.equal(mine, prefill)


def test_decode_steps_of_few_rows_take_the_other_path(engine_python, llama, tmp_path):
    """The condition is real: with 2 requests every decode step runs 2 rows through the stand-in's small-row path,
    and so does the lm_head of every sampled token (vLLM computes logits only where it samples, one row per request,
    the first token included), so the sampler's log-probs differ from the trainer's; the prefill's (every position's
    logits in one call) still equal them."""
    result = _run(engine_python, llama, "eager", 2, tmp_path)
    for mine, sampler, prefill in zip(result["trainer"], result["sampler"], result["prefill"], strict=True):
        assert torch.equal(mine, prefill)
        assert not torch.equal(mine, sampler)
