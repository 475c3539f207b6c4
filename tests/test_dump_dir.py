"""A dump directory is whole or refused: a reader refuses one that a killed writer left, saying so."""

from __future__ import annotations

import json

import pytest

from roundalign.errors import UserError
from roundalign.rollouts import dumpdir
from roundalign.rollouts.record import Rollout

ROLLOUTS = [Rollout([5, 6], [7, 8], [-0.5, -1.0], "stop"), Rollout([9], [10], [-0.25], "length")]
PREFILL = [[-0.5, -1.0], [-0.25]]


def _write(out, info=None):
    return dumpdir.write_dump(out, ROLLOUTS, PREFILL, info or {"engine": "vllm"})


def _read(out):
    return dumpdir.read_dump(out, vocab_size=264, max_model_len=256)


def test_a_dump_is_written_whole_and_replaces_an_older_one(tmp_path):
    out = _write(tmp_path / "dump")
    assert json.loads((out / "engine.json").read_text())["complete"] is True
    assert _read(out).rollouts[1].token_ids == [10]
    (out / "engine.log").write_text("the launcher's log")  # what probe puts beside a dump stays
    _write(out, {"engine": "sglang"})  # a second dump into the same directory replaces the first
    assert _read(out).info["engine"] == "sglang"
    assert sorted(p.name for p in out.iterdir()) == ["decode.jsonl", "engine.json", "engine.log", "prefill.jsonl"]


def test_a_killed_writer_leaves_nothing_readable_as_complete(tmp_path, monkeypatch):
    out = _write(tmp_path / "dump")
    calls = []

    def killed(path, rollouts):
        calls.append(path)
        if len(calls) == 2:  # during prefill.jsonl
            raise KeyboardInterrupt

    real = dumpdir.write_engine_logprobs
    monkeypatch.setattr(dumpdir, "write_engine_logprobs", lambda p, r: (killed(p, r), real(p, r)))
    with pytest.raises(KeyboardInterrupt):
        _write(out, {"engine": "sglang"})
    with pytest.raises(UserError, match="not a complete engine dump: engine.json missing"):
        _read(out)  # neither the old dump nor half of the new one is read
    monkeypatch.undo()
    assert _read(_write(out, {"engine": "sglang"})).info["engine"] == "sglang"  # the next dump there is whole


def test_an_incomplete_dump_is_refused_with_the_reason(tmp_path):
    out = _write(tmp_path / "dump")
    info = json.loads((out / "engine.json").read_text())
    del info["complete"]
    (out / "engine.json").write_text(json.dumps(info))
    with pytest.raises(UserError, match="does not record a complete dump"):
        _read(out)


def test_a_dump_never_overwrites_a_directory_of_other_files(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="holds other files than an engine dump"):
        _write(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_probe_reports_an_engine_that_fails_mid_dump_with_its_last_lines(tmp_path, engine_python, monkeypatch, capsys):
    """The real engine's dump fails (a test hook raises inside vLLM's run): probe exits 7 with the end of the engine's
    log, which says what failed, and no dump is left to be read as complete."""
    from roundalign.cli import main
    from roundalign.engines.failure import FAULT_ENV

    monkeypatch.setenv(FAULT_ENV, "dump:1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "probe"
    argv = ["probe", "--engine", "vllm", "--engine-python", engine_python, "--out", str(out), "--no-plots"]
    assert main(argv) == 7
    said = capsys.readouterr().err
    assert "wrote no dump" in said and "the engine failed during dump: RuntimeError: simulated engine failure" in said
    assert not (out / "engine-dump" / "engine.json").exists()
