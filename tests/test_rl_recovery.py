"""A run directory is safe to open and a killed run recovers: no code from ``state.pt`` runs, a corrupt newest
checkpoint falls back to the one before it, a run killed before its first checkpoint starts over, and the files a run
writes are replaced atomically (``roundalign.durable``)."""

from __future__ import annotations

import json
import os
import pickle

import pytest

from roundalign import durable
from roundalign.cli import main
from roundalign.rl import checkpoint
from roundalign.rl.config import TrainConfig
from roundalign.rl.loop import train
from tests.test_rl_train import SMALL, _no_timing, _rows

BASE = dict(sync="error-feedback", save_every=1, **SMALL)


class _Planted:
    """A pickle that runs a command when loaded: what a shared run directory could hold."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted 3-step run every recovery is compared with."""
    out = tmp_path_factory.mktemp("straight") / "run"
    return _rows(train(TrainConfig(steps=3, **BASE).validate(), out, progress=False, tensorboard=False))


def _two_checkpoints(tmp_path):
    out = train(TrainConfig(steps=2, **BASE).validate(), tmp_path / "run", progress=False, tensorboard=False)
    assert [p.name for p in checkpoint.list_checkpoints(out)] == ["step-000001", "step-000002"]
    return out


def _resume(out, capsys, steps=3) -> tuple[int, str]:
    code = main(["train", "--resume", str(out), "--steps", str(steps), "--no-tensorboard"])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_a_planted_pickle_in_state_pt_is_refused_not_run(tmp_path, capsys, straight):
    out = _two_checkpoints(tmp_path)
    marker = tmp_path / "ran"
    newest = checkpoint.list_checkpoints(out)[-1] / "state.pt"
    newest.write_bytes(pickle.dumps({"step": 2, "policy": _Planted(marker), "exporter": {}, "tracker": {}}))
    code, said = _resume(out, capsys)
    assert not marker.exists()  # the command in the pickle never ran
    assert code == 0
    assert "skipped a newer checkpoint" in said and "refused" in said and "step-000001" in said
    # resumed from step 1: the run still ends bit for bit as the uninterrupted one
    assert [_no_timing(r) for r in _rows(out)] == [_no_timing(r) for r in straight]
    # with every checkpoint planted there is nothing to resume from: a one-line error, exit 2, nothing run
    for path in checkpoint.list_checkpoints(out):
        (path / "state.pt").write_bytes(pickle.dumps(_Planted(marker)))
    code, said = _resume(out, capsys, steps=4)
    assert code == 2 and not marker.exists()
    assert "no checkpoint in" in said and "refused" in said


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path, capsys, straight):
    out = _two_checkpoints(tmp_path)
    master = checkpoint.list_checkpoints(out)[-1] / "master.safetensors"
    master.write_bytes(master.read_bytes()[:100])  # cut, as a full disk or a copy cut short leaves it
    code, said = _resume(out, capsys)
    assert code == 0
    assert "master.safetensors is unreadable" in said and "resuming from" in said
    assert [_no_timing(r) for r in _rows(out)] == [_no_timing(r) for r in straight]


def test_a_run_killed_before_its_first_checkpoint_starts_over(tmp_path, capsys, straight):
    out = train(TrainConfig(steps=1, **BASE).validate(), tmp_path / "run", progress=False, tensorboard=False)
    for path in checkpoint.list_checkpoints(out):  # as if killed during step 1: metrics and config, no checkpoint
        for f in path.iterdir():
            f.unlink()
        path.rmdir()
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "loss": 0.1')  # and cut mid-line
    code, said = _resume(out, capsys)
    assert code == 0 and "has no checkpoint yet; starting it over from step 0" in said
    assert [_no_timing(r) for r in _rows(out)] == [_no_timing(r) for r in straight]
    # the same --out command restarts such a run too
    for path in checkpoint.list_checkpoints(out):
        for f in path.iterdir():
            f.unlink()
        path.rmdir()
    args = ["train", "--out", str(out), "--steps", "3", "--no-tensorboard"]
    args += ["--sync", "error-feedback", "--save-every", "1"]
    args += [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    assert main(args) == 0
    assert "stopped before its first checkpoint; starting it over" in capsys.readouterr().out
    assert [_no_timing(r) for r in _rows(out)] == [_no_timing(r) for r in straight]


def test_resume_drops_a_cut_last_metrics_line_and_keeps_the_rest(tmp_path, capsys, straight):
    out = _two_checkpoints(tmp_path)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss"')  # a kill mid-append during step 3
    code, _ = _resume(out, capsys)
    assert code == 0
    assert [_no_timing(r) for r in _rows(out)] == [_no_timing(r) for r in straight]
    (out / "metrics.jsonl").write_text('{"step": 0}\n{"step": oops}\n{"step": 1}\n')  # a bad line inside: refused
    code, said = _resume(out, capsys, steps=5)
    assert code == 2 and "metrics.jsonl:2: not a metrics line" in said


def test_durable_writes_leave_the_old_file_when_interrupted(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    durable.write_text(path, json.dumps({"steps": 1}))

    def killed(*args):
        raise KeyboardInterrupt  # the process stops between writing the new file and renaming it

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        durable.write_text(path, json.dumps({"steps": 2}))
    assert json.loads(path.read_text()) == {"steps": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]  # no temporary file left behind


def test_a_long_run_checkpoints_every_few_minutes_by_default(tmp_path, monkeypatch):
    """--save-minutes (default 10): a step that ends 10 minutes or more after the last checkpoint writes one, so
    a default run (--save-every 0) killed late loses at most that much. Each step here "takes" 6 minutes."""
    import roundalign.rl.loop as loop_module

    clock = iter(range(0, 10_000, 360))
    monkeypatch.setattr(loop_module.time, "monotonic", lambda: next(clock))
    config = TrainConfig(steps=5, **{**SMALL, "eval_every": 0}).validate()
    assert (config.save_every, config.save_minutes) == (0, 10.0)
    out = train(config, tmp_path / "run", progress=False, tensorboard=False)
    saved = sorted(int(p.name.removeprefix("step-")) for p in (out / "checkpoints").iterdir())
    assert saved == [4, 5]  # 2 and 4 were due (12 minutes each), 5 is the end; the two newest are kept
    with pytest.raises(Exception, match="--save-minutes must be a number >= 0"):
        TrainConfig(save_minutes=-1).validate()
