"""``TrainConfig``: every setting of a ``roundalign train`` run, validated before any work starts.

One frozen dataclass holds the run. ``roundalign train``'s options map onto its fields one to one (``--group-size``
is ``group_size``), ``config.json`` in the run directory is its ``to_dict()``, and ``--resume`` reads it back, so a
resumed run cannot silently change a setting. ``validate`` rejects option combinations that would make a run
meaningless, each with the reason and the fix, before a model is loaded (docs/train.md, "Invalid combinations").

Each field documents itself in ``metadata["help"]``, which is also the help of its ``roundalign train`` option: the
CLI fills in ``{default}`` (the field's default) and ``{profiles}`` (the profile names). Fields without an option
say so.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from roundalign.engine import BACKENDS, check_backend
from roundalign.errors import UserError, flag
from roundalign.numerics import dtypes
from roundalign.numerics.correction import ISCorrection
from roundalign.options import SAMPLING, check_sampling
from roundalign.profiles import get_profile
from roundalign.rl.objective import LOSS_TYPES
from roundalign.rl.osol import RESIDUALS, SCHEDULES
from roundalign.sync import MODES as SYNC_MODES
from roundalign.tasks import arithmetic
from roundalign.tasks.gym import parse_domains

OPTIMIZERS = ("adamw", "sgd")
ADV_ESTIMATORS = ("grpo", "osol")  # verl's name for the setting: algorithm.adv_estimator
DTYPES = tuple(dtypes.BY_NAME)
ENGINE_BACKENDS = BACKENDS
ENGINES = ("reference", "vllm")
TRAINER_SAME_AS_ENGINE = "engine"  # --trainer-profile engine: round where the engine does (the aligned trainer)
# --trainer-profile quantization-aligned: the engine's rounding rules and its quantization (served weights, activation
# quantizer, epilogue) with torch's kernels: the middle level between the stock trainer and the exact one.
TRAINER_QUANTIZATION_ALIGNED = "quantization-aligned"
TRAINER_ALIASES = (TRAINER_SAME_AS_ENGINE, TRAINER_QUANTIZATION_ALIGNED)


@dataclass(frozen=True)
class TrainConfig:
    """A GRPO run on the reference engine (or a real vLLM). Each field's ``metadata["help"]`` says what it sets."""

    model: str | None = field(default=None, metadata={"help": "HF model directory (default: the shipped tiny-qwen3)"})
    steps: int = field(default=60, metadata={"help": "training steps (default {default})"})
    prompts_per_step: int = field(default=8, metadata={"help": "problems per step (default {default})"})
    group_size: int = field(default=8, metadata={"help": "completions per problem (default {default})"})
    max_tokens: int = field(default=64, metadata={"help": SAMPLING["max_tokens"].help})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature, > 0 (default {default})"})
    top_p: float = field(default=1.0, metadata={"help": SAMPLING["top_p"].help})
    level: int = field(default=3, metadata={"help": "arithmetic level of the training problems (default {default})"})
    domains: str | None = field(
        default=None,
        metadata={
            "help": "train on reasoning-gym domains instead of the arithmetic task: built-in names (arithmetic, "
            "algorithmic, counting, probability) or name=dataset+dataset, separated by commas; each step's prompts "
            "are shared equally among them and each domain's reward is logged (the [gym] extra; "
            "docs/multi-domain.md). Use the shipped tiny-llama-chars (--model tiny-llama-chars)"
        },
    )
    adv_estimator: str = field(
        default="grpo",
        metadata={
            "help": "the advantage: grpo (default) or osol (OSOL's cross-step interference control over --domains: "
            "a rotating focus domain, domain weights and a footprint-ranked penalty; docs/multi-domain.md)"
        },
    )
    osol_focus_weight: float = field(
        default=1.0, metadata={"help": "osol: weight w_f of the focus domain's advantages (default {default:g}; ours)"}
    )
    osol_other_weight: float = field(
        default=0.5,
        metadata={
            "help": "osol: weight of the other domains' advantages, below the focus weight (default {default:g}; the "
            "paper says only w_f > w_nf: the value is ours)"
        },
    )
    osol_tau: float = field(
        default=0.03, metadata={"help": "osol: tau, the residual's scale against std(A_base) (default {default:g})"}
    )
    osol_clip: float = field(
        default=3.0, metadata={"help": "osol: corrected advantages are clipped to [-c, c] (default {default:g})"}
    )
    osol_p_lo: float = field(
        default=0.1, metadata={"help": "osol: the penalty of the least negative footprint (default {default:g})"}
    )
    osol_p_hi: float = field(
        default=1.0, metadata={"help": "osol: the penalty of the most negative footprint (default {default:g})"}
    )
    osol_residual: str = field(
        default="drift",
        metadata={
            "help": "osol: drift (default: penalties ranked by the footprint), random (the same penalties in a random "
            "order: an ablation) or none (the domain weights alone: an ablation)"
        },
    )
    osol_backtracking_every: int = field(
        default=1,
        metadata={
            "help": "osol: measure the realized backtracking (osol/backtracking) every N steps (default {default}; 0: "
            "never). It costs a forward of the focus domain's completions after the sync: about half of what OSOL adds "
            "to a step (docs/benchmarks.md, OSOL)"
        },
    )
    osol_schedule: str = field(
        default="random",
        metadata={
            "help": "osol: the focus domain: random (default, ours: uniform over the domains but the last focus) or "
            "cycle (a fixed rotation)"
        },
    )
    engine: str = field(
        default="reference",
        metadata={
            "help": "who samples: reference (default: roundalign's CPU engine) or vllm (a real vLLM in this process; "
            "run roundalign where it is installed, docs/kernels.md)"
        },
    )
    enforce_eager: bool = field(
        default=False, metadata={"help": "--engine vllm: its enforce_eager mode (default: compiled)"}
    )
    audit_served: bool = field(
        default=False,
        metadata={
            "help": "--engine vllm: after every weight sync, read each served weight back through vLLM's own modules "
            "and stop if one is not what was exported (one identity GEMM per layer: a check, not for large models)"
        },
    )
    engine_profile: str = field(
        default="vllm", metadata={"help": "the reference engine's rounding profile (default {default}; {profiles})"}
    )
    engine_backend: str = field(
        default="kernels", metadata={"help": "the reference engine's numerics backend (default {default})"}
    )
    quantization: str | None = field(
        default=None,
        metadata={
            "help": "the engine serves a quantized copy in this scheme (w8a8-int8, fp8, w4a16, ...; "
            "docs/quantization.md), exported onto its grid by --sync after every step: the reference engine "
            "computes it, or vLLM serves the checkpoint roundalign writes (OUT/served-model) and reloads it in place; "
            "--trainer-profile engine then computes it exactly"
        },
    )
    trainer_profile: str = field(
        default=TRAINER_SAME_AS_ENGINE,
        metadata={
            "help": "the trainer's rounding profile: 'engine' (default: round where the engine does; with --engine "
            "vllm, the build's profile with vLLM's kernels), 'quantization-aligned' (the engine's rounding rules "
            "and --quantization's scheme, torch's kernels), hf (stock), aligned, or any of {profiles}"
        },
    )
    loss_type: str = field(default="grpo", metadata={"help": "grpo (PPO-clip, default) or reinforce"})
    inner_epochs: int = field(default=1, metadata={"help": "passes over each step's rollouts (default {default})"})
    # None stands for 0.2 under grpo (resolved_clip_eps) and must stay None under reinforce, which does not clip.
    clip_eps: float | None = field(default=None, metadata={"help": "PPO clip epsilon (default 0.2)"})
    clip_eps_high: float | None = field(
        default=None, metadata={"help": "upper clip epsilon (DAPO clip-higher; default: --clip-eps)"}
    )
    optimizer: str = field(default="adamw", metadata={"help": "adamw (default) or sgd"})
    lr: float = field(default=1e-5, metadata={"help": "learning rate (default {default:g})"})
    weight_decay: float = field(default=0.0, metadata={"help": "decoupled weight decay (default {default:g})"})
    betas: tuple[float, float] = field(default=(0.9, 0.999), metadata={"help": "AdamW betas (default 0.9,0.999)"})
    grad_clip: float = field(default=1.0, metadata={"help": "max total gradient norm (default {default:g}; 0: off)"})
    rollout_is: str = field(
        default="none",
        metadata={"help": "importance-sampling correction between sampler and trainer (default {default})"},
    )
    rollout_is_threshold: str | None = field(
        default=None,
        metadata={"help": "its bounds in verl's format, e.g. 2.0 or 0.5_2.0 (default per mode, docs/train.md)"},
    )
    dtype: str = field(
        default="bfloat16",
        metadata={
            "help": "compute dtype of trainer and engine (default {default}; float16 is the Precision-RL baseline, "
            "with dynamic loss scaling)"
        },
    )
    loss_scale: float = field(
        default=2.0**16, metadata={"help": "float16: initial dynamic loss scale (default {default:g})"}
    )
    loss_scale_growth_interval: int = field(
        default=400,
        metadata={
            "help": "float16: steps without an overflow before the loss scale doubles (default {default}, verl's; "
            "no train option)"
        },
    )
    sync: str = field(
        default="rne",
        metadata={
            "help": "how master weights are rounded for the engine each step (default {default}); with "
            "--quantization, onto the scheme's grid"
        },
    )
    loss_on_served: bool | None = field(
        default=None,
        metadata={
            "help": "compute the trainer's forward on the served weights (default: on for stochastic and "
            "error-feedback)"
        },
    )
    prefill_check: bool = field(
        default=False,
        metadata={
            "help": "also log the trainer's mismatch against the engine's prefill re-score of the same tokens "
            "(prefill/*): the rounding-location gap without decode's attention shapes"
        },
    )
    eval_every: int = field(
        default=10, metadata={"help": "greedy held-out accuracy every N steps (default {default}; 0: never)"}
    )
    eval_problems: int = field(default=64, metadata={"help": "held-out problems per evaluation (default {default})"})
    lag_window: int = field(
        default=256,
        metadata={"help": "steps of master history kept to estimate the served copy's lag (default {default})"},
    )
    seed: int = field(
        default=0, metadata={"help": "seed for problems, sampling and stochastic export (default {default})"}
    )
    save_every: int = field(
        default=0, metadata={"help": "checkpoint every N steps (default {default}: by --save-minutes and at the end)"}
    )
    save_minutes: float = field(
        default=10.0,
        metadata={
            "help": "also checkpoint after a step that ends N minutes or more after the last checkpoint, so a killed "
            "run loses at most that much (default {default}; 0 = never)"
        },
    )
    extra: dict = field(
        default_factory=dict,
        metadata={"help": "free-form labels (compare's grid cell); never read by the training loop; no train option"},
    )

    # ----------------------------------------------------------------------------------------------------------

    @property
    def resolved_trainer_profile(self) -> str:
        return self.engine_profile if self.trainer_profile == TRAINER_SAME_AS_ENGINE else self.trainer_profile

    @property
    def served_scheme(self):
        """The quantization scheme the engine serves: ``--quantization``, or the engine profile's."""
        from roundalign.quant import Scheme

        return Scheme.parse(self.quantization) if self.quantization else get_profile(self.engine_profile).quantization

    @property
    def resolved_loss_on_served(self) -> bool:
        return self.sync != "rne" if self.loss_on_served is None else self.loss_on_served

    @property
    def resolved_clip_eps(self) -> float:
        return 0.2 if self.clip_eps is None else self.clip_eps

    @property
    def batch_size(self) -> int:
        return self.prompts_per_step * self.group_size

    def correction(self) -> ISCorrection:
        return ISCorrection.parse(self.rollout_is, self.rollout_is_threshold)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise UserError(f"config has unknown setting(s) {unknown}; it was written by another roundalign version")
        d = dict(d)
        if "betas" in d:
            d["betas"] = tuple(d["betas"])
        return cls(**d)

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def __post_init__(self) -> None:
        if self.quantization == "none":  # the bf16 engine, spelled as a scheme (a compare grid's quantization=none)
            object.__setattr__(self, "quantization", None)

    def validate(self) -> TrainConfig:
        """Raise ``UserError`` naming the first bad setting (as its command-line option) and the fix; return ``self``
        when all is well."""
        _positive_int(self.steps, "steps")
        _positive_int(self.prompts_per_step, "prompts_per_step")
        _positive_int(self.max_tokens, "max_tokens")
        _positive_int(self.inner_epochs, "inner_epochs")
        _positive_int(self.eval_problems, "eval_problems")
        _positive_int(self.lag_window, "lag_window")
        for name in ("eval_every", "save_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise UserError(f"{flag(name)} must be an int >= 0 (0 = never), got {v!r}")
        m = self.save_minutes
        if isinstance(m, bool) or not isinstance(m, int | float) or not math.isfinite(m) or m < 0:
            raise UserError(f"--save-minutes must be a number >= 0 (0 = never), got {m!r}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 2:
            raise UserError(
                f"--group-size must be an int >= 2, got {self.group_size!r}: GRPO normalises each "
                "completion's reward against the other completions of its prompt"
            )
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise UserError(
                f"--temperature must be > 0, got {self.temperature!r}: greedy rollouts make every "
                "completion of a group identical, so every advantage is 0 and nothing is learned"
            )
        self._validate_domains()
        if isinstance(self.level, bool) or self.level not in arithmetic.LEVELS:
            raise UserError(f"--level must be one of {', '.join(map(str, arithmetic.LEVELS))}, got {self.level!r}")
        check_sampling({"top_p": self.top_p})  # the range every command checks; temperature's is stricter here
        named = ["engine_profile"] + ([] if self.trainer_profile in TRAINER_ALIASES else ["trainer_profile"])
        for name in named:
            try:
                get_profile(getattr(self, name))
            except (KeyError, ValueError) as exc:
                raise UserError(f"{flag(name)}: {exc}") from None
        _choice(self.engine, ENGINES, "engine")
        if self.quantization is not None:
            from roundalign.quant import Scheme

            scheme = Scheme.parse(self.quantization)
            if self.engine == "vllm":
                scheme.check_vllm_cpu()
            if self.engine == "vllm" and not self.enforce_eager:
                raise UserError(
                    "--quantization with --engine vllm is reproduced in vLLM's enforce_eager mode: add --enforce-eager"
                )
            served = get_profile(self.engine_profile).quantization
            if self.engine == "reference" and served.quantized and served != scheme:
                raise UserError(f"--engine-profile {self.engine_profile} serves {served}, not --quantization {scheme}")
        if self.enforce_eager and self.engine != "vllm":
            raise UserError("--enforce-eager is a vLLM mode: add --engine vllm, or drop --enforce-eager")
        if self.audit_served and self.engine != "vllm":
            raise UserError(
                "--audit-served reads the weights back from vLLM; the reference engine serves the exported tensors "
                "themselves. Add --engine vllm, or drop --audit-served"
            )
        if self.engine == "vllm" and (self.dtype != "bfloat16" or self.engine_backend != "kernels"):
            raise UserError(
                "--engine vllm serves bfloat16 with vLLM's own code: drop --dtype and --engine-backend (they set the "
                "reference engine)"
            )
        _choice(self.engine_backend, ENGINE_BACKENDS, "engine_backend")
        try:
            check_backend(self.engine_backend, self.engine_profile)
        except UserError as exc:
            raise UserError(f"--engine-backend {self.engine_backend}: {exc}") from None
        _choice(self.loss_type, LOSS_TYPES, "loss_type")
        _choice(self.optimizer, OPTIMIZERS, "optimizer")
        _choice(self.dtype, DTYPES, "dtype")
        _choice(self.sync, SYNC_MODES, "sync")
        if self.loss_type == "reinforce":
            if self.inner_epochs != 1:
                raise UserError(
                    f"--inner-epochs {self.inner_epochs} with --loss-type reinforce: plain REINFORCE has "
                    f"no "
                    "ratio to clip, so a second pass over the same rollouts is off-policy with nothing to "
                    "correct it; use --loss-type grpo (PPO-clip) for several inner epochs"
                )
            if self.clip_eps is not None or self.clip_eps_high is not None:
                raise UserError(
                    "--clip-eps / --clip-eps-high apply to --loss-type grpo (PPO-clip); plain REINFORCE "
                    "does not clip: drop them or use --loss-type grpo"
                )
        eps = self.resolved_clip_eps
        if not 0 < eps < 1 or (self.clip_eps_high is not None and not 0 < self.clip_eps_high):
            raise UserError(
                f"--clip-eps must be in (0, 1) and --clip-eps-high > 0, got {eps!r} / {self.clip_eps_high!r}"
            )
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise UserError(f"--lr must be > 0, got {self.lr!r}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise UserError(f"--weight-decay must be >= 0, got {self.weight_decay!r}")
        if not (math.isfinite(self.grad_clip) and self.grad_clip >= 0):
            raise UserError(f"--grad-clip must be >= 0 (0 = no clipping), got {self.grad_clip!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise UserError(f"--betas must be two numbers in [0, 1), got {self.betas!r}")
        if self.optimizer == "sgd" and tuple(self.betas) != (0.9, 0.999):
            raise UserError("--betas apply to --optimizer adamw only; drop them or use --optimizer adamw")
        try:
            self.correction()  # the library's check of the mode and threshold
        except ValueError as exc:
            raise UserError(
                f"--rollout-is {self.rollout_is} --rollout-is-threshold {self.rollout_is_threshold}: {exc}"
            ) from None
        if self.loss_on_served and self.sync == "rne":
            raise UserError(
                "--loss-on-served with --sync rne changes nothing: the trainer's compute copy already is "
                "the RNE cast of the master, which is exactly what rne serves. Use --sync stochastic or "
                "--sync error-feedback (where loss_on_served is on by default), or drop --loss-on-served"
            )
        if self.dtype == "float16":
            if not (math.isfinite(self.loss_scale) and self.loss_scale >= 1):
                raise UserError(f"--loss-scale must be >= 1, got {self.loss_scale!r}")
            _positive_int(self.loss_scale_growth_interval, "loss_scale_growth_interval")
            if self.engine_backend != "kernels":
                raise UserError("--dtype float16 runs the engine's kernels backend; drop --engine-backend inductor")
        return self

    def _validate_domains(self) -> None:
        _choice(self.adv_estimator, ADV_ESTIMATORS, "adv_estimator")
        if self.domains is not None:
            if not isinstance(self.domains, str):
                raise UserError(f"--domains must be a string such as arithmetic,counting, got {self.domains!r}")
            n = len(parse_domains(self.domains))  # UserError naming a bad domain or dataset
            if self.prompts_per_step < n:
                raise UserError(
                    f"--prompts-per-step {self.prompts_per_step} is below the {n} domains of --domains: each step "
                    f"gives every domain an equal share; use --prompts-per-step {n} or more (a multiple of {n})"
                )
        osol_set = [f.name for f in dataclasses.fields(self) if f.name.startswith("osol_")]
        if self.adv_estimator != "osol":
            given = [n for n in osol_set if getattr(self, n) != _DEFAULTS[n]]
            if given:
                raise UserError(
                    f"{', '.join(map(flag, given))} set OSOL's advantage: add --adv-estimator osol, or drop them"
                )
            return
        if self.domains is None or len(parse_domains(self.domains)) < 2:
            raise UserError(
                "--adv-estimator osol rotates a focus over domains: give --domains with at least two (for one domain "
                "alone, use --adv-estimator grpo)"
            )
        for name in ("osol_focus_weight", "osol_other_weight", "osol_tau", "osol_clip"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise UserError(f"{flag(name)} must be a finite number >= 0, got {v!r}")
        b = self.osol_backtracking_every
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise UserError(f"--osol-backtracking-every must be an int >= 0 (0 = never), got {b!r}")
        if self.osol_clip <= 0:
            raise UserError(f"--osol-clip must be > 0, got {self.osol_clip!r}")
        if not (0 <= self.osol_p_lo <= self.osol_p_hi <= 1):
            raise UserError(
                f"--osol-p-lo and --osol-p-hi need 0 <= p_lo <= p_hi <= 1, got {self.osol_p_lo!r} and "
                f"{self.osol_p_hi!r}"
            )
        _choice(self.osol_residual, RESIDUALS, "osol_residual")
        _choice(self.osol_schedule, SCHEDULES, "osol_schedule")


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}


def _positive_int(v, name: str) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise UserError(f"{flag(name)} must be an int >= 1, got {v!r}")


def _choice(v, choices, name: str) -> None:
    if v not in choices:
        raise UserError(f"unknown {flag(name)} {v!r}; choose one of {', '.join(choices)}")
