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
import json
from pathlib import Path

from roundalign.errors import MissingFile, UserError
from roundalign.profiles import list_profiles


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from roundalign.probe.run import SAMPLING_DEFAULTS as d

    a = parser.add_argument
    a("--model", metavar="PATH", help="HF model directory (default: the shipped tiny-qwen3)")
    a(
        "--engine-profile",
        metavar="NAME",
        help="the engine's rounding profile: one of "
        f"{', '.join(list_profiles())}, or a .json file (default: vllm; for a real engine, the built-in profile "
        "of the build that ran, from its engine.json)",
    )
    a("--trainer-profiles", metavar="A,B", help="comma-separated trainer profiles (default: hf and the engine profile)")
    a(
        "--device",
        default="cpu",
        metavar="DEV",
        help="where the trainer's forwards run: cpu (default), cuda, cuda:1, "
        "...; the reference engine samples on the CPU",
    )
    a("--out", metavar="DIR", default="probe-out", help="where report.json and the plots go (default probe-out)")
    a("--no-plots", action="store_true", help="skip the PNG plots")
    g = parser.add_argument_group("a real engine: run it here, or read its dump")
    g.add_argument(
        "--engine",
        choices=("vllm", "sglang"),
        help="sample with this real engine, in its own Python (--engine-python), and score the same sequences in "
        "its prefill: the trainer is compared with both (docs/real-engines.md)",
    )
    g.add_argument("--enforce-eager", action="store_true", help="with --engine vllm: its enforce_eager mode")
    g.add_argument(
        "--engine-python",
        metavar="PATH",
        help="the Python whose environment has the engine (default $ROUNDALIGN_ENGINE_PYTHON, else this one); "
        "`make vllm` builds .venv-vllm/bin/python",
    )
    g.add_argument(
        "--engine-logprobs",
        metavar="PATH",
        help="a real engine's dump instead of sampling: a directory written by roundalign dump (decode and prefill "
        "references), or a JSONL file of {prompt_token_ids, token_ids, logprobs} lines (docs/real-engines.md); "
        "the sampling options do not apply",
    )
    g = parser.add_argument_group("sampling (the reference engine, or --engine)")
    a = g.add_argument
    a(
        "--backends",
        metavar="A,B",
        help="engine numerics backends: kernels, inductor (default: every backend that "
        "implements the engine profile; inductor implements vllm only)",
    )
    a(
        "--prompts",
        metavar="FILE",
        help="one prompt per line: text, or a JSON list of token ids (default: arithmetic word problems)",
    )
    a(
        "--num-samples",
        type=int,
        help=f"completions to sample; prompts are used round-robin (default {d['num_samples']})",
    )
    a("--max-tokens", type=int, help=f"max completion tokens (default {d['max_tokens']})")
    a("--temperature", type=float, help=f"sampling temperature (default {d['temperature']}; 0 = greedy)")
    a("--top-p", type=float, help=f"nucleus sampling, in (0, 1] (default {d['top_p']})")
    a("--seed", type=int, help=f"sampling seed (default {d['seed']})")
    a(
        "--layer-sequences",
        type=int,
        metavar="N",
        help="sequences the per-layer and decode-shape experiments run on "
        f"(default {d['layer_sequences']}; 0 skips them)",
    )


def read_prompts(path: str | Path) -> list[str] | list[list[int]]:
    """Prompts from a file: one per line, text or a JSON list of token ids. Blank lines are errors."""
    path = Path(path)
    if not path.is_file():
        raise MissingFile(f"prompt file {str(path)!r} does not exist")
    lines = path.read_text().splitlines()
    if not any(line.strip() for line in lines):
        raise UserError(f"prompt file {str(path)!r} is empty; put one prompt per line")
    prompts = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            raise UserError(f"{path}:{i}: blank line; every line is one prompt (remove it)")
        if line.lstrip().startswith("["):
            try:
                ids = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{i}: looks like a token-id list but is not valid JSON: {exc}") from None
            if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise UserError(f"{path}:{i}: a token-id prompt must be a non-empty JSON list of integers")
            prompts.append(ids)
        else:
            prompts.append(line)
    return prompts


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
    from roundalign.probe.run import plan, run_probe
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
        task = progress.add_task("starting", total=plan(cfg))
        started = [False]

        def step(description: str) -> None:
            if started[0]:
                progress.advance(task)
            started[0] = True
            progress.update(task, description=description)

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
