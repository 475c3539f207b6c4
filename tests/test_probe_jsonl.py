"""Engine log-prob dump import: .venv/bin/python -m pytest -q tests/test_probe_jsonl.py

Every bad line must be an error naming the file, the line and the problem; nothing is skipped.
"""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from roundalign.rollouts.jsonl import (
    MAX_REPORTED,
    JSONLError,
    Rollout,
    read_engine_logprobs,
    write_engine_logprobs,
)

VOCAB, CONTEXT = 300, 32
GOOD = {"prompt_token_ids": [1, 2, 3], "token_ids": [4, 299], "logprobs": [-0.5, -0.0]}


def _write(tmp_path, *lines: str, name="dump.jsonl"):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _read(path):
    return read_engine_logprobs(path, vocab_size=VOCAB, max_model_len=CONTEXT)


def _line(**changes) -> str:
    record = dict(GOOD)
    for key, value in changes.items():
        if value is ...:
            record.pop(key)
        else:
            record[key] = value
    return json.dumps(record)


def test_reads_records_in_order(tmp_path):
    second = {"prompt_token_ids": [0], "token_ids": [7, 8, 9], "logprobs": [-1, -2.25, -1e-9], "text": "abc"}
    path = _write(tmp_path, json.dumps(GOOD), json.dumps(second), "", "  ")  # trailing blank lines are allowed
    got = _read(path)
    assert got == [
        Rollout([1, 2, 3], [4, 299], [-0.5, -0.0]),
        Rollout([0], [7, 8, 9], [-1.0, -2.25, -1e-9], text="abc"),  # the sampler's text is kept, not dropped
    ]
    assert all(isinstance(x, float) for x in got[1].logprobs)


def test_finish_reason_and_text_round_trip_and_must_be_strings(tmp_path):
    rollout = Rollout([1, 2], [3, 4], [-0.25, -1.5], finish_reason="stop", text="hi")
    write_engine_logprobs(tmp_path / "out.jsonl", [rollout])
    assert _read(tmp_path / "out.jsonl") == [rollout]
    path = _write(tmp_path, _line(finish_reason=3))
    with pytest.raises(JSONLError, match=r'"finish_reason" must be a string or null, got int'):
        _read(path)


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2, 3]", "expected a JSON object"),
        (_line(logprobs=...), "missing key(s) ['logprobs']"),
        (_line(log_probs=[-1.0, -1.0]), "unknown key(s) ['log_probs']"),
        (_line(temperature=0.7), "unknown key(s) ['temperature']"),
        (_line(token_ids=[4, 5.0]), '"token_ids"[1] is 5.0; token ids are JSON integers'),
        (_line(token_ids=[4, True]), '"token_ids"[1] is True'),
        (_line(prompt_token_ids="1 2 3"), '"prompt_token_ids" must be a list'),
        (_line(token_ids=[], logprobs=[]), '"token_ids" is empty'),
        (_line(prompt_token_ids=[]), '"prompt_token_ids" is empty'),
        (_line(logprobs=[-0.5]), '"logprobs" has 1 values but "token_ids" has 2 tokens'),
        (_line(token_ids=[4, 300]), '"token_ids"[1] = 300 is outside the model\'s vocabulary [0, 300)'),
        (_line(prompt_token_ids=[-1]), '"prompt_token_ids"[0] = -1 is outside'),
        (_line(logprobs=[-0.5, 0.25]), '"logprobs"[1] = 0.25 is above 0'),
        (_line(logprobs=[-0.5, "x"]), "\"logprobs\"[1] is 'x'; log-probs are JSON numbers"),
        (_line(logprobs=[-0.5, None]), '"logprobs"[1] is None'),
        (_line(logprobs=[False, -1.0]), '"logprobs"[0] is False'),
        ('{"prompt_token_ids": [1], "token_ids": [2], "logprobs": [NaN]}', '"logprobs"[0] is nan'),
        ('{"prompt_token_ids": [1], "token_ids": [2], "logprobs": [-Infinity]}', "must be finite"),
        ('{"prompt_token_ids": [1], "token_ids": [2], "logprobs": [-1e999]}', "must be finite"),
        (_line(prompt_token_ids=list(range(31))), "prompt (31) + completion (2) = 33 tokens, longer than"),
    ],
)
def test_each_bad_line_is_an_error_with_its_line_number(tmp_path, line, message):
    path = _write(tmp_path, json.dumps(GOOD), json.dumps(GOOD), line, json.dumps(GOOD))
    with pytest.raises(JSONLError) as err:
        _read(path)
    text = str(err.value)
    assert text.startswith(f"{path}:3: "), text
    assert message in text, text
    assert err.value.errors == [(3, err.value.errors[0][1])]
    assert isinstance(err.value, ValueError)


def test_context_limit_is_inclusive(tmp_path):
    path = _write(tmp_path, _line(prompt_token_ids=list(range(30))))  # 30 + 2 = 32 = max_model_len
    assert len(_read(path)) == 1


def test_all_bad_lines_are_reported_at_once(tmp_path):
    path = _write(tmp_path, _line(token_ids=[4, 300]), json.dumps(GOOD), "", json.dumps(GOOD), "oops")
    with pytest.raises(JSONLError) as err:
        _read(path)
    assert [line for line, _ in err.value.errors] == [1, 3, 5]
    lines = str(err.value).splitlines()
    assert lines[0].startswith(f"{path}:1: ")
    assert lines[1] == f"{path}:3: blank line between records; remove it (blank lines are allowed only at the end)"
    assert lines[2].startswith(f"{path}:5: not valid JSON")


def test_many_bad_lines_are_counted_not_all_listed(tmp_path):
    path = _write(tmp_path, *(["{}"] * (MAX_REPORTED + 5)))
    with pytest.raises(JSONLError) as err:
        _read(path)
    assert len(err.value.errors) == MAX_REPORTED + 5
    assert str(err.value).splitlines()[-1] == f"{path}: ... and 5 more bad lines"


@pytest.mark.parametrize("content", [b"", b"\n", b"\n  \n\t\n"])
def test_a_file_without_records_is_an_error(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(content)
    with pytest.raises(JSONLError, match=r"empty.jsonl:1: the file holds no records"):
        _read(path)


def test_non_utf8_line(tmp_path):
    path = tmp_path / "bin.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n\xff\xfe\n")
    with pytest.raises(JSONLError, match=r"bin.jsonl:2: not UTF-8"):
        _read(path)


def test_crlf_line_endings_are_fine(tmp_path):
    path = tmp_path / "crlf.jsonl"
    path.write_bytes((json.dumps(GOOD) + "\r\n").encode() * 2)
    assert len(_read(path)) == 2


@pytest.mark.parametrize("kwargs", [{"vocab_size": 0}, {"max_model_len": -1}, {"vocab_size": 3.0}])
def test_limits_must_be_positive_ints(tmp_path, kwargs):
    path = _write(tmp_path, json.dumps(GOOD))
    with pytest.raises(ValueError, match="must be a positive int"):
        read_engine_logprobs(path, **({"vocab_size": VOCAB, "max_model_len": CONTEXT} | kwargs))


# -----------------------------------------------------------------------------
# writer


records = st.lists(
    st.builds(
        lambda p, c: Rollout(p, [tok for tok, _ in c], [lp for _, lp in c]),
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
        st.lists(
            st.tuples(st.integers(0, VOCAB - 1), st.floats(max_value=0.0, allow_nan=False, allow_infinity=False)),
            min_size=1,
            max_size=8,
        ),
    ),
    min_size=1,
    max_size=5,
)


@settings(max_examples=50, deadline=None)
@given(records)
def test_write_then_read_is_exact(tmp_path_factory, rollouts):
    path = tmp_path_factory.mktemp("rt") / "dump.jsonl"
    write_engine_logprobs(path, rollouts)
    back = read_engine_logprobs(path, vocab_size=VOCAB, max_model_len=16)
    assert back == rollouts  # floats compare exactly: json writes the shortest repr that reads back


def test_write_rejects_bad_rollouts(tmp_path):
    with pytest.raises(ValueError, match="finite"):
        write_engine_logprobs(tmp_path / "x.jsonl", [Rollout([1], [2], [float("nan")])])
    with pytest.raises(ValueError, match=r"rollouts\[0\]: 1 log-probs for 2 tokens"):
        write_engine_logprobs(tmp_path / "x.jsonl", [Rollout([1], [2, 3], [-1.0])])
    with pytest.raises(TypeError, match="not a roundalign.rollouts.Rollout"):
        write_engine_logprobs(tmp_path / "x.jsonl", [GOOD])
