"""Run directories and checkpoints: what a resumed run needs to continue bit for bit.

A run directory holds ``config.json`` (the ``TrainConfig``), ``metrics.jsonl`` (one line per step, plus a step-0
line with the initial evaluation) and ``checkpoints/step-NNNNNN/``. A checkpoint is the whole state the next step
reads:

- ``master.safetensors``: the fp32 master weights;
- ``served.safetensors``: the engine's served copy (re-exporting instead would draw new stochastic-rounding noise);
- ``state.pt``: optimizer (AdamW moments), fp16 loss scaler, the exporter (stochastic-rounding generator states,
  error-feedback residuals) and the update tracker (previous served copy, lag history), and the step.

Everything else a step uses is a pure function of (seed, step): its problems and its sampling seed (rl/data.py).
A checkpoint is written to a temporary directory, fsynced and renamed into place (``roundalign.durable``), so a
crash mid-write never leaves a half-written one; the two newest are kept. After a non-finite loss or gradient no
checkpoint is written, so the last one on disk is the last good state.

**Opening a checkpoint runs no code.** ``state.pt`` holds only tensors, numbers, strings and containers of them,
and is read with ``torch.load(weights_only=True)``, torch's unpickler that builds only those types: a ``state.pt``
holding any other object (a pickle whose ``__reduce__`` would run a command, say) is refused, not executed. Run
directories are passed between people; resuming one must never run its author's code.

**Resume falls back.** ``load_latest`` reads the newest checkpoint that reads whole and says why it skipped any
newer one (a corrupt file, a refused ``state.pt``).
"""

from __future__ import annotations

import json
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from roundalign import durable
from roundalign.errors import UserError
from roundalign.rl import faults
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
    faults.point("checkpoint", step)
    save_file({k: v.contiguous() for k, v in served.items()}, str(tmp / "served.safetensors"))
    torch.save(dict(state, step=step), tmp / "state.pt")
    shutil.rmtree(final, ignore_errors=True)  # the same step saved again (a resumed run re-running it)
    durable.replace_dir(tmp, final)
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


def load_latest(out: Path, report: Callable[[str], None] | None = None) -> tuple[dict, dict, dict] | None:
    """(master, served, state) of the newest checkpoint in ``out`` that reads whole; None when there is none.
    ``report(message)`` hears about each newer checkpoint skipped, and why. A directory whose every checkpoint is
    unreadable is a ``UserError`` listing each one's reason."""
    found = list_checkpoints(out)
    skipped = []
    for path in reversed(found):
        try:
            loaded = load(path)
        except UserError as e:
            skipped.append(str(e))
            continue
        for reason in skipped:
            if report is not None:
                report(f"skipped a newer checkpoint: {reason}; resuming from {path}")
        return loaded
    if skipped:
        raise UserError("cannot resume: no checkpoint in " + repr(str(out)) + " reads whole: " + "; ".join(skipped))
    return None


def load(path: Path) -> tuple[dict, dict, dict]:
    """(master, served, state) of one checkpoint; a ``UserError`` naming the file and what is wrong with it."""
    try:
        state = torch.load(path / "state.pt", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise UserError(
            f"{path / 'state.pt'} holds objects other than tensors and plain data, which loading would construct "
            f"(code could run); refused ({first})"
        ) from None
    except (RuntimeError, EOFError, OSError) as e:
        raise UserError(f"{path / 'state.pt'} is unreadable ({type(e).__name__}: {e})") from None
    if (
        not isinstance(state, dict)
        or not isinstance(state.get("step"), int)
        or not all(k in state for k in ("policy", "exporter", "tracker"))
    ):
        raise UserError(f"{path / 'state.pt'} is not a roundalign training state (step, policy, exporter, tracker)")
    weights = []
    for name in ("master.safetensors", "served.safetensors"):
        try:
            weights.append(load_file(str(path / name)))
        except (SafetensorError, OSError) as e:
            raise UserError(f"{path / name} is unreadable ({e})") from None
    return weights[0], weights[1], state


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the lines of steps <= ``step``: a resumed run rewrites what came after its checkpoint. The file is
    replaced atomically: a kill during the rewrite leaves the old one."""
    kept = [m for m in read_metrics(path) if m["step"] <= step]
    durable.write_text(path, "".join(json.dumps(m) + "\n" for m in kept))
