"""``roundalign fingerprint make | read | runner``: the op-level battery from the command line.

    roundalign fingerprint make --out battery.pt            # the battery's inputs (deterministic)
    roundalign fingerprint make --model PATH --out b.pt     # plus cases shaped like that model (or --model shipped)
    roundalign fingerprint runner --out run_fingerprint.py  # the standalone script to run on the engine's machine
    roundalign fingerprint read results.pt [--json]         # the rule per region and mode, with the evidence
    roundalign fingerprint read results.pt --profile-out compiled vllm.json --residual round_at_attention

``read`` prints one table per run (engine and mode): each region's rule, whether it is determined, and the evidence
(the fraction of elements equal to each rule's output, and the largest ulp distance), and, for a battery made with
``--model``, a line "for your model (head_dim=..)" with the rules at the model's shapes. Bad input exits with
status 2 and a message that names the problem.
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from roundalign.errors import ExitStatus, MissingFile, UserError
from roundalign.options import field_help, option

STATUS_STYLE = {"determined": "green", "indistinguishable": "yellow", "ambiguous": "yellow", "no_rule": "red"}


# The default --out of each action that writes a file (the config's own default is None: read writes none).
OUT_DEFAULTS = {"make": "battery.pt", "runner": "run_fingerprint.py"}


@dataclass(frozen=True)
class FingerprintConfig:
    """``roundalign fingerprint``'s options: the action (make, runner, read) and that action's own options."""

    action: str = field(metadata={"help": "make, runner or read (the subcommand)"})
    out: str | None = option(None, "where to write it (default {default})")  # make, runner
    json: bool = option(False, "print {what} instead of {tables}")  # make, read (each fills in what and tables)
    model: str | None = option(
        None,
        "also add cases shaped like this model (a local directory with config.json; 'shipped' "
        "for roundalign's tiny-qwen3): its head_dim, RoPE theta, eps, hidden and MLP sizes",
    )  # make
    results: str | None = option(None, "results.pt written by the runner")  # read
    profile_out: tuple[str, str] | None = option(
        None, "write a Profile JSON for MODE (eager or compiled) when every region is determined"
    )  # read
    residual: str | None = option(
        None,
        "the residual rule for --profile-out when the op level cannot tell it "
        "(round_at_attention or never_round, e.g. from `roundalign fit`)",
    )  # read

    def validate(self) -> FingerprintConfig:
        if self.action not in ("make", "runner", "read"):
            raise UserError(f"unknown fingerprint action {self.action!r}; choose make, runner or read")
        if self.action == "read":
            if not Path(self.results).is_file():
                raise MissingFile(f"results file {self.results!r} does not exist")
            if self.residual is not None and self.profile_out is None:
                raise UserError(
                    "--residual only fills in the profile that --profile-out writes; add --profile-out MODE PATH"
                )
        elif Path(self.out).is_dir():
            name = OUT_DEFAULTS[self.action]
            raise UserError(f"--out {self.out} is a directory; give a file name such as {Path(self.out) / name}")
        return self


def _help(name: str, **fmt) -> str:
    return field_help(FingerprintConfig, name, **fmt)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="fingerprint_command", metavar="make|read|runner", required=True)
    make = sub.add_parser("make", help="write the battery's inputs", description="write the battery's inputs")
    out = OUT_DEFAULTS["make"]
    make.add_argument("--out", default=out, metavar="PATH", help=_help("out", default=out))
    make.add_argument("--json", action="store_true", help=_help("json", what="the case list as JSON", tables="a table"))
    make.add_argument("--model", metavar="PATH", help=_help("model"))
    runner = sub.add_parser(
        "runner",
        help="copy out the standalone runner script",
        description="copy out the script that runs the battery on the engine's machine",
    )
    out = OUT_DEFAULTS["runner"]
    runner.add_argument("--out", default=out, metavar="PATH", help=_help("out", default=out))
    read = sub.add_parser(
        "read",
        help="name the rule per region and mode",
        description="name each region's rounding rule per mode, with the evidence",
    )
    read.add_argument("results", help=_help("results"))
    read.add_argument("--json", action="store_true", help=_help("json", what="JSON", tables="tables"))
    read.add_argument("--profile-out", nargs=2, metavar=("MODE", "PATH"), help=_help("profile_out"))
    read.add_argument("--residual", metavar="RULE", help=_help("residual"))


def config_from_args(args: argparse.Namespace) -> FingerprintConfig:
    return FingerprintConfig(
        action=args.fingerprint_command,
        out=getattr(args, "out", None),
        json=getattr(args, "json", False),
        model=getattr(args, "model", None),
        results=getattr(args, "results", None),
        profile_out=tuple(args.profile_out) if getattr(args, "profile_out", None) else None,
        residual=getattr(args, "residual", None),
    )


def run(config: FingerprintConfig) -> int:
    from roundalign.console import make_console

    console = None if config.json else make_console()
    if config.action == "make":
        return _make(config, console)
    if config.action == "runner":
        return _runner(config, make_console())
    return _read(config, console)


def _make(args, console) -> int:
    from roundalign.fingerprint.battery import describe, model_constants, save_battery

    model = model_constants(args.model) if args.model else None
    battery = save_battery(args.out, model=model)
    rows = describe(battery)
    if args.json:
        print(
            json.dumps(
                {
                    "path": str(args.out),
                    "id": battery["id"],
                    "version": battery["version"],
                    "model": battery["model"],
                    "cases": rows,
                },
                indent=2,
            )
        )
        return ExitStatus.OK
    from rich.table import Table

    shaped = f"; model cases for {_model_label(model)}" if model else ""
    if model and model["rope_type"] != "default":  # the battery has plain RoPE only (docs/fingerprint.md)
        shaped += f" (its rope_type {model['rope_type']} is tested as plain RoPE at its theta)"
    table = Table(
        title=f"fingerprint battery v{battery['version']}: {len(rows)} cases written to {args.out}",
        caption=f"battery id {battery['id'][:16]}...{shaped}\nnext: `roundalign fingerprint runner` writes "
        "the script that runs these cases on the engine's machine",
    )
    for col in ("case", "region", "inputs", "separates"):
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(row["case"], row["region"], row["inputs"], row["separates"])
    console.print(table)
    return ExitStatus.OK


def runner_source() -> Path:
    return Path(__file__).with_name("runner.py")


def _runner(args, console) -> int:
    out = Path(args.out)
    shutil.copyfile(runner_source(), out)
    console.print(
        f"wrote {out}. On the engine's machine, in the engine's Python:\n"
        f"  python {out.name} battery.pt --engine vllm --out results.pt   (or --engine sglang)\n"
        f"(a dry run on any machine, vLLM's native code: python {out.name} battery.pt --engine native)\n"
        "then bring results.pt back: roundalign fingerprint read results.pt"
    )
    return ExitStatus.OK


def _read(args, console) -> int:
    from roundalign.fingerprint.reader import load_results, read_results

    path = Path(args.results)
    entries = read_results(load_results(path))
    written = _profile_out(args, entries) if args.profile_out else None
    if args.json:
        data = [
            {k: v for k, v in e.items() if k not in ("regions", "model")}
            | {"regions": {n: r.to_dict() for n, r in e["regions"].items()}, "model": _model_json(e["model"])}
            for e in entries
        ]
        print(json.dumps({"runs": data, "profile_out": written}, indent=2))
        return ExitStatus.OK
    for entry in entries:
        for renderable in _tables(entry, console):
            console.print(renderable)
        if entry["model"]:
            console.print(model_line(entry["model"]), highlight=False)
    if written:
        console.print(
            f"wrote profile {written['name']} to {written['path']}: "
            + ", ".join(f"{k} from {v}" for k, v in written["sources"].items())
        )
    return ExitStatus.OK


def _model_json(model: dict | None) -> dict | None:
    if model is None:
        return None
    return {
        "constants": model["constants"],
        "line": model_line(model),
        "differs": model["differs"],
        "regions": {n: r.to_dict() for n, r in model["regions"].items()},
    }


def _profile_out(args, entries) -> dict:
    from roundalign.fingerprint.profile import build_profile

    mode, out = args.profile_out
    chosen = [e for e in entries if e["mode"] == mode]
    if len(chosen) != 1:
        modes = sorted({e["mode"] for e in entries})
        raise UserError(
            f"--profile-out {mode}: the results hold {len(chosen)} run(s) in that mode (modes: {modes}); "
            "need exactly one"
        )
    profile, sources = build_profile(chosen[0], args.residual)
    profile.save(out)
    return {"name": profile.name, "path": str(out), "sources": sources}


def _model_label(constants: dict) -> str:
    c = constants
    sizes = ", ".join(
        f"{k}={c[k]:g}" if isinstance(c[k], float) else f"{k}={c[k]}"
        for k in ("head_dim", "rope_theta", "rms_norm_eps", "hidden_size", "intermediate_size", "moe_intermediate_size")
        if c.get(k) is not None
    )
    return f"{c['name']} ({sizes})"


def model_line(model: dict) -> str:
    """'for your model NAME (head_dim=..): region rule, ...', and the regions that differ from the generic cases."""
    parts = []
    for name, region in model["regions"].items():
        status = "" if region.status == "determined" else f" ({region.status})"
        parts.append(f"{name} {'|'.join(region.rules) or '-'}{status}")
    line = f"for your model {_model_label(model['constants'])}: " + ", ".join(parts)
    if model["differs"]:
        line += (
            f"\n  differs from the generic cases in: {', '.join(model['differs'])} (the engine's rule depends on "
            "the shape; the profile follows your model's)"
        )
    return line


def _evidence(region) -> str:
    rows = region.evidence[:3]
    if region.per_head_dim:  # rope: the best two rules per head dim
        lines: dict[int, list[str]] = {}
        for row in region.evidence:
            lines.setdefault(row["head_dim"], []).append(f"{row['rule']} {row['equal']:.2%} ({row['max_ulp']} ulp)")
        return "\n".join(f"hd{hd}: " + ", next ".join(parts) for hd, parts in lines.items())
    return "\n".join(
        f"{row['rule']}: {row['equal']:.4%} equal (worst case {row['worst_case']:.2%}), max {row['max_ulp']} ulp"
        for row in rows
    )


MATCH_RULE = (
    "A rule matches when >= 99.9% of the elements equal it and every difference is 1 ulp at most; it is determined "
    "when every other rule is under 99% in some case."
)


def _title(entry: dict) -> str:
    return f"{entry['engine']} {entry['engine_version']} -- {entry['mode']} mode"


def _cells(region) -> tuple[str, str, str, str]:
    """(rule, status, evidence, note) of one region, as both layouts print them."""
    style = STATUS_STYLE[region.status]
    return "\n".join(region.rules) or "-", f"[{style}]{region.status}[/{style}]", _evidence(region), region.note or ""


def _tables(entry: dict, console) -> list:
    """One run's regions as a table, or, narrower than it, one block per region (nothing cut)."""
    from rich.text import Text

    from roundalign.console import fits, key_value_table

    table = _table(entry)
    if fits(console, table):
        return [table]
    blocks = [key_value_table([("run", _title(entry)), ("device", f"{entry['device']}, torch {entry['torch']}")])]
    for name, region in entry["regions"].items():
        cells = zip(("rule", "status", "evidence", "note"), _cells(region), strict=True)
        blocks.append(key_value_table(list(cells), title=f"[bold cyan]{name}[/]"))
    return [*blocks, Text(MATCH_RULE, style="dim")]


def _table(entry: dict):
    from rich.table import Table

    table = Table(
        title=_title(entry), caption=f"device {entry['device']}, torch {entry['torch']}. {MATCH_RULE}", show_lines=True
    )
    table.add_column("region", style="bold cyan", no_wrap=True)
    table.add_column("rule", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("evidence (best candidate per rule)", no_wrap=True)
    table.add_column("note", overflow="fold", ratio=1)
    for name, region in entry["regions"].items():
        table.add_row(name, *_cells(region))
    return table
