"""Every reader of a file a user may have received, fed random and malformed bytes (hypothesis): the result is either
what the file holds or a ``UserError`` whose every line names the file (and the line, where it has lines), never a
traceback of another kind and never a record silently skipped.

The inputs: random bytes, text in other encodings (UTF-16, Latin-1), JSON of the wrong types, NaN and infinities,
lines cut short and over-long lines, each the way a truncated copy, a wrong file or a hand edit makes them. The
readers: prompt files, engine log-prob dumps (JSONL), profile files, fingerprint results, a run's ``metrics.jsonl``
and its ``config.json`` on ``--resume``.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from roundalign.errors import UserError

EXAMPLES = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)

_json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)  # fmt: skip


def _encodings(text: str) -> st.SearchStrategy[bytes]:
    return st.sampled_from(["utf-8", "utf-16", "latin-1"]).map(lambda enc: text.encode(enc, errors="replace"))


def _cut(data: bytes) -> st.SearchStrategy[bytes]:
    return st.integers(0, len(data)).map(lambda n: data[:n])


def _file_bytes(valid: bytes, json_lines: bool) -> st.SearchStrategy[bytes]:
    """Malformed variants of ``valid``: random bytes, cut copies, other encodings, wrong JSON, NaN, long lines."""
    wrong_json = _json_value.map(lambda v: json.dumps(v).encode())
    lines = st.lists(wrong_json, min_size=1, max_size=4).map(lambda ls: b"\n".join(ls) + b"\n")
    long_line = st.integers(10_000, 200_000).map(lambda n: b"[" + b"1," * n + b"1]\n")
    options = [st.binary(max_size=400), _cut(valid), _encodings(valid.decode()), wrong_json, long_line]
    if json_lines:
        options += [lines, _cut(valid).map(lambda b: valid + b)]
    return st.one_of(*options)


def _check(path, data: bytes, read) -> None:
    """Write ``data`` to ``path``, read it: a result, or a UserError whose every line names the file."""
    path.write_bytes(data)
    try:
        read(path)
    except UserError as e:
        message = str(e)
        assert message.strip(), "an empty error message"
        for line in message.splitlines():
            assert path.name in line, f"an error line that does not name the file: {line!r}"
    # anything else propagates and fails the test: a traceback the user would see


@pytest.fixture(scope="module")
def tokenizer_config():
    from transformers import AutoConfig

    from roundalign.models import path

    return AutoConfig.from_pretrained(path("tiny-qwen3"))


@EXAMPLES
@given(data=_file_bytes(b"Mia has 7 pens. Answer:\n[1, 2, 3]\n", json_lines=False))
def test_prompt_files(tmp_path, data):
    from roundalign.prompts import read_prompts

    _check(tmp_path / "prompts.txt", data, read_prompts)


VALID_DUMP = json.dumps({"prompt_token_ids": [5, 6, 7], "token_ids": [8, 9], "logprobs": [-0.5, -1.25]}).encode()


@EXAMPLES
@given(data=_file_bytes(VALID_DUMP + b"\n", json_lines=True))
def test_engine_logprob_dumps(tmp_path, tokenizer_config, data):
    from roundalign.rollouts.jsonl import read_rollouts

    _check(tmp_path / "dump.jsonl", data, lambda p: read_rollouts(p, tokenizer_config))


@EXAMPLES
@given(data=_file_bytes(json.dumps({"name": "x", "rms_norm": "hf"}).encode(), json_lines=False))
def test_profile_files(tmp_path, data):
    from roundalign.profiles import Profile

    _check(tmp_path / "profile.json", data, Profile.load)


@EXAMPLES
@given(data=_file_bytes(b'{"step": 0, "eval/accuracy": 0.5}\n{"step": 1, "loss": NaN}\n', json_lines=True))
def test_run_metrics(tmp_path, data):
    from roundalign.rl.logbook import read_metrics

    _check(tmp_path / "metrics.jsonl", data, read_metrics)


@EXAMPLES
@given(data=_file_bytes(json.dumps({"steps": 2, "sync": "rne", "lr": 1e-4}).encode(), json_lines=False))
def test_config_json_on_resume(tmp_path, data):
    from roundalign.rl.cli import TrainRun

    _check(tmp_path / "config.json", data, lambda p: TrainRun(resume=str(p.parent)).validate())


@EXAMPLES
@given(data=st.one_of(st.binary(max_size=400), _json_value.map(lambda v: json.dumps(v).encode())))
def test_fingerprint_results(tmp_path, data):
    from roundalign.fingerprint.reader import load_results

    _check(tmp_path / "results.pt", data, load_results)


@EXAMPLES
@given(data=st.one_of(st.binary(max_size=400), _json_value.map(lambda v: json.dumps(v).encode())))
def test_fingerprint_batteries(tmp_path, data, capsys):
    """The battery runner is a standalone script for the engine's machine: a bad battery is exit 2 and one line."""
    from roundalign.fingerprint.runner import main

    path = tmp_path / "battery.pt"
    path.write_bytes(data)
    assert main([str(path), "--engine", "native", "--out", str(tmp_path / "results.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run_fingerprint: error:" in err[0], err


@EXAMPLES
@given(data=_file_bytes(json.dumps({"format": "roundalign-engine-dump", "version": 2, "engine": "vllm",
                                    "complete": True}).encode(), json_lines=False))  # fmt: skip
def test_dump_directories(tmp_path, tokenizer_config, data):
    from roundalign.rollouts.dumpdir import read_references, write_dump
    from roundalign.rollouts.record import Rollout

    out = tmp_path / "dump"
    if not (out / "decode.jsonl").exists():
        write_dump(out, [Rollout([5], [8], [-0.5], "stop")], [[-0.5]], {"engine": "vllm"})
    (out / "engine.json").write_bytes(data)
    try:
        read_references(out, tokenizer_config)
    except UserError as e:
        assert all("engine.json" in line or str(out) in line for line in str(e).splitlines()), str(e)


def test_nan_and_infinite_log_probs_are_refused_by_line(tmp_path, tokenizer_config):
    from roundalign.rollouts.jsonl import read_rollouts

    for bad in (math.nan, math.inf, -math.inf):
        record = {"prompt_token_ids": [5], "token_ids": [8], "logprobs": [bad]}
        path = tmp_path / "dump.jsonl"
        path.write_text(VALID_DUMP.decode() + "\n" + json.dumps(record) + "\n")
        with pytest.raises(UserError, match=r"dump\.jsonl:2:"):
            read_rollouts(path, tokenizer_config)
