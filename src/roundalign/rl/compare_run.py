"""Running a planned ``roundalign compare`` grid: each cell as its own ``roundalign train`` process.

Part of ``roundalign compare`` (rl/compare_plan.py plans the cells, rl/compare.py is the command). Each cell runs as
``python -m roundalign.cli train`` into ``out/<cell>/``, its output in ``out/<cell>/train.log``; ``jobs`` run at
once with the CPU threads split between them. A failed cell is reported with the tail of its log and ``GridError``
is raised at the end, after the other cells ran. A cell whose directory already holds the finished run of the same
settings is skipped, so a grid can be re-run to add cells; ``force`` reruns it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from roundalign import durable
from roundalign.errors import UserError
from roundalign.rl.compare_plan import Cell, train_config

__all__ = ["DEFAULT_COMMAND", "GridError", "run_grid", "say"]

DEFAULT_COMMAND = (sys.executable, "-m", "roundalign.cli", "train")
LOG_TAIL = 20  # lines of a failed cell's train.log shown in the report


class GridError(RuntimeError):
    """Some cells failed; the others ran. ``failed`` names them."""

    def __init__(self, failed: list[str], out: Path):
        self.failed = failed
        super().__init__(f"{len(failed)} grid cell(s) failed: {', '.join(failed)} (logs: {out}/<cell>/train.log)")


def say(console, text: str, markup: bool = True) -> None:
    """Print ``text`` on the rich ``console``, or, without one, on stdout with its rich markup taken out."""
    if console is not None:
        console.print(text, highlight=False, markup=markup)
    else:
        print(re.sub(r"\[/?[a-z ]+\]", "", text) if markup else text)


def _finished(run_dir: Path) -> tuple[dict, int] | None:
    """(config.json, last logged step) of the run in ``run_dir``, or None when there is none to read."""
    try:
        config = json.loads((run_dir / "config.json").read_text())
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        last = max((json.loads(line)["step"] for line in lines if line.strip()), default=0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return config, last


def _decide(cell: Cell, out: Path, fixed_args: list[str], force: bool) -> str:
    """'run' or 'skip'; ValueError when the directory holds a finished run of other settings (and no --force)."""
    run_dir = out / cell.name
    if force or not run_dir.exists():
        return "run"
    found = _finished(run_dir)
    if found is None:
        return "run"  # nothing finished there (a crashed or interrupted cell): start it again
    saved, last = found
    from roundalign.rl.loop import resolved

    want = resolved(train_config(cell, fixed_args)).to_dict()  # as the run wrote it: aliases resolved
    saved_steps = saved.get("steps")
    if last != saved_steps:
        return "run"
    differ = sorted(k for k in want if k != "extra" and saved.get(k, want[k]) != want[k])
    if differ:
        raise UserError(
            f"{run_dir} holds a finished run with other settings ({', '.join(differ)}); use another "
            "--out, or --force to replace it"
        )
    return "skip"


def _thread_env(jobs: int) -> dict[str, str]:
    env = dict(os.environ)
    if jobs > 1:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = str(max(1, cpus // jobs))  # jobs processes share the cores instead of oversubscribing them
        env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    return env


def run_grid(
    cells: list[Cell],
    out: Path,
    fixed_args: list[str],
    jobs: int = 1,
    command: list[str] | None = None,
    console=None,
    force: bool = False,
) -> list[Path]:
    """Run every cell (``jobs`` at a time) into ``out/<cell>/``; return the cell directories, in ``cells`` order.

    ``command`` is what runs a cell (default ``DEFAULT_COMMAND``, ``roundalign train`` in this Python); it gets
    ``--out DIR --quiet``, the fixed options and the cell's own. Raises ``GridError`` at the end when a cell failed
    (the others still ran), ``ValueError`` before starting anything when a cell's directory holds a finished run of
    other settings.
    """
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise UserError(f"jobs must be an int >= 1, got {jobs!r}")
    out = Path(out)
    command = list(DEFAULT_COMMAND if command is None else command)
    todo = []
    for cell in cells:
        if _decide(cell, out, fixed_args, force) == "skip":
            say(console, f"[dim]{cell.name}: finished run found, skipped (--force reruns it)[/dim]")
        else:
            todo.append(cell)
    env = _thread_env(jobs)

    def launch(cell: Cell) -> int:
        run_dir = out / cell.name
        if run_dir.exists():
            shutil.rmtree(run_dir)  # train appends to metrics.jsonl: a rerun must not extend the old lines
        run_dir.mkdir(parents=True)
        info = {
            "name": cell.name,
            "label": cell.label,
            "settings": cell.settings,
            "seed": cell.seed,
            **({"domain": cell.domain} if cell.domain is not None else {}),  # method=alone: the domain it trains
            "argv": cell.argv(fixed_args),
        }
        durable.write_text(run_dir / "cell.json", json.dumps(info, indent=2) + "\n")
        argv = [*command, "--out", str(run_dir), "--quiet", *cell.argv(fixed_args)]
        with open(run_dir / "train.log", "w") as log:
            return subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env, check=False).returncode

    failed = []
    bar = None
    if console is not None and todo:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(
            TextColumn("grid"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            console=console,
        )
        task = bar.add_task(f"{jobs} at a time", total=len(todo))
        bar.start()
    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(launch, cell): cell for cell in todo}
            for future in as_completed(futures):
                cell = futures[future]
                rc = future.result()
                if rc != 0:
                    failed.append(cell.name)
                    tail = (out / cell.name / "train.log").read_text(errors="replace").splitlines()[-LOG_TAIL:]
                    say(console, f"[red]{cell.name} failed (exit status {rc}); last lines of its train.log:[/red]")
                    say(console, "\n".join("  " + line for line in tail), markup=False)
                else:
                    say(console, f"[green]{cell.name}[/green] done")
                if bar is not None:
                    bar.advance(task)
    finally:
        if bar is not None:
            bar.stop()
    if failed:
        raise GridError(sorted(failed, key=[c.name for c in cells].index), out)
    return [out / cell.name for cell in cells]
