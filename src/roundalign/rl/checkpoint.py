"""Run directories and checkpoints: what a resumed run needs to continue bit for bit.

A run directory holds ``config.json`` (the ``TrainConfig``), ``metrics.jsonl`` (one line per step, plus a step-0
line with the initial evaluation) and ``checkpoints/step-NNNNNN/``. A checkpoint is the whole state the next step
reads:

- ``master.safetensors``: the fp32 master weights;
- ``served.safetensors``: the engine's served copy (re-exporting instead would draw new stochastic-rounding noise);
- ``state.pt``: optimizer (AdamW moments), fp16 loss scaler, the exporter (stochastic-rounding generator states,
  error-feedback residuals) and the update tracker (previous served copy, lag history), and the step.

Everything else a step uses is a pure function of (seed, step): its problems and its sampling seed (rl/data.py).
A checkpoint is written to a temporary directory and renamed into place, so a crash mid-write never leaves a
half-written one; the two newest are kept. After a non-finite loss or gradient no checkpoint is written, so the
last one on disk is the last good state.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from roundalign.errors import UserError
from roundalign.rl.logbook import read_metrics

KEEP = 2
PREFIX = "step-"


def checkpoint_dir(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"{PREFIX}{step:06d}"


def save(out: Path, step: int, master: dict, served: dict, state: dict) -> Path:
    final = checkpoint_dir(out, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in master.items()}, str(tmp / "master.safetensors"))
    save_file({k: v.contiguous() for k, v in served.items()}, str(tmp / "served.safetensors"))
    torch.save(dict(state, step=step), tmp / "state.pt")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in list_checkpoints(out)[:-KEEP]:
        shutil.rmtree(old)
    return final


def list_checkpoints(out: Path) -> list[Path]:
    root = out / "checkpoints"
    if not root.is_dir():
        return []
    done = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(PREFIX) and not p.name.endswith(".tmp") and (p / "state.pt").is_file()
    ]
    return sorted(done, key=lambda p: int(p.name[len(PREFIX) :]))


def load_latest(out: Path) -> tuple[dict, dict, dict]:
    """(master, served, state) of the newest complete checkpoint in ``out``."""
    found = list_checkpoints(out)
    if not found:
        raise UserError(
            f"cannot resume: {str(out)!r} holds no checkpoint; runs save one at the end and every --save-every N steps"
        )
    path = found[-1]
    state = torch.load(path / "state.pt", weights_only=False)
    return load_file(str(path / "master.safetensors")), load_file(str(path / "served.safetensors")), state


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the lines of steps <= ``step``: a resumed run rewrites what came after its checkpoint."""
    kept = [m for m in read_metrics(path) if m["step"] <= step]
    path.write_text("".join(json.dumps(m) + "\n" for m in kept))
