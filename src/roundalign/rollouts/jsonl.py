"""Read and write engine log-prob dumps: one JSON object per line, the probe's import format.

``roundalign probe --engine-logprobs dump.jsonl`` compares a trainer against log-probs that a real vLLM or
SGLang run wrote (docs/real-engines.md shows the few lines that write the file). Each line is::

    {"prompt_token_ids": [...], "token_ids": [...], "logprobs": [...]}

``logprobs[i]`` is the engine's log-prob of ``token_ids[i]`` given the prompt and ``token_ids[:i]``.

A dump that is silently half-read would produce confident, wrong metrics, so the reader is strict: every bad line
is reported with its line number and what to fix, all bad lines at once, and nothing is skipped or truncated.
Decisions (documented in docs/real-engines.md):

- Keys: the three above are required. ``finish_reason`` and ``text`` may be present and are kept in the record
  (strings, or null); ``prompt`` and ``id`` may be present for the user's own bookkeeping and are ignored. Any
  other key is an error: a misspelt key (``log_probs``) or a setting the probe cannot honour (``temperature``)
  must not pass unnoticed.
- Blank lines: allowed only at the end of the file (a trailing newline, an editor's extra lines). A blank line
  between records usually means a broken writer, so it is an error.
- Ids are JSON integers (not floats, not booleans) in [0, vocab_size). Log-probs are JSON numbers, finite and
  <= 0. The prompt and the completion are non-empty (the first completion token is scored from the last prompt
  position), and together fit in the model's context (max_model_len).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from roundalign import durable
from roundalign.errors import UserError
from roundalign.rollouts.record import Rollout

REQUIRED_KEYS = ("prompt_token_ids", "token_ids", "logprobs")
KEPT_KEYS = ("finish_reason", "text")  # optional, carried into the Rollout
IGNORED_KEYS = frozenset({"prompt", "id"})

# A dump with thousands of bad lines is one mistake repeated; list this many, count the rest.
MAX_REPORTED = 20


class JSONLError(UserError):
    """A malformed dump. ``errors`` holds (line number, message) for every bad line found."""

    def __init__(self, path: str | Path, errors: list[tuple[int, str]]):
        self.path = str(path)
        self.errors = errors
        lines = [f"{self.path}:{line}: {msg}" for line, msg in errors[:MAX_REPORTED]]
        if len(errors) > MAX_REPORTED:
            lines.append(f"{self.path}: ... and {len(errors) - MAX_REPORTED} more bad lines")
        super().__init__("\n".join(lines))


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_ids(key: str, ids, vocab_size: int) -> str | None:
    if not isinstance(ids, list):
        return f'"{key}" must be a list of token ids, got {type(ids).__name__}'
    if not ids:
        return f'"{key}" is empty; every record needs at least one token there'
    for i, tok in enumerate(ids):
        if not _is_int(tok):
            return f'"{key}"[{i}] is {tok!r}; token ids are JSON integers'
        if not 0 <= tok < vocab_size:
            return (
                f'"{key}"[{i}] = {tok} is outside the model\'s vocabulary [0, {vocab_size}); '
                "was the dump written with another model or tokenizer?"
            )
    return None


def _check_logprobs(logprobs, n_tokens: int) -> str | None:
    if not isinstance(logprobs, list):
        return f'"logprobs" must be a list of numbers, got {type(logprobs).__name__}'
    if len(logprobs) != n_tokens:
        return (
            f'"logprobs" has {len(logprobs)} values but "token_ids" has {n_tokens} tokens; '
            "write exactly one log-prob per completion token"
        )
    for i, lp in enumerate(logprobs):
        if isinstance(lp, bool) or not isinstance(lp, (int, float)):
            return f'"logprobs"[{i}] is {lp!r}; log-probs are JSON numbers'
        if not math.isfinite(lp):
            return f'"logprobs"[{i}] is {lp}; log-probs must be finite (was the token impossible for the engine?)'
        if lp > 0:
            return f'"logprobs"[{i}] = {lp} is above 0; a log-prob is log of a probability <= 1 (logits dumped?)'
    return None


def _parse_record(text: str, vocab_size: int, max_model_len: int) -> Rollout | str:
    """The record on one line, or a message saying what is wrong with it."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        return f"not valid JSON ({err.msg} at column {err.colno}); each line must be one JSON object"
    if not isinstance(obj, dict):
        return f"expected a JSON object with keys {list(REQUIRED_KEYS)}, got a JSON {type(obj).__name__}"
    missing = [k for k in REQUIRED_KEYS if k not in obj]
    if missing:
        return f"missing key(s) {missing}; each record needs {list(REQUIRED_KEYS)}"
    unknown = sorted(set(obj) - set(REQUIRED_KEYS) - set(KEPT_KEYS) - IGNORED_KEYS)
    if unknown:
        return (
            f"unknown key(s) {unknown}; allowed are {list(REQUIRED_KEYS)}, optionally {list(KEPT_KEYS)} and, "
            f"ignored, {sorted(IGNORED_KEYS)}"
        )
    for key in KEPT_KEYS:
        if obj.get(key) is not None and not isinstance(obj[key], str):
            return f'"{key}" must be a string or null, got {type(obj[key]).__name__}'

    problem = (
        _check_ids("prompt_token_ids", obj["prompt_token_ids"], vocab_size)
        or _check_ids("token_ids", obj["token_ids"], vocab_size)
        or _check_logprobs(obj["logprobs"], len(obj["token_ids"]))
    )
    if problem:
        return problem
    total = len(obj["prompt_token_ids"]) + len(obj["token_ids"])
    if total > max_model_len:
        return (
            f"prompt ({len(obj['prompt_token_ids'])}) + completion ({len(obj['token_ids'])}) = {total} tokens, "
            f"longer than the model's context of {max_model_len}"
        )
    return Rollout(
        prompt_token_ids=list(obj["prompt_token_ids"]),
        token_ids=list(obj["token_ids"]),
        logprobs=[float(x) for x in obj["logprobs"]],
        finish_reason=obj.get("finish_reason"),
        text=obj.get("text"),
    )


def read_engine_logprobs(path: str | Path, *, vocab_size: int, max_model_len: int) -> list[Rollout]:
    """Every record of a dump, in file order; a JSONLError listing each bad line if any line is bad."""
    for name, value in (("vocab_size", vocab_size), ("max_model_len", max_model_len)):
        if not _is_int(value) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    path = Path(path)
    raw_lines = path.read_bytes().splitlines()
    # Trailing blank lines are allowed; anything blank before the last record is not.
    end = len(raw_lines)
    while end > 0 and not raw_lines[end - 1].strip():
        end -= 1
    if end == 0:
        raise JSONLError(path, [(1, "the file holds no records; expected one JSON object per line")])

    records: list[Rollout] = []
    errors: list[tuple[int, str]] = []
    for number, raw in enumerate(raw_lines[:end], start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            errors.append((number, f"not UTF-8 text ({err.reason} at byte {err.start})"))
            continue
        if not text.strip():
            errors.append((number, "blank line between records; remove it (blank lines are allowed only at the end)"))
            continue
        parsed = _parse_record(text, vocab_size, max_model_len)
        if isinstance(parsed, str):
            errors.append((number, parsed))
        else:
            records.append(parsed)
    if errors:
        raise JSONLError(path, errors)
    return records


def read_rollouts(path: str | Path, config) -> list[Rollout]:
    """A dump's rollouts, checked against a model's vocabulary and context (its HF ``config``)."""
    if not Path(path).is_file():
        raise UserError(f"engine log-prob dump {str(path)!r} does not exist")
    return read_engine_logprobs(path, vocab_size=config.vocab_size, max_model_len=config.max_position_embeddings)


def write_engine_logprobs(path: str | Path, rollouts: list[Rollout]) -> None:
    """Write rollouts in the import format, one per line; floats are written so that they read back exactly. The file
    is replaced atomically (``roundalign.durable``)."""
    lines = []
    for i, ro in enumerate(rollouts):
        if not isinstance(ro, Rollout):
            raise TypeError(f"rollouts[{i}] is a {type(ro).__name__}, not a roundalign.rollouts.Rollout")
        if ro.logprobs is None:
            raise ValueError(f"rollouts[{i}] has no log-probs; a dump records the sampler's log-prob of every token")
        if len(ro.logprobs) != len(ro.token_ids):
            raise ValueError(f"rollouts[{i}]: {len(ro.logprobs)} log-probs for {len(ro.token_ids)} tokens")
        record = {
            "prompt_token_ids": [int(x) for x in ro.prompt_token_ids],
            "token_ids": [int(x) for x in ro.token_ids],
            "logprobs": [float(x) for x in ro.logprobs],
            **{key: getattr(ro, key) for key in KEPT_KEYS if getattr(ro, key) is not None},
        }
        try:
            lines.append(json.dumps(record, allow_nan=False, separators=(", ", ": ")))
        except ValueError as err:
            raise ValueError(f"rollouts[{i}]: log-probs must be finite to be written ({err})") from None
    durable.write_text(path, "".join(line + "\n" for line in lines))  # whole or not at all
