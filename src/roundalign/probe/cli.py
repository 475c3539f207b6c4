"""``roundalign probe``: the mismatch audit from the command line.

    roundalign probe                                   # the shipped tiny-qwen3, vLLM profile, both engine backends
    roundalign probe --model PATH --trainer-profiles hf,vllm,aligned
    roundalign probe --model PATH --engine vllm [--enforce-eager]  # sample with the real vLLM (its own Python)
    roundalign probe --model PATH --engine-logprobs DIR|dump.jsonl   # a real engine's dump (roundalign dump)

It prints a table (rich), with a progress bar while it runs, and writes ``report.json`` (docs/probe-report.md),
``rollouts.jsonl`` (what the engine sampled, in the import format, so a run can be replayed) and three PNG plots
into ``--out``. Bad input exits with status 2 and a message that names the problem.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from roundalign.errors import UserError
from roundalign.options import field_help
from roundalign.profiles import list_profiles
from roundalign.prompts import read_prompts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from roundalign.engines import ENGINES
    from roundalign.options import SAMPLING, add_sampling_arguments
    from roundalign.probe.run import SAMPLING_DEFAULTS, ProbeConfig

    def option(group, name: str, **kw) -> None:
        default = SAMPLING_DEFAULTS.get(name, ProbeConfig.__dataclass_fields__[name].default)
        text = field_help(ProbeConfig, name, default=default, profiles=", ".join(list_profiles()))
        group.add_argument("--no-plots" if name == "plots" else f"--{name.replace('_', '-')}", help=text, **kw)

    option(parser, "model", metavar="PATH")
    option(parser, "engine_profile", metavar="NAME")
    option(parser, "trainer_profiles", metavar="A,B")
    option(parser, "device", default="cpu", metavar="DEV")
    option(parser, "out", metavar="DIR", default="probe-out")
    option(parser, "plots", action="store_true")
    g = parser.add_argument_group("a real engine: run it here, or read its dump")
    option(g, "engine", choices=ENGINES)
    option(g, "enforce_eager", action="store_true")
    option(g, "engine_python", metavar="PATH")
    option(g, "engine_logprobs", metavar="PATH")
    option(parser, "quantization", metavar="SCHEME")
    g = parser.add_argument_group("sampling (the reference engine, or --engine)")
    option(g, "backends", metavar="A,B")
    option(g, "prompts", metavar="FILE")
    # No argparse defaults: a sampling option given with --engine-logprobs is an error, so "not given" must show.
    add_sampling_arguments(g.add_argument, ProbeConfig, {k: SAMPLING_DEFAULTS[k] for k in SAMPLING}, unset=True)
    option(g, "layer_sequences", type=int, metavar="N")


def _split(value: str | None, option: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    items = tuple(v.strip() for v in value.split(",") if v.strip())
    if not items:
        raise UserError(f"{option} {value!r} is an empty list; give comma-separated names")
    return items


def config_from_args(args: argparse.Namespace):
    from roundalign.probe.run import ProbeConfig

    return ProbeConfig(
        model=args.model,
        engine_profile=args.engine_profile,
        trainer_profiles=_split(args.trainer_profiles, "--trainer-profiles"),
        backends=_split(args.backends, "--backends"),
        prompts=read_prompts(args.prompts) if args.prompts else None,
        num_samples=args.num_samples,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        engine_logprobs=args.engine_logprobs,
        engine=args.engine,
        enforce_eager=args.enforce_eager,
        engine_python=args.engine_python,
        layer_sequences=args.layer_sequences,
        quantization=args.quantization,
        device=args.device,
        out=args.out,
        plots=not args.no_plots,
    )


def run(cfg) -> int:
    """Run the probe with a progress bar, write the outputs, print the tables."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from roundalign.console import make_console
    from roundalign.errors import ExitStatus
    from roundalign.probe import report as report_mod
    from roundalign.probe import table
    from roundalign.probe.run import run_probe, stages
    from roundalign.rollouts import write_engine_logprobs

    console = make_console()
    out = Path(cfg.out)
    with Progress(
        TextColumn("[bold]probe[/]"),
        BarColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("starting", total=len(stages(cfg)))
        started = [False]

        def step(description: str, total: int) -> None:
            if started[0]:
                progress.advance(task)
            started[0] = True
            progress.update(task, description=description, total=total)

        report, arrays = run_probe(cfg, step)
        progress.advance(task)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.engine_logprobs is None:
        write_engine_logprobs(out / "rollouts.jsonl", arrays["rollouts"])
    if cfg.plots:
        from roundalign.probe import plots

        written = {"log_ratio_hist": plots.plot_log_ratio_hist(arrays["log_ratios"], out / "log_ratio_hist.png")}
        if report["layers"]:
            written["layer_agreement"] = plots.plot_layer_agreement(report, out / "layer_agreement.png")
        if report["attribution"]:
            written["attribution"] = plots.plot_attribution(report, out / "attribution.png")
        report["plots"] = {name: Path(p).name for name, p in written.items()}
    path = report_mod.write_report(report, out)
    for renderable in table.render(report):
        console.print(renderable)
    console.print(f"report: {path}" + (f"; plots in {out}/" if cfg.plots else ""))
    return ExitStatus.OK
