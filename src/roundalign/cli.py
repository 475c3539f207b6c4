"""The ``roundalign`` command line.

Usage::

    roundalign profiles                 # every built-in profile: engines covered, one formula per region
    roundalign profiles --sources       # ... plus where each profile was read
    roundalign profiles vllm            # one profile in detail: rule, formula, whether it differs from HF
    roundalign profiles --json          # all profiles as JSON (a list of Profile.to_dict())
    roundalign profiles vllm --json     # one profile as JSON; Profile.load() reads it back
    roundalign probe                    # the mismatch audit on the shipped model (roundalign.probe.cli)
    roundalign train --out DIR          # a GRPO run on the reference engine (roundalign.rl.cli, docs/train.md)
    roundalign compare --grid ...       # a grid of train runs, plotted and tabulated (roundalign.rl.compare)
    roundalign fit --engine-logprobs F  # the profile that reproduces an engine's dumped log-probs (roundalign.fit)
    roundalign fingerprint make|read    # the op-level battery that names an engine's rules (roundalign.fingerprint)

Formulas use the notation of ``shared/reference/engine-rounding.md``: ``r(.)`` rounds fp32 to bf16, everything
inside one ``r(...)`` is fp32, ``nu(x) = rsqrt(mean(x^2) + eps)``.

Each subcommand is a ``Command`` in ``COMMANDS``: a name, a one-line help, a function that adds its arguments
to an argparse subparser, and a function that runs it and returns the exit status. Adding a subcommand
(``probe``, ``train``, ``fit``, ``fingerprint``) means writing those two functions and registering them with
``@command(...)``, or, for a module with ``add_arguments(parser)`` and ``run(args, console)``, one ``delegate(...)``
line; ``main`` needs no change. Exit status: 0 success, 1 a missing optional dependency, 2 a usage
error (argparse's own errors and unknown profile names alike), 3 a training run that diverged (a non-finite loss
or gradient; the message names the step, the quantity and the last good checkpoint), 4 a ``compare`` grid in which
some runs failed (the others still ran, and the summary and plots cover them), 5 a ``fit`` dump that no rounding
profile explains (another checkpoint, processed log-probs; the message gives the evidence).

The tables need ``rich`` (the ``[cli]`` extra); ``--json`` works without it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

from roundalign.profiles import REGIONS, Profile, get_profile, list_profiles

# Exit statuses.
OK, MISSING_DEPENDENCY, USAGE, DIVERGED = 0, 1, 2, 3

# The profile-per-row overview needs about this many columns; narrower terminals get a row per region.
WIDE = 150


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}


def command(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None]):
    """Register the decorated ``run(args) -> int`` as subcommand ``name``."""

    def register(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        if name in COMMANDS:
            raise ValueError(f"subcommand {name!r} registered twice")
        COMMANDS[name] = Command(name, help, add_arguments, run)
        return run

    return register


def _error(message: str) -> None:
    print(f"roundalign: error: {message}", file=sys.stderr)


def _console():
    """A rich Console, or None (after saying how to get rich) when the [cli] extra is missing."""
    try:
        from rich.console import Console
    except ImportError:
        _error("the tables need rich, which is in the [cli] extra: pip install 'roundalign[cli]' (or use --json)")
        return None
    console = Console()
    # Piped or captured output gets a fixed wide width, so that no formula is ever wrapped or cut.
    return console if console.is_terminal else Console(width=240)


# -----------------------------------------------------------------------------
# roundalign profiles [NAME] [--sources] [--json]


def _profiles_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", help=f"one profile to show in detail ({', '.join(list_profiles())}), "
                        "or a profile .json file")
    parser.add_argument("--sources", action="store_true", help="add the column saying where each profile was read")
    parser.add_argument("--json", action="store_true", help="print JSON (Profile.to_dict) instead of a table")


def _display(formula: str) -> str:
    # "R=r(a+h); norm(R)" and SGLang's "head_dim in {...}: ...; else ..." read better on two lines.
    return formula.replace("; ", ";\n")


def _cell(p: Profile, region: str, formula: str) -> str:
    # Rules that stock HF shares are dimmed, so what a profile changes stands out.
    text = _display(formula)
    return text if getattr(p, region) != getattr(get_profile("hf"), region) else f"[dim]{text}[/dim]"


def _overview_table(profiles: list[Profile], sources: bool, width: int):
    """One row per profile when the screen is wide enough to compare regions side by side, else one per region."""
    from rich.table import Table

    wide = width >= WIDE
    table = Table(
        title="roundalign built-in profiles",
        caption="r(.) rounds fp32 to bf16; nu(x) = rsqrt(mean(x^2) + eps); dim = same as stock HF",
        show_lines=wide,
    )
    table.add_column("profile", style="bold cyan", no_wrap=True)
    table.add_column("engines", min_width=20, ratio=1)
    for region in REGIONS if wide else ("region", "formula"):
        table.add_column(region, overflow="fold", no_wrap=region == "region")
    if sources:
        table.add_column("source", min_width=20, ratio=1, style="dim", overflow="fold")
    for p in profiles:
        source = [p.source] if sources else []
        formulas = p.describe()
        if wide:
            table.add_row(p.name, p.engines, *(_cell(p, r, formulas[r]) for r in REGIONS), *source)
            continue
        for i, r in enumerate(REGIONS):
            first = i == 0
            table.add_row(
                p.name if first else "",
                p.engines if first else "",
                r,
                _cell(p, r, formulas[r]),
                *(source if first else [""] * len(source)),
                end_section=i == len(REGIONS) - 1,
            )
    return table


def _detail_table(p: Profile):
    from rich.table import Table

    hf = get_profile("hf")
    table = Table(title=f"profile {p.name}", caption=f"engines: {p.engines}\nsource: {p.source}", show_lines=True)
    table.add_column("region", style="bold cyan", no_wrap=True)
    table.add_column("rule", no_wrap=True)
    table.add_column("formula", no_wrap=True)
    table.add_column("differs from HF", no_wrap=True)
    for region, text in p.describe().items():
        rule = getattr(p, region)
        table.add_row(region, str(rule), _display(text), "yes" if rule != getattr(hf, region) else "no")
    return table


@command("profiles", "list the built-in rounding profiles, or show one", _profiles_arguments)
def _profiles(args: argparse.Namespace) -> int:
    if args.name is not None:
        try:
            profiles = [get_profile(args.name)]  # a built-in name, or a profile .json file (roundalign fit writes one)
        except ValueError as exc:
            _error(str(exc))
            return USAGE
    else:
        profiles = [get_profile(name) for name in list_profiles()]

    if args.json:
        # One profile is a single object (Profile.load reads it back); all of them, a list.
        data = profiles[0].to_dict() if args.name is not None else [p.to_dict() for p in profiles]
        print(json.dumps(data, indent=2))
        return OK

    console = _console()
    if console is None:
        return MISSING_DEPENDENCY
    if args.name is not None:
        console.print(_detail_table(profiles[0]))
    else:
        console.print(_overview_table(profiles, args.sources, console.width))
    return OK


def _run_with_console(run: Callable, args: argparse.Namespace, diverged: tuple[type[Exception], ...] = ()) -> int:
    """Run a subcommand's ``run(args, console)``: a missing ``rich`` is status 1, bad input (ValueError,
    FileNotFoundError) 2 with its message, ``diverged`` (a training run's non-finite stop) 3; else the exit status
    ``run`` returns (train, compare), or ``OK`` when it returns something else (probe returns its report)."""
    console = _console()
    if console is None:
        return MISSING_DEPENDENCY
    try:
        status = run(args, console)
    except (ValueError, FileNotFoundError) as exc:
        _error(str(exc))
        return USAGE
    except diverged as exc:  # () catches nothing
        _error(str(exc))
        return DIVERGED
    return status if isinstance(status, int) else OK


# -----------------------------------------------------------------------------
# Subcommands whose options and run live in their own module: ``add_arguments(parser)`` and ``run(args, console)``,
# imported when the subcommand is used.


def delegate(name: str, help: str, module: str) -> None:
    """Register subcommand ``name`` as ``module``'s ``add_arguments`` and ``run`` (through ``_run_with_console``)."""

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        importlib.import_module(module).add_arguments(parser)

    def run(args: argparse.Namespace) -> int:
        return _run_with_console(importlib.import_module(module).run, args)

    command(name, help, add_arguments)(run)


delegate("probe", "audit trainer-vs-engine log-prob mismatch: where it comes from, region by region, layer by layer",
         "roundalign.probe.cli")


# roundalign train: as above, plus a diverged run's own exit status


def _train_arguments(parser: argparse.ArgumentParser) -> None:
    from roundalign.rl.cli import add_arguments

    add_arguments(parser)


@command("train", "a GRPO run on the reference engine: trainer profile, IS correction, Fair Cast weight export",
         _train_arguments)
def _train(args: argparse.Namespace) -> int:
    from roundalign.rl.cli import run
    from roundalign.rl.loop import TrainingDiverged

    return _run_with_console(run, args, diverged=(TrainingDiverged,))


delegate("compare", "run a grid of train runs (e.g. --grid trainer=hf,aligned sync=rne,stochastic seed=0,1) and "
         "plot them", "roundalign.rl.compare")
delegate("fit", "find the rounding profile that reproduces an engine's dumped log-probs (writes a profile file)",
         "roundalign.fit.cli")
delegate("fingerprint", "op-level test battery: make its inputs, run them on the engine's machine, read the rules",
         "roundalign.fingerprint.cli")


# -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from roundalign import __version__

    parser = argparse.ArgumentParser(
        prog="roundalign",
        description="Make an RL trainer round to bf16 where its rollout engine (vLLM, SGLang) does.",
    )
    parser.add_argument("--version", action="version", version=f"roundalign {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in COMMANDS.values():
        cmd.add_arguments(sub.add_parser(cmd.name, help=cmd.help, description=cmd.help))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI on ``argv`` (default ``sys.argv[1:]``) and return the exit status.

    argparse's own usage errors raise ``SystemExit(2)`` as usual.
    """
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
