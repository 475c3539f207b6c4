"""The ``roundalign`` command line.

    roundalign profiles [NAME] [--sources] [--json]   # the rounding profiles (roundalign.profiles.cli)
    roundalign probe                    # the mismatch audit on the shipped model (roundalign.probe.cli)
    roundalign train --out DIR          # a GRPO run on the reference engine (roundalign.rl.cli, docs/train.md)
    roundalign compare --grid ...       # a grid of train runs, plotted and tabulated (roundalign.rl.compare)
    roundalign fit --engine-logprobs F  # the profile that reproduces an engine's dumped log-probs (roundalign.fit.cli)
    roundalign fingerprint make|runner|read   # the op-level battery that names an engine's rules
    roundalign dump --engine vllm       # a real engine's sampled and prefill log-probs (roundalign.dump.cli)
    roundalign calibrate --engine vllm  # measure the installed engine build, write its profile (roundalign.calibrate)

One grammar for every subcommand. Its module defines

- ``add_arguments(parser)``: the options, named as the config's fields (``--top-p`` is ``top_p``);
- ``config_from_args(args)``: the subcommand's config dataclass, whose ``validate()`` returns it checked (or
  raises ``roundalign.errors.UserError`` with a message in terms of the options; an option the chosen mode would
  ignore is an error too);
- ``run(config) -> int``: the exit status.

``main`` validates, runs, and turns a ``roundalign.errors.Failure`` (bad input, a diverged run, a missing extra)
into one line on stderr and its exit status (``roundalign.errors.ExitStatus``, the README's table). Any other
exception is a bug and keeps its traceback. Only the chosen subcommand's module is imported, so ``roundalign
--help`` and ``roundalign profiles`` start without torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass

from roundalign.errors import ExitStatus, Failure


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    module: str  # defines add_arguments(parser), config_from_args(args) and run(config) -> int


COMMANDS: dict[str, Command] = {
    c.name: c
    for c in (
        Command("profiles", "list the built-in rounding profiles, or show one", "roundalign.profiles.cli"),
        Command(
            "probe",
            "audit trainer-vs-engine log-prob mismatch: where it comes from, region by region, layer by layer",
            "roundalign.probe.cli",
        ),
        Command(
            "train",
            "a GRPO run on the reference engine: trainer profile, IS correction, Fair Cast weight export",
            "roundalign.rl.cli",
        ),
        Command(
            "compare",
            "run a grid of train runs (e.g. --grid trainer=hf,aligned sync=rne,stochastic seed=0,1) and plot them",
            "roundalign.rl.compare",
        ),
        Command(
            "fit",
            "find the rounding profile that reproduces an engine's dumped log-probs (writes a profile file)",
            "roundalign.fit.cli",
        ),
        Command(
            "dump",
            "run a real engine (vLLM, SGLang) on a model: its sampled and prefill log-probs, in the engine's Python",
            "roundalign.dump.cli",
        ),
        Command(
            "calibrate",
            "measure the installed engine build (dump, fingerprint, fit) and write its profile with the evidence",
            "roundalign.calibrate",
        ),
        Command(
            "fingerprint",
            "op-level test battery: make its inputs, run them on the engine's machine, read the rules",
            "roundalign.fingerprint.cli",
        ),
    )
}


def _error(message: str) -> None:
    print(f"roundalign: error: {message}", file=sys.stderr)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s options are added (and its module imported), so help is instant."""
    from roundalign import __version__

    parser = argparse.ArgumentParser(
        prog="roundalign",
        description="Make an RL trainer round to bf16 where its rollout engine (vLLM, SGLang) does.",
        epilog="exit status: " + "; ".join(f"{s.value} {s.name.lower().replace('_', ' ')}" for s in ExitStatus),
    )
    parser.add_argument("--version", action="version", version=f"roundalign {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        if cmd.name == command:
            importlib.import_module(cmd.module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI on ``argv`` (default ``sys.argv[1:]``) and return the exit status.

    argparse's own usage errors raise ``SystemExit(2)`` as usual.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(chosen if chosen in COMMANDS else None).parse_args(argv)
    module = importlib.import_module(COMMANDS[args.command].module)
    try:
        return int(module.run(module.config_from_args(args).validate()))
    except Failure as exc:
        _error(str(exc))
        return int(exc.status)


if __name__ == "__main__":
    sys.exit(main())
