"""``roundalign compare``: run a grid of ``roundalign train`` runs, then tabulate and plot them side by side.

    roundalign compare --grid trainer=hf,aligned sync=rne,stochastic seed=0,1 --out runs/grid --jobs 2 \\
        -- --steps 40 --engine-profile sglang

Everything after ``--`` is passed to every ``roundalign train`` run unchanged (the fixed train options); each grid
key adds one option per run (``method=grpo,alone,osol,...`` with ``-- --domains a,b,...``: the train options of a
multi-domain method, rl/compare_methods.py). The grid is the cartesian
product of its value lists, in the order the keys were given, with ``seed`` varied last so that the seeds of one
configuration sit next to each other. Runs that differ only in ``seed`` form one *configuration*: the table and the
plots show its mean and spread across seeds (``method=alone``'s runs of all the domains are one configuration too).

Every cell is validated with ``roundalign train``'s own parser and ``TrainConfig.validate`` before anything runs,
so a bad combination (``sync=rne`` with a fixed ``--loss-on-served``) fails the whole grid at once, naming the cell,
before any run starts. Each cell runs as its own process (``python -m roundalign.cli train``) into
``out/<cell>/``, its output in ``out/<cell>/train.log``; ``--jobs N`` runs N at once with the CPU threads split
between them. A failed cell is reported with the tail of its log and the grid exits non-zero at the end, after the
other cells ran. A cell whose directory already holds the finished run of the same settings is skipped, so a grid
can be re-run to add cells; ``--force`` reruns it. ``out/summary.md`` (``summary.json``) and ``out/plots/*.png``
come from whatever finished runs ``out`` holds; ``--plots-only`` redoes just them. Runs with ``--domains`` get the
multi-domain summary and plots instead (rl/compare_multidomain.py: held-out reward per domain, OSOL's metrics).

This module is the command (``add_arguments``, ``CompareConfig``, ``run``) and the face of the library: the grid is
planned in rl/compare_plan.py, run in rl/compare_run.py, tabulated in rl/compare_summary.py and drawn in
rl/compare_plots.py, and their public names are importable from here.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from roundalign import durable
from roundalign.errors import ExitStatus, UserError
from roundalign.extras import available
from roundalign.rl.compare_methods import METHODS
from roundalign.rl.compare_multidomain import is_multidomain, summarize_domains
from roundalign.rl.compare_plan import Cell, parse_grid, plan, train_config
from roundalign.rl.compare_run import DEFAULT_COMMAND, GridError, run_grid, say
from roundalign.rl.compare_summary import GRID_ALIASES, Run, load_runs, summarize

__all__ = [
    "DEFAULT_COMMAND",
    "GRID_ALIASES",
    "Cell",
    "CompareConfig",
    "METHODS",
    "GridError",
    "Run",
    "add_arguments",
    "config_from_args",
    "load_runs",
    "parse_grid",
    "plan",
    "run",
    "run_grid",
    "summarize",
    "summarize_domains",
    "train_config",
]


@dataclass(frozen=True)
class CompareConfig:
    """``roundalign compare``'s options: the grid, where it goes, and the train options every run shares. Each
    field's ``metadata["help"]`` is its option's help (``{default}``: the field's default)."""

    grid: tuple[str, ...] | None = field(
        default=None,
        metadata={
            "help": "the grid: one KEY=V1,V2 per varied setting; KEY is trainer, engine, is, seed, method (with "
            "--domains: grpo, alone, osol, osol-no-residual, osol-random-residual, osol-equal-weights) or any train "
            "option's name (sync, loss-type, lr, ...)"
        },
    )
    out: str = field(
        default="runs/compare",
        metadata={"help": "grid directory: one run per cell, summary.md, plots/ (default {default})"},
    )
    jobs: int = field(
        default=1, metadata={"help": "runs at once; the CPU threads are split between them (default {default})"}
    )
    force: bool = field(default=False, metadata={"help": "rerun cells whose directory already holds a finished run"})
    plots_only: bool = field(
        default=False, metadata={"help": "run nothing: redo summary.md and the plots from the runs in --out"}
    )
    smooth: int = field(
        default=5,
        metadata={
            "help": "centred moving average over N steps in the plots (default {default}; at most an eighth of the "
            "longest run; 1: none)"
        },
    )
    train_args: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "after '--': options passed to every roundalign train run, e.g. -- --steps 40 --engine-profile "
            "sglang"
        },
    )

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = CompareConfig()
    helps = {f.name: f.metadata["help"].format(default=f.default) for f in fields(CompareConfig)}
    a = parser.add_argument
    a("--grid", nargs="+", metavar="KEY=V1,V2", help=helps["grid"])
    a("--out", metavar="DIR", default=d.out, help=helps["out"])
    a("--jobs", type=int, default=d.jobs, help=helps["jobs"])
    a("--force", action="store_true", help=helps["force"])
    a("--plots-only", action="store_true", help=helps["plots_only"])
    a("--smooth", type=int, default=d.smooth, metavar="N", help=helps["smooth"])
    a("train_args", nargs=argparse.REMAINDER, metavar="-- TRAIN_OPTIONS", help=helps["train_args"])


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
    from roundalign.rl.compare_multidomain import plot_domains
    from roundalign.rl.compare_plots import plot

    console = make_console()
    out = Path(config.out)
    fixed = list(config.train_args)
    status = ExitStatus.OK
    if not config.plots_only:
        grid = parse_grid(list(config.grid))
        cells = plan(grid, fixed)
        out.mkdir(parents=True, exist_ok=True)
        durable.write_text(
            out / "grid.json",
            json.dumps({"grid": grid, "fixed_args": fixed, "cells": [c.name for c in cells]}, indent=2) + "\n",
        )
        say(console, f"{len(cells)} run(s) planned into {out}/")
        try:
            run_grid(cells, out, fixed, jobs=config.jobs, command=DEFAULT_COMMAND, console=console, force=config.force)
        except GridError as exc:
            say(console, f"[red]{exc}[/red]")
            status = ExitStatus.RUNS_FAILED
    runs = load_runs(out)
    multidomain = is_multidomain(runs)  # per-domain held-out rewards instead of the single-task table and plots
    summary = (summarize_domains if multidomain else summarize)(runs, out)
    say(console, summary.read_text(), markup=False)
    if not available("matplotlib"):
        # The runs and the summary are done: say how to draw the plots later rather than fail after all that work
        # (an engine's environment, such as .venv-vllm, may have no plotting extra).
        say(
            console,
            f"summary: {summary} (and summary.json); no plots: matplotlib is not installed here (roundalign's [cli] "
            f"extra). Draw them later with: roundalign compare --plots-only --out {out}",
            markup=False,
        )
        return status
    paths = (plot_domains if multidomain else plot)(runs, out, smooth=config.smooth)
    say(console, f"summary: {summary} (and summary.json); plots: {len(paths)} PNG in {out / 'plots'}/")
    return status
