"""Where a run's metrics go: ``metrics.jsonl`` always, TensorBoard when it is installed, a live progress bar.

One JSON object per line, ``{"step": N, "<metric>": value, ...}``, flushed and fsynced at every step so that a
crashed or running job can be read (``roundalign compare`` reads these files). Values are floats, ints, or null
where a metric is undefined (for example the update visibility before a second export). TensorBoard gets the same
scalars under the same names (nulls skipped) when ``torch.utils.tensorboard`` can be imported (``pip install
tensorboard``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from roundalign import durable
from roundalign.errors import UserError
from roundalign.extras import available


def read_metrics(path: Path) -> list[dict]:
    """A metrics.jsonl, one dict per step in step order; [] when there is none yet. A step logged twice (a run
    resumed from a checkpoint re-logs the steps after it) keeps its later line. A last line without its newline is
    one being written, or cut by a kill mid-write: not a line yet, so it is left out when it does not parse. Any
    other line that is not a JSON object with an int ``step`` >= 0 is a UserError naming the file and the line."""
    if not path.is_file():
        return []
    by_step: dict[int, dict] = {}
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); is it a metrics.jsonl?") from None
    lines = text.splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step = row["step"]
        except (ValueError, KeyError, TypeError) as exc:
            if i == len(lines) and not text.endswith("\n"):
                break  # a line still being written, or cut by a kill
            raise UserError(f"{path}:{i}: not a metrics line ({exc}); expected a JSON object with a 'step'") from None
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise UserError(f"{path}:{i}: step must be an int >= 0, got {step!r}")
        by_step[step] = row
    return [by_step[s] for s in sorted(by_step)]


class Logbook:
    def __init__(self, out: Path, tensorboard: bool = True, console=None):
        self.path = out / "metrics.jsonl"
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard:
            if not available("tensorboard"):
                if console is not None:
                    console.print(
                        "[dim]TensorBoard is not installed (pip install tensorboard): metrics go to "
                        f"{self.path} only[/dim]"
                    )
            else:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(out / "tensorboard"))

    def write(self, step: int, metrics: dict) -> None:
        row = {"step": step}
        for k, v in metrics.items():
            row[k] = None if isinstance(v, float) and not math.isfinite(v) else v
        durable.append_line(self._file, json.dumps(row) + "\n")  # on disk before the next step starts
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


class Progress:
    """A rich progress bar over steps with the live reward, k3_kl and update visibility; a no-op when disabled."""

    def __init__(self, total: int, start: int, console=None, enabled: bool = True):
        self._bar = None
        if not enabled or console is None:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._bar = Progress(
            TextColumn("train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
            console=console,
            transient=False,
        )
        self._task = self._bar.add_task("train", total=total, completed=start, status="")
        self._bar.start()

    def update(self, metrics: dict) -> None:
        if self._bar is None:
            return

        def fmt(key, spec):
            v = metrics.get(key)
            return "-" if v is None else format(v, spec)

        status = (
            f"reward {fmt('reward/mean', '.3f')}  k3_kl {fmt('rollout_corr/k3_kl', '.2e')}  "
            f"visible {fmt('sync/visible_fraction', '.3f')}  lag {fmt('sync/lag_steps', '.0f')}"
        )
        if "eval/accuracy" in metrics:
            status += f"  eval {metrics['eval/accuracy']:.3f}"
        self._bar.update(self._task, advance=1, status=status)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
