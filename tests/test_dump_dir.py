"""A dump directory appears whole or not at all, and a reader refuses one that is not whole, saying so."""

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
    _write(out, {"engine": "sglang"})  # a second dump into the same directory replaces the first whole
    assert _read(out).info["engine"] == "sglang"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dump"]  # no temporary or old directory left


def test_a_killed_writer_leaves_the_previous_dump_and_nothing_readable_as_complete(tmp_path, monkeypatch):
    out = _write(tmp_path / "dump")
    calls = []

    def killed(path, rollouts):
        calls.append(path)
        if len(calls) == 2:  # during prefill.jsonl
            raise KeyboardInterrupt

    monkeypatch.setattr(dumpdir, "write_engine_logprobs", killed)
    with pytest.raises(KeyboardInterrupt):
        _write(out, {"engine": "sglang"})
    assert _read(out).info["engine"] == "vllm"  # the previous dump, untouched
    (partial,) = [p for p in tmp_path.iterdir() if p.name.startswith(".dump.tmp-")]
    with pytest.raises(UserError):
        _read(partial)  # the half-written directory is not a dump


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
    with pytest.raises(UserError, match="exists and is not an engine dump"):
        _write(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
