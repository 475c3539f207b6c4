"""``roundalign fit``: the rounding profile that reproduces an engine's dumped log-probs, as a profile file.

    roundalign fit --engine-logprobs dump.jsonl                  # the shipped tiny-qwen3
    roundalign fit --model PATH --engine-logprobs DIR            # a roundalign dump directory: its prefill.jsonl
    roundalign fit --model PATH --engine-logprobs dump.jsonl --out fit-out
    roundalign fit --engine-logprobs dump.jsonl --exhaustive     # no pruning: every candidate on every token

The dump is the probe's import format (docs/real-engines.md; a prefill dump decides most, docs/fit.md). Writes
``profile.json`` (``Profile.load`` and every ``--*-profile`` option read it) and ``report.json`` into ``--out``,
prints the verdict per region, the leading candidates and the margin, with a progress bar while it runs. A dump
that no rounding rule explains (another checkpoint, processed log-probs) exits with status 5 and the evidence.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from roundalign import durable
from roundalign.errors import ExitStatus, MissingFile, UserError, flag
from roundalign.options import field_help, option

SCREEN_TOKENS, PRUNE_Z = 512, 5.0


@dataclass(frozen=True)
class FitConfig:
    """``roundalign fit``'s options, one field per option (``--screen-tokens`` is ``screen_tokens``); each field's
    ``metadata["help"]`` is its option's help (``{default}``: the default shown)."""

    engine_logprobs: str = field(
        metadata={
            "help": "the engine's dump: a directory written by roundalign dump (its prefill.jsonl is fitted), or a "
            "JSONL file of {{prompt_token_ids, token_ids, logprobs}} lines (docs/real-engines.md, docs/fit.md)"
        }
    )
    model: str | None = option(None, "the HF model directory the engine served (default: the shipped tiny-qwen3)")
    out: str = option("fit-out", "where profile.json and report.json go (default {default})")
    device: str = option(
        "cpu",
        "where the trainer model runs the candidates' forwards: cpu (default), cuda, cuda:1, ... A GPU makes a "
        "large model's fit minutes instead of hours, and its matmul kernels are closer to the engine's",
    )
    exhaustive: bool = option(False, "score every candidate on every token (no pruning)")
    screen_tokens: int | None = option(  # None: SCREEN_TOKENS, unless --exhaustive
        None, "tokens every candidate is scored on before pruning (default {default})"
    )
    prune_z: float | None = option(  # None: PRUNE_Z, unless --exhaustive
        None, "drop a region's rule when the best beats it on the screen with sign-test z >= Z (default {default})"
    )
    decide_z: float = option(
        3.0, "call a region determined when the best beats its other rules with z >= Z (default {default})"
    )
    max_excess: float | None = option(  # None: roundalign.fit.search.MAX_EXCESS
        None,
        "refuse a dump farther from the best candidate than X times what rounding rules and kernels do to the "
        "same tokens (default {default}; docs/fit.md)",
    )
    top: int = option(10, "candidates to list (default {default})")
    json: bool = option(False, "print report.json instead of the tables")

    def validate(self) -> FitConfig:
        from roundalign.fit.search import MAX_EXCESS

        if self.exhaustive and (self.screen_tokens is not None or self.prune_z is not None):
            raise UserError(
                "--exhaustive scores every candidate on every token, so --screen-tokens and --prune-z "
                "would be ignored; drop them"
            )
        cfg = dataclasses.replace(
            self,
            max_excess=MAX_EXCESS if self.max_excess is None else self.max_excess,
            screen_tokens=SCREEN_TOKENS if self.screen_tokens is None else self.screen_tokens,
            prune_z=PRUNE_Z if self.prune_z is None else self.prune_z,
        )
        if not Path(cfg.engine_logprobs).exists():
            raise MissingFile(f"--engine-logprobs {cfg.engine_logprobs!r} does not exist")
        if cfg.screen_tokens <= 0:
            raise UserError(f"--screen-tokens must be positive, got {cfg.screen_tokens}")
        for name in ("prune_z", "decide_z", "max_excess"):
            if not getattr(cfg, name) > 0:
                raise UserError(f"{flag(name)} must be positive, got {getattr(cfg, name)}")
        if cfg.top <= 0:
            raise UserError(f"--top must be positive, got {cfg.top}")
        return cfg


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from roundalign.fit.search import MAX_EXCESS

    d = FitConfig(engine_logprobs="")
    # the defaults the help shows: the None fields' (filled in by validate()), and the floats without a trailing .0
    shown = {"screen_tokens": SCREEN_TOKENS, "prune_z": PRUNE_Z, "decide_z": d.decide_z, "max_excess": MAX_EXCESS}

    def a(name: str, **kw) -> None:
        fmt = {"default": f"{shown[name]:g}"} if name in shown else {}
        parser.add_argument(flag(name), help=field_help(FitConfig, name, **fmt), **kw)

    a("engine_logprobs", metavar="FILE", required=True)
    a("model", metavar="PATH")
    a("out", metavar="DIR", default=d.out)
    a("device", default=d.device, metavar="DEV")
    a("exhaustive", action="store_true")
    a("screen_tokens", type=int, metavar="N")
    a("prune_z", type=float, metavar="Z")
    a("decide_z", type=float, default=d.decide_z, metavar="Z")
    a("max_excess", type=float, default=MAX_EXCESS, metavar="X")
    a("top", type=int, default=d.top, metavar="N")
    a("json", action="store_true")


def config_from_args(args: argparse.Namespace) -> FitConfig:
    return FitConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(FitConfig)})


def load(model_path: str | Path | None, dump: str | Path, device: str = "cpu"):
    """The trainer's bf16 model on ``device`` and the dump's rollouts, checked against its vocabulary and context."""

    from roundalign import models
    from roundalign.rollouts import Rollout
    from roundalign.rollouts.dumpdir import read_references
    from roundalign.trainer import check_device, load_trainer_model

    device = check_device(device)
    path = Path(model_path) if model_path else models.path()
    model = load_trainer_model(path).to(device)
    rollouts, refs, info = read_references(dump, model.config)
    # A dump directory is fitted on its prefill log-probs: trainer-shaped forwards, which decide the most regions.
    scored = refs.get("prefill", refs.get("jsonl"))
    pairs = zip(rollouts, scored, strict=True)
    served = (info or {}).get("quantization")
    quantization = None if served in (None, "none") else str(served)  # every candidate computes what was served
    return model, [Rollout(r.prompt_token_ids, r.token_ids, lp, r.finish_reason) for r, lp in pairs], quantization


def plan(model, rollouts, args: FitConfig) -> str:
    """What the search will cost, before it starts: time is one forward per (candidate, sequence)."""
    from roundalign.fit.search import screen_prefix
    from roundalign.fit.space import RULES, Space

    space = Space.of(model)
    n, tokens = len(rollouts), sum(len(r.token_ids) for r in rollouts)
    first, count = screen_prefix(rollouts, args.screen_tokens)
    text = (
        f"fit: {space.size()} candidates ({' x '.join(str(len(RULES[r])) for r in space.regions)} rules over "
        f"{', '.join(space.regions)}) x {n} sequences ({tokens} tokens) = {space.size() * n} forwards at most"
    )
    if args.exhaustive or tokens - count < count:
        return text + "; every candidate on every sequence"
    return text + (
        f"; all candidates on the first {len(first)} sequences ({count} tokens), then only the rules not "
        "clearly beaten there"
    )


def run(args: FitConfig) -> int:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from roundalign.console import make_console
    from roundalign.fit import report
    from roundalign.fit.search import DumpNotExplained, fit

    console = make_console()
    model, rollouts, quantization = load(args.model, args.engine_logprobs, args.device)
    out = Path(args.out)
    if not args.json:
        console.print(plan(model, rollouts, args), highlight=False)
    with Progress(
        TextColumn("[bold]fit[/] forwards"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=args.json,
    ) as progress:
        task = progress.add_task("fit", total=None)
        try:
            result = fit(
                model,
                rollouts,
                exhaustive=args.exhaustive,
                screen_tokens=args.screen_tokens,
                prune_z=args.prune_z,
                decide_z=args.decide_z,
                max_excess=args.max_excess,
                progress=lambda n: progress.advance(task, n),
                on_total=lambda total: progress.update(task, total=total),
                quantization=quantization,
            )
        except DumpNotExplained as exc:
            progress.stop()
            if args.json:
                print(json.dumps(report.jsonable({"error": str(exc), "evidence": exc.evidence}), indent=2))
            else:
                console.print(f"[bold red]not fitted[/]: {exc}", highlight=False)
                console.print(report.render_not_explained(exc), highlight=False)
            return ExitStatus.NOT_FITTED
    out.mkdir(parents=True, exist_ok=True)
    data = report.as_dict(result, top=args.top)
    result.profile.save(out / "profile.json")
    durable.write_text(out / "report.json", json.dumps(data, indent=2, allow_nan=False) + "\n")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    for renderable in report.render(result, top=args.top):
        console.print(renderable, highlight=False)
    console.print(
        f"profile: {out / 'profile.json'}  (roundalign.apply(model, Profile.load(...)), or pass the path "
        f"to any --*-profile option); report: {out / 'report.json'}"
    )
    return 0
