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
from dataclasses import dataclass
from pathlib import Path

from roundalign.errors import ExitStatus, MissingFile, UserError, flag

SCREEN_TOKENS, PRUNE_Z = 512, 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from roundalign.fit.search import MAX_EXCESS

    a = parser.add_argument
    a(
        "--engine-logprobs",
        metavar="FILE",
        required=True,
        help="the engine's dump: a directory written by roundalign dump (its prefill.jsonl is fitted), or a JSONL "
        "file of {prompt_token_ids, token_ids, logprobs} lines (docs/real-engines.md, docs/fit.md)",
    )
    a("--model", metavar="PATH", help="the HF model directory the engine served (default: the shipped tiny-qwen3)")
    a("--out", metavar="DIR", default="fit-out", help="where profile.json and report.json go (default fit-out)")
    a(
        "--device",
        default="cpu",
        metavar="DEV",
        help="where the trainer model runs the candidates' forwards: cpu (default), cuda, cuda:1, ... A GPU makes a "
        "large model's fit minutes instead of hours, and its matmul kernels are closer to the engine's",
    )
    a("--exhaustive", action="store_true", help="score every candidate on every token (no pruning)")
    a("--screen-tokens", type=int, metavar="N", help="tokens every candidate is scored on before pruning (default 512)")
    a(
        "--prune-z",
        type=float,
        metavar="Z",
        help="drop a region's rule when the best beats it on the screen with sign-test z >= Z (default 5)",
    )
    a(
        "--decide-z",
        type=float,
        default=3.0,
        metavar="Z",
        help="call a region determined when the best beats its other rules with z >= Z (default 3)",
    )
    a(
        "--max-excess",
        type=float,
        default=MAX_EXCESS,
        metavar="X",
        help="refuse a dump farther from the best candidate than X times what rounding rules and kernels do to the "
        f"same tokens (default {MAX_EXCESS:g}; docs/fit.md)",
    )
    a("--top", type=int, default=10, metavar="N", help="candidates to list (default 10)")
    a("--json", action="store_true", help="print report.json instead of the tables")


@dataclass(frozen=True)
class FitConfig:
    """``roundalign fit``'s options, one field per option (``--screen-tokens`` is ``screen_tokens``)."""

    engine_logprobs: str
    model: str | None = None
    out: str = "fit-out"
    device: str = "cpu"
    exhaustive: bool = False
    screen_tokens: int | None = None  # None: SCREEN_TOKENS, unless --exhaustive
    prune_z: float | None = None  # None: PRUNE_Z, unless --exhaustive
    decide_z: float = 3.0
    max_excess: float | None = None  # None: roundalign.fit.search.MAX_EXCESS
    top: int = 10
    json: bool = False

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
    rollouts, refs, _ = read_references(dump, model.config)
    # A dump directory is fitted on its prefill log-probs: trainer-shaped forwards, which decide the most regions.
    scored = refs.get("prefill", refs.get("jsonl"))
    pairs = zip(rollouts, scored, strict=True)
    return model, [Rollout(r.prompt_token_ids, r.token_ids, lp, r.finish_reason) for r, lp in pairs]


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
    model, rollouts = load(args.model, args.engine_logprobs, args.device)
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
    (out / "report.json").write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")
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
