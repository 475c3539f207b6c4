"""TRL's GRPOTrainer exactly on-policy against the real vLLM: ``VllmRolloutFunc`` (roundalign.integrations.trl_vllm).

TRL 1.16 samples with vLLM's CPU build (``enforce_eager``) in the trainer's process through our ``rollout_func``,
and the policy's weights go into vLLM after every optimizer step (RNE). The run itself is tests/trl_vllm_train.py,
in the engine's Python (vLLM and TRL there). What is asserted, against the sampler's own log-probs (vLLM's
``processed_logprobs``, as TRL holds them in ``sampling_per_token_logps``):

- with the policy patched with the build's ``-kernels`` profile, every log-prob TRL computes, its recompute
  (``old_per_token_logps``) and the loss's forward alike, equals the sampler's bit for bit at every step, and TRL's
  IS ratio is exactly 1, ``rollout_corr/k3_kl`` exactly 0, although the policy moves (and is synced) every step;
- with a stock HF policy on the same vLLM, neither holds;
- both again with vLLM serving W8A8 int8 (``VllmRolloutFunc(quantization="w8a8-int8")``, re-quantized and reloaded
  at every sync), the exact policy computing the scheme with vLLM's own quantized layers.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("trl_vllm_train.py")


@pytest.fixture(scope="module", params=[None, "w8a8-int8"], ids=["bf16", "w8a8-int8"])
def runs(request, engine_python, tmp_path_factory):
    """The two runs on a bf16 vLLM, and on a vLLM serving W8A8 int8 (re-quantized at every sync)."""
    out = tmp_path_factory.mktemp("trl-vllm") / "runs.pt"
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    argv = [engine_python, str(SCRIPT), str(out), *([request.param] if request.param else [])]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=os.environ | env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return torch.load(out, weights_only=False)


def _row_of(completion, completions, mask) -> int:
    rows = [i for i, (c, m) in enumerate(zip(completions, mask, strict=True)) if torch.equal(c[m], completion[m])]
    assert rows, "a scored completion that is not in the batch"
    return rows[0]  # identical completions of one prompt have identical log-probs


def test_exact_policy_is_the_samplers_logprobs_at_every_step(runs):
    run = runs["exact"]
    profile, _, scheme = runs["trainer_profile"].partition("+quantization=")
    assert profile.startswith("vllm-0.32-cpu-eager") and profile.endswith("-kernels") and scheme in ("", "w8a8-int8")
    assert len(run["batches"]) == len(run["logs"]) == 3 and run["syncs"] == 4  # attach + one per step
    assert len(run["scored"]) == 6  # per step: TRL's recompute, then the loss's forward
    for i, (batch, log) in enumerate(zip(run["batches"], run["logs"], strict=True)):
        mask = batch["completion_mask"].bool()
        sampler = batch["sampling_per_token_logps"]
        assert mask.sum() > 0 and bool((sampler[mask] < 0).any())
        assert torch.equal(batch["old_per_token_logps"][mask], sampler[mask])
        for completion_ids, logps in run["scored"][2 * i : 2 * i + 2]:
            rows = [_row_of(c, batch["completion_ids"], mask) for c in completion_ids]
            assert torch.equal(logps[mask[rows]], sampler[rows][mask[rows]])
        assert bool((batch["is"] == 1).all())
        assert log["rollout_corr/k3_kl"] == 0 and log["mismatch/bitwise_equal_frac"] == 1
    # The policy moved and the sync carried it into vLLM, so later steps were exact on updated weights. Not every
    # step: a batch whose rewards are all equal has no gradient, and which batches those are depends on the CPU's
    # numerics (seen with the dispatch limited to AVX2).
    assert any(log["sync/visible_fraction"] > 0 for log in run["logs"][:-1])


def test_stock_policy_is_not(runs):
    run = runs["stock"]
    assert len(run["logs"]) == 2
    for batch, log in zip(run["batches"], run["logs"], strict=True):
        mask = batch["completion_mask"].bool()
        assert not torch.equal(batch["old_per_token_logps"][mask], batch["sampling_per_token_logps"][mask])
        assert log["rollout_corr/k3_kl"] > 0 and log["mismatch/bitwise_equal_frac"] < 1
