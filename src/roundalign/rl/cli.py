"""``roundalign train``: one GRPO run on the reference engine or a real vLLM, from the command line.

    roundalign train --out runs/hf-rne --trainer-profile hf --sync rne --steps 60
    roundalign train --out runs/aligned-sr --trainer-profile engine --sync stochastic
    roundalign train --resume runs/aligned-sr --steps 120      # continue a run from its last checkpoint

Every option maps onto one ``TrainConfig`` field (``--group-size`` -> ``group_size``). Options are read with
argparse defaults suppressed, so the run knows which ones the user gave: a resumed run takes its settings from the
run's ``config.json`` and rejects a given option that contradicts it (only ``--steps`` and ``--save-every`` may
change), and ``--clip-eps`` given with ``--loss-type reinforce`` is an error rather than silently ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from roundalign.errors import ExitStatus, UserError, flag
from roundalign.numerics.correction import IS_MODES
from roundalign.profiles import list_profiles
from roundalign.rl.config import DTYPES, ENGINE_BACKENDS, ENGINES, OPTIMIZERS, TrainConfig
from roundalign.rl.objective import LOSS_TYPES
from roundalign.sync import MODES as SYNC_MODES

RESUMABLE_CHANGES = ("steps", "save_every")  # settings a resumed run may change: neither alters the metrics


def _betas(text: str) -> tuple[float, float]:
    try:
        a, b = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--betas takes two numbers 'b1,b2', got {text!r}") from None
    return a, b


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    profiles = ", ".join(list_profiles())
    g = parser.add_argument_group("run")
    a = g.add_argument
    a("--out", metavar="DIR", help="run directory: config.json, metrics.jsonl, checkpoints/ (default runs/train)")
    a("--resume", metavar="DIR", help="continue the run in DIR from its last checkpoint (its config.json rules)")
    a("--model", metavar="PATH", help="HF model directory (default: the shipped tiny-qwen3)")
    a("--steps", type=int, help=f"training steps (default {d.steps})")
    a("--seed", type=int, help=f"seed for problems, sampling and stochastic export (default {d.seed})")
    a("--save-every", type=int, metavar="N", help="checkpoint every N steps (default 0: only at the end)")
    a(
        "--eval-every",
        type=int,
        metavar="N",
        help=f"greedy held-out accuracy every N steps (default {d.eval_every}; 0: never)",
    )
    a("--eval-problems", type=int, metavar="N", help=f"held-out problems per evaluation (default {d.eval_problems})")
    a("--no-tensorboard", action="store_true", help="do not write TensorBoard events even if tensorboard is installed")
    a("--quiet", action="store_true", help="no progress bar")
    g = parser.add_argument_group("rollouts")
    a = g.add_argument
    a(
        "--engine",
        choices=ENGINES,
        help="who samples: reference (default: roundalign's CPU engine) or vllm (a real vLLM in this process; run "
        "roundalign where it is installed, docs/kernels.md)",
    )
    a("--enforce-eager", action="store_true", help="--engine vllm: its enforce_eager mode (default: compiled)")
    a(
        "--engine-profile",
        metavar="NAME",
        help=f"the reference engine's rounding profile (default {d.engine_profile}; {profiles})",
    )
    a(
        "--engine-backend",
        choices=ENGINE_BACKENDS,
        help=f"the reference engine's numerics backend (default {d.engine_backend})",
    )
    a("--prompts-per-step", type=int, help=f"problems per step (default {d.prompts_per_step})")
    a("--group-size", type=int, help=f"completions per problem (default {d.group_size})")
    a("--max-tokens", type=int, help=f"max completion tokens (default {d.max_tokens})")
    a("--temperature", type=float, help=f"sampling temperature (default {d.temperature})")
    a("--top-p", type=float, help=f"nucleus sampling (default {d.top_p})")
    a(
        "--prefill-check",
        action="store_true",
        help="also log the trainer's mismatch against the engine's prefill "
        "re-score of the same tokens (prefill/*): the rounding-location gap without decode's attention shapes",
    )
    a("--level", type=int, choices=(1, 2, 3), help=f"arithmetic level of the training problems (default {d.level})")
    g = parser.add_argument_group("trainer")
    a = g.add_argument
    a(
        "--trainer-profile",
        metavar="NAME",
        help="the trainer's rounding profile: 'engine' (default: round where the engine does; with --engine vllm, "
        f"the build's profile with vLLM's kernels), hf (stock), aligned, or any of {profiles}",
    )
    a(
        "--dtype",
        choices=DTYPES,
        help="compute dtype of trainer and engine (default bfloat16; float16 is the "
        "Precision-RL baseline, with dynamic loss scaling)",
    )
    a("--loss-type", choices=LOSS_TYPES, help="grpo (PPO-clip, default) or reinforce")
    a("--inner-epochs", type=int, help="passes over each step's rollouts (default 1)")
    a("--clip-eps", type=float, help="PPO clip epsilon (default 0.2)")
    a("--clip-eps-high", type=float, help="upper clip epsilon (DAPO clip-higher; default: --clip-eps)")
    a("--optimizer", choices=OPTIMIZERS, help="adamw (default) or sgd")
    a("--lr", type=float, help=f"learning rate (default {d.lr:g})")
    a("--weight-decay", type=float, help=f"decoupled weight decay (default {d.weight_decay:g})")
    a("--betas", type=_betas, metavar="B1,B2", help="AdamW betas (default 0.9,0.999)")
    a("--grad-clip", type=float, help=f"max total gradient norm (default {d.grad_clip:g}; 0: off)")
    a(
        "--rollout-is",
        choices=IS_MODES,
        help="importance-sampling correction between sampler and trainer (default none)",
    )
    a(
        "--rollout-is-threshold",
        metavar="U|L_U",
        help="its bounds in verl's format, e.g. 2.0 or 0.5_2.0 (default per mode, docs/train.md)",
    )
    a("--loss-scale", type=float, help="float16: initial dynamic loss scale (default 65536)")
    g = parser.add_argument_group("weight export (Fair Cast)")
    a = g.add_argument
    a("--sync", choices=SYNC_MODES, help="how master weights are rounded for the engine each step (default rne)")
    a(
        "--loss-on-served",
        action=argparse.BooleanOptionalAction,
        help="compute the trainer's forward on the served weights (default: on for stochastic and error-feedback)",
    )
    a("--lag-window", type=int, help="steps of master history kept to estimate the served copy's lag (default 256)")
    for action in parser._actions:  # no defaults in the namespace: only what the user gave (see the docstring)
        if action.dest != "help":
            action.default = argparse.SUPPRESS


_NOT_CONFIG = ("out", "resume", "no_tensorboard", "quiet", "command")


@dataclass(frozen=True)
class TrainRun:
    """``roundalign train``'s options: the run's settings (``TrainConfig`` fields, only those the user gave) and
    where the run goes. ``validate()`` resolves them into ``config``, reading a resumed run's own settings."""

    given: dict = field(default_factory=dict)
    out: str | None = None
    resume: str | None = None
    quiet: bool = False
    tensorboard: bool = True
    config: TrainConfig | None = None  # set by validate()

    @property
    def run_dir(self) -> Path:
        return Path(self.resume or self.out or "runs/train")

    def validate(self) -> TrainRun:
        if self.resume is None:
            return dataclasses.replace(self, config=TrainConfig(**self.given).validate())
        out = Path(self.resume)
        if self.out is not None and Path(self.out) != out:
            raise UserError("--resume DIR continues the run in DIR; drop --out (or give the same directory)")
        path = out / "config.json"
        if not path.is_file():
            raise UserError(
                f"cannot resume: {str(path)!r} does not exist; --resume takes a run directory written "
                "by roundalign train"
            )
        saved = TrainConfig.from_dict(json.loads(path.read_text()))
        clash = {
            k: (getattr(saved, k), v)
            for k, v in self.given.items()
            if k not in RESUMABLE_CHANGES and _normal(getattr(saved, k)) != _normal(v)
        }
        if clash:
            lines = ", ".join(f"{flag(k)} {new!r} (the run has {old!r})" for k, (old, new) in clash.items())
            raise UserError(
                f"a resumed run keeps its settings; these options contradict {str(path)!r}: {lines}. "
                f"Only {', '.join(flag(c) for c in RESUMABLE_CHANGES)} may change"
            )
        config = saved.replace(**{k: v for k, v in self.given.items() if k in RESUMABLE_CHANGES})
        return dataclasses.replace(self, config=config.validate())


def config_from_args(args: argparse.Namespace) -> TrainRun:
    """The run from parsed ``train`` arguments (argparse defaults are suppressed: only what the user gave)."""
    return TrainRun(
        given={k: v for k, v in vars(args).items() if k not in _NOT_CONFIG},
        out=getattr(args, "out", None),
        resume=getattr(args, "resume", None),
        quiet=getattr(args, "quiet", False),
        tensorboard=not getattr(args, "no_tensorboard", False),
    )


def _normal(v):
    return list(v) if isinstance(v, tuple) else v


def run(run: TrainRun) -> int:
    from roundalign.console import make_console
    from roundalign.rl.loop import train

    console = make_console()
    train(
        run.config,
        run.run_dir,
        resume=run.resume is not None,
        console=console,
        progress=not run.quiet,
        tensorboard=run.tensorboard,
    )
    if not run.quiet:
        _report(run.run_dir, run.config, console)
    return ExitStatus.OK


# (metric, label, format) shown at the end of a run, averaged over its last 10 steps. The mismatch rows say what they
# compare: the trainer's recompute against the log-probs the engine returned while sampling (decode), and, with
# --prefill-check, against the engine's own prefill re-score of the same tokens.
_REPORT = (
    ("reward/mean", "reward", ".3f"),
    ("rollout_corr/k3_kl", "k3_kl, trainer vs sampler's decode log-probs", ".2e"),
    ("mismatch/bitwise_equal_frac", "bitwise equal, vs decode log-probs", ".1%"),
    ("prefill/k3_kl", "k3_kl, trainer vs engine prefill", ".2e"),
    ("prefill/bitwise_equal_frac", "bitwise equal, vs engine prefill", ".1%"),
    ("sync/visible_fraction", "served weights changed per step", ".1%"),
    ("sync/lag_steps", "served-copy lag (steps)", ".1f"),
    ("timing_s/step", "seconds per step", ".2f"),
)
_WIDTH = max(len(label) for _, label, _ in _REPORT) + 2


def _report(out: Path, config: TrainConfig, console) -> None:
    """A short summary of the finished run: what ran, the last 10 steps' averages, the first and last evaluation,
    the files."""
    from roundalign.rl.logbook import read_metrics

    rows = read_metrics(out / "metrics.jsonl")
    steps = [r for r in rows if r["step"] > 0][-10:]
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    # The run's own config.json: the trainer profile as the run resolved it (--engine vllm picks the build's).
    saved = json.loads((out / "config.json").read_text()) if (out / "config.json").is_file() else {}
    resolved = config.replace(trainer_profile=saved["trainer_profile"]) if "trainer_profile" in saved else config
    trainer = resolved.resolved_trainer_profile
    if config.engine == "vllm":
        engine = f"engine vLLM ({'enforce_eager' if config.enforce_eager else 'compiled'} mode)"
    else:
        engine = f"engine profile {config.engine_profile} ({config.engine_backend} backend)"
    lines = [
        f"run {out}: {rows[-1]['step']} steps; trainer profile {trainer}, {engine}, {config.dtype}, "
        f"--sync {config.sync}"
        f"{', loss on served weights' if config.resolved_loss_on_served else ''}, --rollout-is {config.rollout_is}",
        f"last {len(steps)} steps on average:",
    ]
    for key, label, spec in _REPORT:
        values = [r[key] for r in steps if r.get(key) is not None]
        if values:
            lines.append(f"  {label:<{_WIDTH}} {format(sum(values) / len(values), spec)}")
    if evals:
        lines.append(
            f"  {'held-out accuracy (greedy)':<{_WIDTH}} {evals[0][1]:.3f} at step {evals[0][0]} -> "
            f"{evals[-1][1]:.3f} at step {evals[-1][0]}"
        )
    lines.append(f"metrics: {out / 'metrics.jsonl'}; checkpoints: {out / 'checkpoints'} (docs/train.md)")
    console.print("\n".join(lines), markup=False, highlight=False, soft_wrap=True)  # a path is never broken
