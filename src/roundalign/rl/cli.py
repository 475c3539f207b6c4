"""``roundalign train``: one GRPO run on the reference engine or a real vLLM, from the command line.

    roundalign train --out runs/hf-rne --trainer-profile hf --sync rne --steps 60
    roundalign train --out runs/aligned-sr --trainer-profile engine --sync stochastic
    roundalign train --resume runs/aligned-sr --steps 120      # continue a run from its last checkpoint

Every option but the run's own (``--out``, ``--resume``, ``--no-tensorboard``, ``--quiet``) maps onto one
``TrainConfig`` field (``--group-size`` -> ``group_size``), whose ``metadata["help"]`` is its help; ``OPTION_GROUPS``
lists the options, for this parser and for ``roundalign compare``'s grid. Options are read with argparse defaults
suppressed, so the run knows which ones the user gave: a resumed run takes its settings from the run's
``config.json`` and rejects a given option that contradicts it (only ``--steps`` and ``--save-every`` may change),
and ``--clip-eps`` given with ``--loss-type reinforce`` is an error rather than silently ignored.
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
from roundalign.rl.config import ADV_ESTIMATORS, DTYPES, ENGINE_BACKENDS, ENGINES, OPTIMIZERS, TrainConfig
from roundalign.rl.objective import LOSS_TYPES
from roundalign.rl.osol import RESIDUALS, SCHEDULES
from roundalign.sync import MODES as SYNC_MODES
from roundalign.tasks import arithmetic
from roundalign.untrusted import read_json_object

# settings a resumed run may change: none alters the metrics
RESUMABLE_CHANGES = ("steps", "save_every", "save_minutes")


def _betas(text: str) -> tuple[float, float]:
    try:
        a, b = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--betas takes two numbers 'b1,b2', got {text!r}") from None
    return a, b


@dataclass(frozen=True)
class Option:
    """One ``roundalign train`` option: ``dest``, the setting it gives (a ``TrainConfig`` field, or one of the run's
    own: out, resume, no_tensorboard, quiet), argparse's keywords for it, and its help (None: the field's
    ``metadata["help"]``, so each text lives in one place)."""

    dest: str
    kwargs: dict = field(default_factory=dict)
    help: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")

    @property
    def flags(self) -> tuple[str, ...]:
        """Every spelling: ``--loss-on-served`` also has ``--no-loss-on-served``."""
        if self.kwargs.get("action") is argparse.BooleanOptionalAction:
            return self.flag, "--no-" + self.flag[2:]
        return (self.flag,)

    @property
    def takes_value(self) -> bool:
        return self.kwargs.get("action") not in ("store_true", argparse.BooleanOptionalAction)


# The options in --help order, by group. A grid of runs (rl/compare_plan.py) reads this table too.
OPTION_GROUPS: tuple[tuple[str, tuple[Option, ...]], ...] = (
    (
        "run",
        (
            Option(
                "out",
                {"metavar": "DIR"},
                "run directory: config.json, metrics.jsonl, checkpoints/ (default runs/train)",
            ),
            Option(
                "resume",
                {"metavar": "DIR"},
                "continue the run in DIR from its last checkpoint (its config.json rules)",
            ),
            Option("model", {"metavar": "PATH"}),
            Option("steps", {"type": int}),
            Option("seed", {"type": int}),
            Option("save_every", {"type": int, "metavar": "N"}),
            Option("save_minutes", {"type": float, "metavar": "M"}),
            Option("eval_every", {"type": int, "metavar": "N"}),
            Option("eval_problems", {"type": int, "metavar": "N"}),
            Option(
                "no_tensorboard",
                {"action": "store_true"},
                "do not write TensorBoard events even if tensorboard is installed",
            ),
            Option("quiet", {"action": "store_true"}, "no progress bar"),
        ),
    ),
    (
        "rollouts",
        (
            Option("engine", {"choices": ENGINES}),
            Option("enforce_eager", {"action": "store_true"}),
            Option("audit_served", {"action": "store_true"}),
            Option("engine_profile", {"metavar": "NAME"}),
            Option("engine_backend", {"choices": ENGINE_BACKENDS}),
            Option("quantization", {"metavar": "SCHEME"}),
            Option("prompts_per_step", {"type": int}),
            Option("group_size", {"type": int}),
            Option("max_tokens", {"type": int}),
            Option("temperature", {"type": float}),
            Option("top_p", {"type": float}),
            Option("prefill_check", {"action": "store_true"}),
            Option("level", {"type": int, "choices": arithmetic.LEVELS}),
        ),
    ),
    (
        "trainer",
        (
            Option("trainer_profile", {"metavar": "NAME"}),
            Option("dtype", {"choices": DTYPES}),
            Option("loss_type", {"choices": LOSS_TYPES}),
            Option("inner_epochs", {"type": int}),
            Option("clip_eps", {"type": float}),
            Option("clip_eps_high", {"type": float}),
            Option("optimizer", {"choices": OPTIMIZERS}),
            Option("lr", {"type": float}),
            Option("weight_decay", {"type": float}),
            Option("betas", {"type": _betas, "metavar": "B1,B2"}),
            Option("grad_clip", {"type": float}),
            Option("rollout_is", {"choices": IS_MODES}),
            Option("rollout_is_threshold", {"metavar": "U|L_U"}),
            Option("loss_scale", {"type": float}),
        ),
    ),
    (
        "multi-domain RL (OSOL)",
        (
            Option("domains", {"metavar": "SPEC"}),
            Option("adv_estimator", {"choices": ADV_ESTIMATORS}),
            Option("osol_focus_weight", {"type": float}),
            Option("osol_other_weight", {"type": float}),
            Option("osol_tau", {"type": float}),
            Option("osol_clip", {"type": float}),
            Option("osol_p_lo", {"type": float}),
            Option("osol_p_hi", {"type": float}),
            Option("osol_residual", {"choices": RESIDUALS}),
            Option("osol_schedule", {"choices": SCHEDULES}),
            Option("osol_backtracking_every", {"type": int, "metavar": "N"}),
        ),
    ),
    (
        "weight export (Fair Cast)",
        (
            Option("sync", {"choices": SYNC_MODES}),
            Option("loss_on_served", {"action": argparse.BooleanOptionalAction}),
            Option("lag_window", {"type": int}),
        ),
    ),
)
OPTIONS: dict[str, Option] = {o.dest: o for _, group in OPTION_GROUPS for o in group}
_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def help_text(option: Option) -> str:
    """The option's help: its own, or its ``TrainConfig`` field's with ``{default}`` and ``{profiles}`` filled in."""
    if option.help is not None:
        return option.help
    config_field = _FIELDS[option.dest]
    default = config_field.default if config_field.default is not dataclasses.MISSING else None
    return config_field.metadata["help"].format(default=default, profiles=", ".join(list_profiles()))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for title, options in OPTION_GROUPS:
        group = parser.add_argument_group(title)
        for option in options:
            # No defaults in the namespace: only what the user gave (see the module docstring).
            group.add_argument(option.flag, **option.kwargs, default=argparse.SUPPRESS, help=help_text(option))


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
        try:
            saved = TrainConfig.from_dict(read_json_object(path, "a run's settings (roundalign train writes it)"))
            saved.validate()
        except UserError as e:
            raise UserError(f"{path}: {e}" if str(path) not in str(e) else str(e)) from None
        except (TypeError, ValueError) as e:  # a setting of the wrong type
            raise UserError(f"{path}: not a valid run configuration ({e})") from None
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
