"""The probe's report: one versioned JSON document (``report.json``), built, validated, written and loaded here.

The schema is documented field by field in docs/probe-report.md. ``SCHEMA`` names it and its major version; a
change that removes or redefines a field bumps the version, a new optional field does not. ``validate_report``
checks everything a reader (the table, the plots, a user's script) relies on, so a report that loads is a report
that renders. Numbers are JSON numbers or null, never NaN or Infinity (``json`` would write those as invalid
JSON); undefined metrics are null and the run's ``notes`` say why.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path

from roundalign import durable
from roundalign.numerics.metrics import METRIC_KEYS

SCHEMA = "roundalign.probe.report/2"
REPORT_FILE = "report.json"

REFERENCES = ("decode", "prefill", "jsonl")
ENGINE_SOURCES = ("roundalign.engine", "jsonl", "dump")  # dump: a roundalign dump directory
LAYER_ROW_KEYS = ("layer", "equal_frac", "differ", "max_ulp", "mean_abs_diff")
TOP_LEVEL_KEYS = (
    "schema", "created", "roundalign_version", "torch_version", "model", "engine", "tokens",
    "comparisons", "attribution", "layers", "decode_shapes", "notes", "plots",
)  # fmt: skip
ATTRIBUTION_KEYS = (
    "trainer_profile", "engine_profile", "backend", "reference", "metric", "base", "target", "regions",
)  # fmt: skip


def _versions() -> tuple[str, str]:
    import torch

    import roundalign

    return roundalign.__version__, torch.__version__


def build_report(
    *,
    model: dict,
    engine: dict,
    tokens: dict,
    comparisons: list[dict],
    attribution: list[dict] | None = None,
    layers: list[dict] | None = None,
    decode_shapes: dict | None = None,
    notes: list[str] | None = None,
    plots: dict[str, str] | None = None,
    created: str | None = None,
) -> dict:
    """Assemble a report dict (schema, creation time, versions filled in) and validate it."""
    roundalign_version, torch_version = _versions()
    report = {
        "schema": SCHEMA,
        "created": created or datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "roundalign_version": roundalign_version,
        "torch_version": torch_version,
        "model": model,
        "engine": engine,
        "tokens": tokens,
        "comparisons": list(comparisons),
        "attribution": list(attribution or []),
        "layers": list(layers or []),
        "decode_shapes": decode_shapes,
        "notes": list(notes or []),
        "plots": dict(plots or {}),
    }
    validate_report(report)
    return report


def write_report(report: dict, out_dir: str | Path) -> Path:
    """Validate and write ``out_dir/report.json`` (creating out_dir); return its path."""
    validate_report(report)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / REPORT_FILE
    durable.write_text(path, json.dumps(report, indent=2, allow_nan=False) + "\n")
    return path


def load_report(path: str | Path) -> dict:
    """Read and validate a report; ``path`` is the JSON file or the folder holding ``report.json``."""
    path = Path(path)
    if path.is_dir():
        path = path / REPORT_FILE
    try:
        report = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err.msg}, line {err.lineno})") from None
    validate_report(report)
    return report


# -----------------------------------------------------------------------------
# Validation: each check names the field by its path in the document.


def _fail(where: str, what: str):
    raise ValueError(f"malformed probe report: {where}: {what}")


def _obj(x, where: str, keys: tuple[str, ...]) -> dict:
    if not isinstance(x, dict):
        _fail(where, f"expected an object, got {type(x).__name__}")
    missing = [k for k in keys if k not in x]
    if missing:
        _fail(where, f"missing field(s) {missing}")
    return x


def _str(x, where: str, choices: tuple[str, ...] | None = None) -> None:
    if not isinstance(x, str):
        _fail(where, f"expected a string, got {x!r}")
    if choices is not None and x not in choices:
        _fail(where, f"{x!r} is not one of {list(choices)}")


def _int(x, where: str, *, allow_none: bool = False) -> None:
    if x is None and allow_none:
        return
    if not isinstance(x, int) or isinstance(x, bool) or x < 0:
        _fail(where, f"expected a non-negative integer, got {x!r}")


def _num(x, where: str, *, allow_none: bool = True) -> None:
    if x is None and allow_none:
        return
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        _fail(where, f"expected a number{' or null' if allow_none else ''}, got {x!r}")
    if not math.isfinite(x):
        _fail(where, f"{x} is not a finite number; write null for an undefined value")


def _list(x, where: str) -> list:
    if not isinstance(x, list):
        _fail(where, f"expected a list, got {type(x).__name__}")
    return x


def _metrics(m, where: str) -> None:
    _obj(m, where, METRIC_KEYS)
    for key, value in m.items():
        _num(value, f"{where}.{key}")


def _layer_rows(rows, where: str) -> None:
    for i, row in enumerate(_list(rows, where)):
        w = f"{where}[{i}]"
        _obj(row, w, LAYER_ROW_KEYS)
        _int(row["layer"], f"{w}.layer")
        _num(row["equal_frac"], f"{w}.equal_frac", allow_none=False)
        if not 0 <= row["equal_frac"] <= 1:
            _fail(f"{w}.equal_frac", f"{row['equal_frac']} is not a fraction in [0, 1]")
        _int(row["differ"], f"{w}.differ")
        _num(row["max_ulp"], f"{w}.max_ulp", allow_none=False)
        if row["max_ulp"] < 0:
            _fail(f"{w}.max_ulp", f"{row['max_ulp']} is negative")
        _num(row["mean_abs_diff"], f"{w}.mean_abs_diff")


def validate_report(report: dict) -> None:
    """Raise ValueError naming the first malformed field; return None for a well-formed report."""
    _obj(report, "report", ("schema",))
    if report["schema"] != SCHEMA:
        _fail("schema", f"{report['schema']!r} is not {SCHEMA!r}, the version this roundalign reads")
    _obj(report, "report", TOP_LEVEL_KEYS)
    for key in ("created", "roundalign_version", "torch_version"):
        _str(report[key], key)

    model = _obj(report["model"], "model", ("path", "model_type", "num_layers", "vocab_size", "parameters"))
    _str(model["path"], "model.path")
    _str(model["model_type"], "model.model_type")
    for key in ("num_layers", "vocab_size", "parameters"):
        _int(model[key], f"model.{key}")

    engine = _obj(report["engine"], "engine", ("source", "profile", "backends", "sampling", "jsonl"))
    _str(engine["source"], "engine.source", ENGINE_SOURCES)
    if engine["profile"] is not None:
        _obj(engine["profile"], "engine.profile", ("name",))
    for i, b in enumerate(_list(engine["backends"], "engine.backends")):
        _str(b, f"engine.backends[{i}]")
    if engine["sampling"] is not None and not isinstance(engine["sampling"], dict):
        _fail("engine.sampling", "expected an object or null")
    if engine["jsonl"] is not None:
        _str(engine["jsonl"], "engine.jsonl")
    if (engine["source"] in ("jsonl", "dump")) != (engine["jsonl"] is not None):
        _fail("engine.jsonl", "is the dump's path exactly when engine.source is 'jsonl' or 'dump'")
    if (engine["source"] == "dump") != isinstance(engine.get("real"), dict):
        _fail("engine.real", "is the real engine's description (an object) exactly when engine.source is 'dump'")

    tokens = _obj(report["tokens"], "tokens", ("sequences", "prompt_tokens", "completion_tokens"))
    for key in ("sequences", "prompt_tokens", "completion_tokens"):
        _int(tokens[key], f"tokens.{key}")
    for key in ("mean_entropy_nats", "log_vocab"):
        _num(tokens.get(key), f"tokens.{key}")

    comparisons = _list(report["comparisons"], "comparisons")
    if not comparisons:
        _fail("comparisons", "empty; a report compares at least one trainer profile with one reference")
    for i, c in enumerate(comparisons):
        w = f"comparisons[{i}]"
        _obj(c, w, ("trainer_profile", "backend", "reference", "metrics"))
        _str(c["trainer_profile"], f"{w}.trainer_profile")
        _str(c["backend"], f"{w}.backend")
        _str(c["reference"], f"{w}.reference", REFERENCES)
        _metrics(c["metrics"], f"{w}.metrics")

    for i, a in enumerate(_list(report["attribution"], "attribution")):
        w = f"attribution[{i}]"
        _obj(a, w, ATTRIBUTION_KEYS)
        for key in ("trainer_profile", "engine_profile", "backend", "metric"):
            _str(a[key], f"{w}.{key}")
        _str(a["reference"], f"{w}.reference", REFERENCES)
        _num(a["base"], f"{w}.base")
        _num(a["target"], f"{w}.target")
        if a.get("share_undefined") is not None:  # optional: why the switch shares mean nothing here
            _str(a["share_undefined"], f"{w}.share_undefined")
        for j, r in enumerate(_list(a["regions"], f"{w}.regions")):
            wr = f"{w}.regions[{j}]"
            _obj(r, wr, ("region", "trainer_rule", "engine_rule", "value", "share"))
            for key in ("region", "trainer_rule", "engine_rule"):
                _str(r[key], f"{wr}.{key}")
            _num(r["value"], f"{wr}.value")
            _num(r["share"], f"{wr}.share")

    for i, entry in enumerate(_list(report["layers"], "layers")):
        w = f"layers[{i}]"
        _obj(entry, w, ("trainer_profile", "backend", "layers"))
        _str(entry["trainer_profile"], f"{w}.trainer_profile")
        _str(entry["backend"], f"{w}.backend")
        _layer_rows(entry["layers"], f"{w}.layers")

    shapes = report["decode_shapes"]
    if shapes is not None:
        _obj(shapes, "decode_shapes", ("backend", "trainer_profile", "variants"))
        _str(shapes["backend"], "decode_shapes.backend")
        _str(shapes["trainer_profile"], "decode_shapes.trainer_profile")
        for i, v in enumerate(_list(shapes["variants"], "decode_shapes.variants")):
            w = f"decode_shapes.variants[{i}]"
            _obj(v, w, ("prefill_shaped", "metrics"))
            for j, region in enumerate(_list(v["prefill_shaped"], f"{w}.prefill_shaped")):
                _str(region, f"{w}.prefill_shaped[{j}]")
            _metrics(v["metrics"], f"{w}.metrics")

    for i, note in enumerate(_list(report["notes"], "notes")):
        _str(note, f"notes[{i}]")
    plots = report["plots"]
    if not isinstance(plots, dict):
        _fail("plots", "expected an object mapping plot names to file names")
    for name, file in plots.items():
        _str(file, f"plots.{name}")
        if Path(file).is_absolute() or ".." in Path(file).parts:
            _fail(f"plots.{name}", f"{file!r} must be a file name relative to the report's folder")
