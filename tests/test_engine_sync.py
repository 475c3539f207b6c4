"""Engine-side Fair Cast: ``Engine.load_weights(fp32 masters, sync=...)`` rounds as ``roundalign.sync`` does.

The export itself is checked against its formulas in tests/test_sync_export.py; here: the engine keeps one exporter
per (rounding, seed) across calls, so its served copy follows the same sequence as a trainer-side Exporter, and bad
input is refused with the exporter's message.
"""

from __future__ import annotations

import pytest
import torch

from roundalign.engine import Engine
from roundalign.models import path
from roundalign.sync import MODES, Exporter


@pytest.fixture(scope="module")
def engine():
    return Engine(path("tiny-qwen3"))


def _masters(engine, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    # the checkpoint plus up to 0.1% (half a bf16 ulp is 0.2-0.4%): RNE hides each step, the other modes must not
    served = engine.weights.state_dict()
    return {k: v.float() * (1 + 1e-3 * torch.rand(v.shape, generator=g)) for k, v in served.items()}


@pytest.mark.parametrize("rounding", ["stochastic", "error-feedback"])
def test_engine_side_export_follows_the_trainer_side_exporter_call_by_call(engine, rounding):
    assert set(MODES) == {"rne", "stochastic", "error-feedback"}
    reference = Exporter(rounding, seed=11)
    changed = 0
    for step in range(3):
        masters = _masters(engine, step)
        engine.load_weights(masters, sync=rounding, seed=11)
        expected = reference.export(masters)
        served = engine.weights.state_dict()
        assert all(torch.equal(served[k], expected[k]) for k in expected)
        changed += sum(int((served[k] != masters[k].to(torch.bfloat16)).sum()) for k in expected)
    assert changed > 0  # the mode differs from a plain cast on these inputs: the comparison can fail


def test_engine_side_export_needs_fp32_masters_and_a_known_mode(engine):
    bf16 = {k: v.clone() for k, v in engine.weights.state_dict().items()}
    with pytest.raises(TypeError, match="fp32"):
        engine.load_weights(bf16, sync="stochastic")
    with pytest.raises(ValueError, match="unknown sync mode 'sr'; supported: rne, stochastic, error-feedback"):
        engine.load_weights(bf16, sync="sr")
