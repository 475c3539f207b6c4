"""A run killed at every phase of a step, and resumed each time, ends bit for bit as the run that was never killed.

The kills are SIGKILLs the run sends itself at a named point (``roundalign.rl.faults``: no cleanup runs, as with the
out-of-memory killer), one after another in one run directory: before its first checkpoint (sampling), then during
the recompute, the backward, the export (the exporter's state already advanced), the checkpoint write (half
written) and right after a metrics line. Each time ``roundalign train --resume`` continues from what is on disk. With
stochastic rounding and error feedback the exporter's state (noise streams, residuals) must survive too; with the
real vLLM (``--engine vllm``, in its venv) the engine restarts from the served copy of the checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from roundalign.engines.failure import FAULT_ENV
from roundalign.rl.faults import ENV, PHASES
from tests.test_rl_train import SMALL, _no_timing, _rows

STEPS = 6
# (phase, step): each kill happens on the step the resumed run reaches first, or later (checkpoints every step).
KILLS = [("sampling", 1), ("recompute", 2), ("backward", 3), ("export", 4), ("checkpoint", 4), ("metrics", 5)]


def _args(out, settings: dict) -> list[str]:
    args = ["train", "--out", str(out), "--steps", str(STEPS), "--save-every", "1", "--quiet", "--no-tensorboard"]
    return args + [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]


def _chaos(python: str, out, settings: dict, kills, env_extra=None) -> None:
    """Kill the run at each of ``kills`` in turn, resuming after each, then let it finish."""
    events = [({ENV: f"{phase}:{step}"}, -signal.SIGKILL, None) for phase, step in kills]
    _chain(python, out, settings, events, env_extra)


def _chain(python: str, out, settings: dict, events, env_extra=None) -> None:
    """Run, then resume after each of ``events`` ((extra env, expected exit status, texts its stderr must hold)),
    then resume once more to the end."""
    env = dict(os.environ, **(env_extra or {}))
    first = True
    for extra, status, said in [*events, ({}, 0, None)]:
        args = _args(out, settings) if first else ["train", "--resume", str(out), "--quiet", "--no-tensorboard"]
        proc = subprocess.run(
            [python, "-m", "roundalign", *args], capture_output=True, text=True, env={**env, **extra}, timeout=900
        )
        assert proc.returncode == status, (extra, proc.returncode, proc.stderr[-3000:])
        for text in said or ():
            assert text in proc.stderr, proc.stderr[-3000:]
        first = False


def test_every_kill_point_is_exercised():
    assert sorted({phase for phase, _ in KILLS}) == sorted(PHASES)


@pytest.mark.parametrize("sync", ["stochastic", "error-feedback"])
def test_a_run_killed_at_every_phase_ends_as_the_uninterrupted_one(tmp_path, sync):
    settings, env = {**SMALL, "sync": sync}, {"OMP_NUM_THREADS": "1"}  # one thread count for every run
    _chaos(sys.executable, tmp_path / "straight", settings, [], env)
    _chaos(sys.executable, tmp_path / "chaos", settings, KILLS, env)
    assert [_no_timing(r) for r in _rows(tmp_path / "chaos")] == [_no_timing(r) for r in _rows(tmp_path / "straight")]


def test_a_run_on_the_real_vllm_killed_and_resumed_ends_as_the_uninterrupted_one(tmp_path, engine_python):
    """The same with the real engine in the process (vLLM's CPU build): a kill and an engine failure, fewer for its
    start-up time."""
    settings = {**SMALL, "sync": "error-feedback", "engine": "vllm", "eval_every": 0}
    env = {"HF_HUB_OFFLINE": "1"}
    _chaos(engine_python, tmp_path / "straight", settings, [], env)
    events = [
        ({ENV: "sampling:2"}, -signal.SIGKILL, None),
        # vLLM fails inside the step (the 2nd generate after resuming from step 1: step 3's rollouts): exit 7, with
        # what failed and the engine's last log lines; the run resumes from step 2's checkpoint
        (
            {FAULT_ENV: "generate:2"},
            7,
            [
                "the engine failed during generate: RuntimeError: simulated engine failure",
                "its last log lines:\nINFO vllm.",  # what the engine itself said last
            ],
        ),  # fmt: skip
    ]  # (a kill while writing a checkpoint: the reference engine's run above kills at every phase)
    _chain(engine_python, tmp_path / "chaos", settings, events, env)
    assert [_no_timing(r) for r in _rows(tmp_path / "chaos")] == [_no_timing(r) for r in _rows(tmp_path / "straight")]
