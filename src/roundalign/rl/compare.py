"""``roundalign compare``: run a grid of ``roundalign train`` runs, then tabulate and plot them side by side.

    roundalign compare --grid trainer=hf,aligned sync=rne,stochastic seed=0,1 --out runs/grid --jobs 2 \\
        -- --steps 40 --engine-profile sglang

Everything after ``--`` is passed to every ``roundalign train`` run unchanged (the fixed train options); each grid
key adds one option per run. The grid is the cartesian product of its value lists, in the order the keys were
given, with ``seed`` varied last so that the seeds of one configuration sit next to each other. Runs that differ
only in ``seed`` form one *configuration*: the table and the plots show its mean and spread across seeds.

Every cell is validated with ``roundalign train``'s own parser and ``TrainConfig.validate`` before anything runs,
so a bad combination (``sync=rne`` with a fixed ``--loss-on-served``) fails the whole grid at once, naming the cell,
instead of an hour later. Each cell runs as its own process (``python -m roundalign.cli train``) into
``out/<cell>/``, its output in ``out/<cell>/train.log``; ``--jobs N`` runs N at once with the CPU threads split
between them. A failed cell is reported with the tail of its log and the grid exits non-zero at the end, after the
other cells ran. A cell whose directory already holds the finished run of the same settings is skipped, so a grid
can be re-run to add cells; ``--force`` reruns it. ``out/summary.md`` (``summary.json``) and ``out/plots/*.png``
come from whatever finished runs ``out`` holds; ``--plots-only`` redoes just them.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from roundalign.errors import ExitStatus, UserError
from roundalign.rl.compare_summary import (
    _SHORT,
    GRID_ALIASES,
    Run,
    config_label,
    load_runs,
    summarize,
)

__all__ = [
    "GRID_ALIASES",
    "Cell",
    "GridError",
    "Run",
    "add_arguments",
    "load_runs",
    "parse_grid",
    "plan",
    "run",
    "run_grid",
    "summarize",
]

# Train options that are not a run's settings (compare sets --out and --quiet itself), and one that cannot be a
# grid key because its value holds the comma that separates grid values.
_NOT_GRID = {
    "out": "compare gives each cell its own --out",
    "resume": "compare starts fresh runs",
    "quiet": "compare runs every cell quietly",
    "no_tensorboard": "pass it in the fixed train options",
    "betas": "its value 'b1,b2' holds a comma, which separates grid values; set it in the fixed options",
}
DEFAULT_COMMAND = (sys.executable, "-m", "roundalign.cli", "train")
LOG_TAIL = 20  # lines of a failed cell's train.log shown in the report


class _TrainParser(argparse.ArgumentParser):
    """``roundalign train``'s parser, raising ValueError instead of exiting, so plan() can name the bad cell."""

    def error(self, message):
        raise UserError(message)


def _train_parser() -> _TrainParser:
    from roundalign.rl.cli import add_arguments

    parser = _TrainParser(prog="roundalign train", add_help=False)
    add_arguments(parser)
    return parser


def _grid_options() -> dict[str, argparse.Action]:
    """TrainConfig field -> its train option, for every field a grid may vary."""
    import dataclasses

    from roundalign.rl.config import TrainConfig

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    return {a.dest: a for a in _train_parser()._actions if a.dest in fields and a.dest not in _NOT_GRID}


def parse_grid(items: list[str]) -> dict[str, list[str]]:
    """``["trainer=hf,aligned", "seed=0,1"]`` -> ``{"trainer_profile": ["hf", "aligned"], "seed": ["0", "1"]}``.

    A key is an alias (``GRID_ALIASES``) or a ``TrainConfig`` field, with ``-`` or ``_``. Unknown keys, a key
    given twice, empty or repeated values are errors that list the valid keys.
    """
    options = _grid_options()
    valid = ", ".join([*GRID_ALIASES, *sorted(options)])
    if not items:
        raise UserError(f"the grid is empty; give KEY=V1,V2 items, with KEY one of: {valid}")
    grid: dict[str, list[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        name = GRID_ALIASES.get(key.strip(), key.strip().replace("-", "_"))
        if not sep or not key.strip():
            raise UserError(f"grid item {item!r} is not KEY=V1,V2; KEY is one of: {valid}")
        if name in _NOT_GRID:
            raise UserError(f"{key!r} cannot be a grid key: {_NOT_GRID[name]}")
        if name not in options:
            raise UserError(f"unknown grid key {key!r}; valid keys: {valid}")
        if name in grid:
            raise UserError(f"grid key {key!r} ({name}) is given twice; list all its values in one item: {key}=A,B")
        vals = [v.strip() for v in values.split(",")]
        if not values.strip() or any(not v for v in vals):
            raise UserError(f"grid item {item!r} has an empty value; write {key}=A,B with no empty entries")
        repeated = sorted({v for v in vals if vals.count(v) > 1})
        if repeated:
            raise UserError(f"grid item {item!r} repeats {repeated}; each value once")
        grid[name] = vals
    return grid


@dataclass
class Cell:
    """One run of the grid: its non-seed settings (TrainConfig field -> value text) and its seed."""

    name: str  # filesystem-safe: "trainer-hf_sync-rne_seed-0"
    settings: dict[str, str]
    seed: str | None
    items: list[tuple[str, str]] = field(default_factory=list, repr=False)  # (field, value) in grid order, seed last

    def __post_init__(self):
        if not self.items:
            self.items = [*self.settings.items(), *([("seed", self.seed)] if self.seed is not None else [])]

    @property
    def label(self) -> str:
        """The configuration: non-seed settings, ``"trainer=hf sync=rne"``."""
        return config_label(self.settings)

    def train_options(self) -> list[str]:
        """This cell's own ``roundalign train`` options (the fixed ones come first)."""
        options = _grid_options()
        argv = []
        for name, value in self.items:
            action = options[name]
            flag = action.option_strings[0]
            if action.nargs == 0:  # --loss-on-served / --no-loss-on-served
                on = _boolean(value, name)
                argv.append(flag if on else next(s for s in action.option_strings if s.startswith("--no-")))
            else:
                argv.append(f"{flag}={value}")  # one token: a value like -1e-5 is not taken for an option
        return argv


def _boolean(value: str, name: str) -> bool:
    v = value.lower()
    if v in ("true", "yes", "on", "1"):
        return True
    if v in ("false", "no", "off", "0"):
        return False
    raise UserError(f"{name} is on or off: write {name}=true,false (got {value!r})")


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+]+", "-", text).strip("-") or "x"


def _cell(items: list[tuple[str, str]]) -> Cell:
    name = "_".join(f"{_safe(_SHORT.get(k, k.replace('_', '-')))}-{_safe(v)}" for k, v in items)
    settings = {k: v for k, v in items if k != "seed"}
    seed = next((v for k, v in items if k == "seed"), None)
    return Cell(name=name, settings=settings, seed=seed, items=list(items))


def _given(argv: list[str]) -> dict:
    """The train options ``argv`` sets (the train parser suppresses defaults, so only given ones appear)."""
    return vars(_train_parser().parse_args(argv))


def plan(grid: dict[str, list[str]], fixed_args: list[str]) -> list[Cell]:
    """The grid's cells, in a stable order, each validated as the ``roundalign train`` run it will be.

    Raises ``ValueError`` naming the first bad cell (or a clash between the grid and the fixed options) before
    anything runs.
    """
    try:
        fixed = _given(list(fixed_args))
    except ValueError as exc:
        raise UserError(f"fixed train options {' '.join(fixed_args)!r}: {exc}") from None
    for name in ("out", "resume", "quiet"):
        if name in fixed:
            raise UserError(f"drop --{name.replace('_', '-')} from the fixed train options: {_NOT_GRID[name]}")
    clash = sorted(set(grid) & set(fixed))
    if clash:
        raise UserError(
            f"{', '.join('--' + c.replace('_', '-') for c in clash)} is both a grid key and a fixed "
            "train option; keep it in one place"
        )
    keys = [k for k in grid if k != "seed"] + (["seed"] if "seed" in grid else [])
    cells = [_cell(list(zip(keys, values, strict=True))) for values in itertools.product(*(grid[k] for k in keys))]
    seen: dict[str, Cell] = {}
    for cell in cells:
        if cell.name in seen:
            raise UserError(
                f"grid cells {seen[cell.name].items} and {cell.items} get the same directory name "
                f"{cell.name!r}; use values that differ in letters or digits"
            )
        seen[cell.name] = cell
        train_config(cell, fixed_args)
    return cells


def train_config(cell: Cell, fixed_args: list[str]):
    """The validated ``TrainConfig`` of ``cell``; ``ValueError`` naming the cell when it is not a valid run."""
    from roundalign.rl.cli import config_from_args

    try:
        config = config_from_args(_train_parser().parse_args([*fixed_args, *cell.train_options()])).validate().config
    except (ValueError, TypeError) as exc:
        label = config_label(dict(cell.items))
        raise UserError(f"grid cell {cell.name} ({label}) is not a valid run: {exc}") from None
    return config


# ----------------------------------------------------------------------------------------------------------------
# Running


class GridError(RuntimeError):
    """Some cells failed; the others ran. ``failed`` names them."""

    def __init__(self, failed: list[str], out: Path):
        self.failed = failed
        super().__init__(f"{len(failed)} grid cell(s) failed: {', '.join(failed)} (logs: {out}/<cell>/train.log)")


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
    want = train_config(cell, fixed_args).to_dict()
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


def _say(console, text: str, markup: bool = True) -> None:
    if console is not None:
        console.print(text, highlight=False, markup=markup)
    else:
        print(re.sub(r"\[/?[a-z ]+\]", "", text) if markup else text)


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

    Raises ``GridError`` at the end when a cell failed (the others still ran), ``ValueError`` before starting
    anything when a cell's directory holds a finished run of other settings.
    """
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise UserError(f"jobs must be an int >= 1, got {jobs!r}")
    out = Path(out)
    command = list(DEFAULT_COMMAND if command is None else command)
    todo = []
    for cell in cells:
        if _decide(cell, out, fixed_args, force) == "skip":
            _say(console, f"[dim]{cell.name}: finished run found, skipped (--force reruns it)[/dim]")
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
            "argv": [*fixed_args, *cell.train_options()],
        }
        (run_dir / "cell.json").write_text(json.dumps(info, indent=2) + "\n")
        argv = [*command, "--out", str(run_dir), "--quiet", *fixed_args, *cell.train_options()]
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
                    _say(console, f"[red]{cell.name} failed (exit status {rc}); last lines of its train.log:[/red]")
                    _say(console, "\n".join("  " + line for line in tail), markup=False)
                else:
                    _say(console, f"[green]{cell.name}[/green] done")
                if bar is not None:
                    bar.advance(task)
    finally:
        if bar is not None:
            bar.stop()
    if failed:
        raise GridError(sorted(failed, key=[c.name for c in cells].index), out)
    return [out / cell.name for cell in cells]


# ----------------------------------------------------------------------------------------------------------------
# The CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a(
        "--grid",
        nargs="+",
        metavar="KEY=V1,V2",
        help="the grid: one KEY=V1,V2 per varied setting; KEY is trainer, "
        "engine, is, seed or any train option's name (sync, loss-type, lr, ...)",
    )
    a(
        "--out",
        metavar="DIR",
        default="runs/compare",
        help="grid directory: one run per cell, summary.md, plots/ (default runs/compare)",
    )
    a("--jobs", type=int, default=1, help="runs at once; the CPU threads are split between them (default 1)")
    a("--force", action="store_true", help="rerun cells whose directory already holds a finished run")
    a("--plots-only", action="store_true", help="run nothing: redo summary.md and the plots from the runs in --out")
    a(
        "--smooth",
        type=int,
        default=5,
        metavar="N",
        help="centred moving average over N steps in the plots "
        "(default 5; at most an eighth of the longest run; 1: none)",
    )
    a(
        "train_args",
        nargs=argparse.REMAINDER,
        metavar="-- TRAIN_OPTIONS",
        help="after '--': options passed to every roundalign train run, e.g. -- --steps 40 --engine-profile sglang",
    )


@dataclass(frozen=True)
class CompareConfig:
    """``roundalign compare``'s options: the grid, where it goes, and the train options every run shares."""

    grid: tuple[str, ...] | None = None
    out: str = "runs/compare"
    jobs: int = 1
    force: bool = False
    plots_only: bool = False
    smooth: int = 5
    train_args: tuple[str, ...] = ()

    def validate(self) -> CompareConfig:
        if self.plots_only:
            given = [
                f
                for f, v in (
                    ("--grid", self.grid),
                    ("--force", self.force),
                    ("-- TRAIN_OPTIONS", self.train_args),
                    ("--jobs", self.jobs != 1),
                )
                if v
            ]
            if given:
                raise UserError(f"--plots-only runs nothing, so {', '.join(given)} would be ignored; drop them")
            return self
        if not self.grid:
            raise UserError("--grid is required (or --plots-only to redo the summary and plots of --out)")
        if self.jobs < 1:
            raise UserError(f"--jobs must be >= 1, got {self.jobs}")
        if self.smooth < 1:
            raise UserError(f"--smooth must be >= 1 (1: none), got {self.smooth}")
        return self


def config_from_args(args: argparse.Namespace) -> CompareConfig:
    fixed = list(args.train_args or [])
    if fixed[:1] == ["--"]:
        fixed = fixed[1:]
    return CompareConfig(
        grid=tuple(args.grid) if args.grid else None,
        out=args.out,
        jobs=args.jobs,
        force=args.force,
        plots_only=args.plots_only,
        smooth=args.smooth,
        train_args=tuple(fixed),
    )


def run(config: CompareConfig) -> int:
    """Plan, run, summarize and plot; 0 when every cell ran, ``ExitStatus.RUNS_FAILED`` when some failed (the rest
    is still summarized and plotted)."""
    from roundalign.console import make_console
    from roundalign.rl.compare_plots import plot

    console = make_console()
    out = Path(config.out)
    fixed = list(config.train_args)
    status = ExitStatus.OK
    if not config.plots_only:
        grid = parse_grid(list(config.grid))
        cells = plan(grid, fixed)
        out.mkdir(parents=True, exist_ok=True)
        (out / "grid.json").write_text(
            json.dumps({"grid": grid, "fixed_args": fixed, "cells": [c.name for c in cells]}, indent=2) + "\n"
        )
        _say(console, f"{len(cells)} run(s) planned into {out}/")
        try:
            run_grid(cells, out, fixed, jobs=config.jobs, console=console, force=config.force)
        except GridError as exc:
            _say(console, f"[red]{exc}[/red]")
            status = ExitStatus.RUNS_FAILED
    runs = load_runs(out)
    summary = summarize(runs, out)
    _say(console, summary.read_text(), markup=False)
    if importlib.util.find_spec("matplotlib") is None:
        # The runs and the summary are done: say how to draw the plots later rather than fail after all that work
        # (an engine's environment, such as .venv-vllm, may have no plotting extra).
        _say(
            console,
            f"summary: {summary} (and summary.json); no plots: matplotlib is not installed here (roundalign's [cli] "
            f"extra). Draw them later with: roundalign compare --plots-only --out {out}",
            markup=False,
        )
        return status
    paths = plot(runs, out, smooth=config.smooth)
    _say(console, f"summary: {summary} (and summary.json); plots: {len(paths)} PNG in {out / 'plots'}/")
    return status
