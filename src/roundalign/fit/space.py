"""The rule space ``roundalign fit`` searches: every combination of the per-region rules a Profile supports.

A candidate is one rule per region *that the model exercises*. A region the model has no module for (Qwen3's q/k
norm in a Llama, the experts' SwiGLU in a dense model) cannot change a single log-prob, so it is not searched: it
is reported as not determined by the data, and the fitted profile fills it from the nearest named profile. RoPE is
searched as the plain ``cos_sin/rounding`` rules: the four that round to nearest, and ``bf16/truncate`` (vLLM's CPU
kernel truncates on its bf16 cache; no engine truncates with an fp32 one). A model has one head_dim, so a
``HeadDimRope`` (SGLang's rule) acts on it as one of these.

Sizes: Qwen3 dense 2 x 3 x 4 x 5 x 2 = 240 candidates, Qwen3-MoE x 2 = 480 (if it has dense layers too), Qwen2 and
Llama 2 x 4 x 5 x 2 = 80.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from roundalign import support
from roundalign.patch import family_of
from roundalign.profiles import (
    PROFILES,
    REGIONS,
    SEARCHED_ROPE_RULES,
    Profile,
    QKNormRule,
    ResidualRule,
    RMSNormRule,
    SwiGLURule,
    get_profile,
)

RULES: dict[str, tuple] = {
    "rms_norm": tuple(RMSNormRule),
    "qk_norm": tuple(QKNormRule),
    "residual": tuple(ResidualRule),
    "rope": SEARCHED_ROPE_RULES,
    "swiglu": tuple(SwiGLURule),
    "expert_swiglu": tuple(SwiGLURule),
}

# Short column labels for tables: rules read better without their region prefix.
SHORT = {
    "round_before_weight": "before_w",
    "round_after_weight": "after_w",
    "fused_into_rope": "into_rope",
    "normalize_rounded_sum": "rounded_sum",
    "normalize_fp32_sum": "fp32_sum",
    "round_at_attention": "at_attention",
    "never_round": "never",
    "round_silu": "round_silu",
    "once": "once",
}


def short(rule) -> str:
    text = str(rule)
    return SHORT.get(text, text)


@dataclass(frozen=True)
class Candidate:
    """One rule per searched region, in ``Space.regions`` order; ``rules`` holds the rule strings."""

    regions: tuple[str, ...]
    rules: tuple[str, ...]

    def rule(self, region: str) -> str:
        return self.rules[self.regions.index(region)]

    def as_dict(self) -> dict[str, str]:
        return dict(zip(self.regions, self.rules, strict=True))

    def label(self) -> str:
        return " ".join(f"{r}={short(v)}" for r, v in zip(self.regions, self.rules, strict=True))


@dataclass(frozen=True)
class Space:
    """Which regions a model exercises, and why the others are not searched."""

    model_type: str
    head_dim: int
    regions: tuple[str, ...]
    idle: dict[str, str]  # region -> why the model cannot tell its rules apart
    quantization: str = "none"  # what the engine served: every candidate computes it (roundalign.quant)

    @classmethod
    def of(cls, model, quantization: str | None = None) -> Space:
        """The space for an HF model that ``roundalign.apply`` supports (its family decides the regions), for an
        engine that served ``quantization`` (a scheme name; None for bf16)."""
        family = family_of(model)  # unsupported model types raise here, naming the supported ones
        config = model.config
        head_dim = support.head_dim(config)
        kinds = {type(m) for m in model.modules()}
        idle = {}
        if not family.has_qk_norm:
            idle["qk_norm"] = f"{config.model_type} has no per-head q/k norm"
        mlp = family.swaps.get("mlp")
        if mlp is None or mlp[0] not in kinds:
            idle["swiglu"] = "the model has no dense MLP layer"
        experts = family.swaps.get("experts")
        if experts is None or experts[0] not in kinds:
            idle["expert_swiglu"] = "the model has no MoE experts"
        regions = tuple(r for r in REGIONS if r not in idle)
        return cls(config.model_type, int(head_dim), regions, idle, quantization or "none")

    def candidates(self) -> list[Candidate]:
        """Every combination, in a fixed order (the first region varies slowest)."""
        return [
            Candidate(self.regions, tuple(map(str, combo)))
            for combo in itertools.product(*(RULES[r] for r in self.regions))
        ]

    def size(self) -> int:
        n = 1
        for r in self.regions:
            n *= len(RULES[r])
        return n

    def rule_of(self, profile: Profile, region: str) -> str:
        """``profile``'s rule for ``region`` on this model (RoPE at its head_dim), as a string."""
        return str(profile.rope_for(self.head_dim)) if region == "rope" else str(getattr(profile, region))

    def key_of(self, profile: str | Profile) -> Candidate:
        """The candidate a (named) profile is on this model: its rules on the searched regions, RoPE at head_dim."""
        p = get_profile(profile)
        return Candidate(self.regions, tuple(self.rule_of(p, r) for r in self.regions))

    def named(self) -> dict[str, Candidate]:
        """Each built-in profile's candidate on this model."""
        return {name: self.key_of(name) for name in PROFILES}

    def profile(self, candidate: Candidate, name: str = "candidate", fill: str | Profile = "hf", **fields) -> Profile:
        """A full Profile: the candidate's rules, and ``fill``'s rules for the regions the model does not exercise."""
        base = get_profile(fill)
        rules = {r: self.rule_of(base, r) for r in REGIONS}
        rules.update(candidate.as_dict())
        return Profile(name=name, **rules, **{"quantization": self.quantization, **fields})

    def nearest_named(self, candidate: Candidate) -> str:
        """The built-in profile that shares the most rules with ``candidate`` (the first in PROFILES on a tie)."""

        def shared(name: str) -> int:
            other = self.key_of(name)
            return sum(a == b for a, b in zip(candidate.rules, other.rules, strict=True))

        return max(PROFILES, key=shared)
