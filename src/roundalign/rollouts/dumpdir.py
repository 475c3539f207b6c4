"""A dump directory: what a real engine sampled and how it scored it, as ``roundalign dump`` writes it.

    DIR/decode.jsonl    the sampler's log-probs: what the engine returned while it generated (its KV-cache decode)
    DIR/prefill.jsonl   the same sequences sent back as prompts (``prompt_logprobs``): one prefill forward each
    DIR/engine.json     which engine, version, compilation mode, custom ops, attention backend, linear kernels,
                        sampling settings, CPU/GPU, timings

A dump is whole or refused: each file is written atomically (``roundalign.durable``), ``engine.json`` is removed
first and written last, and records ``"complete": true``; a reader refuses a directory without it (a writer that was
killed, or a copy cut short), saying so.

Both JSONL files hold the same prompts and completions, line for line, in the import format of
``roundalign.rollouts.jsonl``, so each is also a valid ``--engine-logprobs FILE``. Two references matter because an
RL trainer is judged against the sampler's numbers (decode), while prefill is what a trainer-shaped forward of the
engine gives: the gap between them is the engine's own decode-vs-prefill difference.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from roundalign import durable
from roundalign.errors import MissingFile, UserError
from roundalign.rollouts.jsonl import read_engine_logprobs, write_engine_logprobs
from roundalign.rollouts.record import Rollout
from roundalign.untrusted import read_json_object

FORMAT, VERSION = "roundalign-engine-dump", 2  # 2: engine.json records "complete"
DUMP_FILES = ("decode.jsonl", "prefill.jsonl", "engine.json")
BESIDE = (
    "engine.log",
    "prompts.jsonl",
    "served-model",
)  # what probe, calibrate and a quantized dump write next to a dump
REFERENCES = ("decode", "prefill")  # file stems, and the reference names the probe reports


@dataclass
class EngineDump:
    """A dump directory, read: the rollouts (with the sampler's log-probs), the prefill log-probs, the engine."""

    path: Path
    rollouts: list[Rollout]  # .logprobs: decode
    prefill: list[list[float]]
    info: dict

    def references(self) -> dict[str, list[list[float]]]:
        return {"decode": [r.logprobs for r in self.rollouts], "prefill": self.prefill}


def write_dump(out: str | Path, rollouts: list[Rollout], prefill: list[list[float]], info: dict) -> Path:
    """Write ``decode.jsonl``, ``prefill.jsonl`` and then ``engine.json`` into ``out``, each file atomically. A
    previous dump there is replaced; a directory that holds anything but a dump and what ``probe``/``calibrate`` put
    beside one (``engine.log``, ``prompts.jsonl``) is refused."""
    out = Path(out)
    if len(prefill) != len(rollouts):
        raise ValueError(f"{len(rollouts)} rollouts but {len(prefill)} prefill log-prob lists")
    out.mkdir(parents=True, exist_ok=True)
    others = sorted(p.name for p in out.iterdir() if p.name not in (*DUMP_FILES, *BESIDE) and ".tmp-" not in p.name)
    if others:
        raise UserError(f"{out} holds other files than an engine dump ({others[0]}, ...); choose another --out")
    # From here until engine.json is written again the directory is not a complete dump, and readers say so.
    (out / "engine.json").unlink(missing_ok=True)
    durable.fsync(out)
    write_engine_logprobs(out / "decode.jsonl", rollouts)
    pairs = zip(rollouts, prefill, strict=True)
    scored = [Rollout(r.prompt_token_ids, r.token_ids, list(lp), r.finish_reason) for r, lp in pairs]
    write_engine_logprobs(out / "prefill.jsonl", scored)
    record = {"format": FORMAT, "version": VERSION, **info, "complete": True}
    durable.write_text(out / "engine.json", json.dumps(record, indent=2) + "\n")  # last: the dump is whole
    return out


def read_info(path: str | Path) -> dict:
    """A dump directory's engine.json, checked: the engine that ran and how."""
    path = Path(path)
    if not (path / "engine.json").is_file():
        raise UserError(
            f"{path} is a directory but not an engine dump (no engine.json): roundalign dump writes decode.jsonl, "
            "prefill.jsonl and engine.json; pass a single .jsonl file otherwise"
        )
    info = read_json_object(path / "engine.json", "an engine dump's engine.json (roundalign dump writes it)")
    if info.get("format") != FORMAT:
        raise UserError(f"{path / 'engine.json'} is not a roundalign engine dump (its format is not {FORMAT!r})")
    if info.get("version") != VERSION:
        raise UserError(
            f"{path / 'engine.json'} has dump version {info.get('version')!r}; this roundalign reads version "
            f"{VERSION}: re-run roundalign dump with this roundalign"
        )
    if info.get("complete") is not True:
        raise UserError(
            f"{path / 'engine.json'} does not record a complete dump: the run that wrote it stopped before it "
            "finished (or this is a copy of its temporary directory); re-run roundalign dump"
        )
    if not isinstance(info.get("engine"), str):
        raise UserError(f"{path / 'engine.json'} does not say which engine ran (its 'engine' field)")
    return info


def read_dump(path: str | Path, *, vocab_size: int, max_model_len: int) -> EngineDump:
    """Read a dump directory strictly: both files present, valid, and holding the same sequences in order."""
    path = Path(path)
    if not path.is_dir():
        raise MissingFile(f"engine dump directory {str(path)!r} does not exist")
    missing = [n for n in ("decode.jsonl", "prefill.jsonl", "engine.json") if not (path / n).is_file()]
    if missing:
        raise UserError(
            f"{path} is not a complete engine dump: {', '.join(missing)} missing (roundalign dump writes "
            "decode.jsonl, prefill.jsonl and engine.json; pass a single .jsonl file to --engine-logprobs otherwise)"
        )
    info = read_info(path)
    decode = read_engine_logprobs(path / "decode.jsonl", vocab_size=vocab_size, max_model_len=max_model_len)
    prefill = read_engine_logprobs(path / "prefill.jsonl", vocab_size=vocab_size, max_model_len=max_model_len)
    if len(decode) != len(prefill):
        raise UserError(f"{path}: decode.jsonl has {len(decode)} sequences, prefill.jsonl {len(prefill)}")
    for i, (d, p) in enumerate(zip(decode, prefill, strict=True), 1):
        if d.prompt_token_ids != p.prompt_token_ids or d.token_ids != p.token_ids:
            raise UserError(f"{path}: line {i} of decode.jsonl and prefill.jsonl hold different sequences")
    return EngineDump(path, decode, [p.logprobs for p in prefill], info)


def read_references(path: str | Path, config) -> tuple[list[Rollout], dict[str, list[list[float]]], dict | None]:
    """What ``--engine-logprobs PATH`` reads, checked against a model's HF ``config``: a dump directory gives
    ``{"decode": ..., "prefill": ...}`` and its engine.json; a single JSONL file gives ``{"jsonl": ...}`` and None."""
    from roundalign.rollouts.jsonl import read_rollouts

    if Path(path).is_dir():
        dump = read_dump(path, vocab_size=config.vocab_size, max_model_len=config.max_position_embeddings)
        return dump.rollouts, dump.references(), dump.info
    rollouts = read_rollouts(path, config)
    return rollouts, {"jsonl": [r.logprobs for r in rollouts]}, None
