"""``Profile``: one rule per region and per kernel, with its validation, its overrides and its JSON form.

A ``Profile`` parses every field it is given (strings as ``"bf16/once"`` or ``"round_after_weight"``, as a
profile file holds them) into the rule types of ``roundalign.profiles.rules``, and refuses an unknown one with the
choices. ``replace`` derives a profile with some rules overridden; ``save``/``load`` write and read the JSON that
``roundalign fit`` and ``roundalign profiles --json`` write.

The methods that take a profile by name (``same_rules``, ``is_stock_hf``, ``rounding_only``) read the built-in
table. ``roundalign.profiles.builtin`` builds that table from this class and registers it here as it is imported
(``register_builtins``), so that neither module imports the other; the package's face imports both, so the table is
in place whenever a ``Profile`` is in use.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from roundalign import durable
from roundalign.errors import UserError
from roundalign.profiles.rules import (
    KERNELS,
    REGIONS,
    RULES,
    AttentionKernel,
    ForwardKernel,
    GemmKernel,
    HeadDimRope,
    QKNormRule,
    ResidualRule,
    RMSNormRule,
    RopeAngles,
    RopeRule,
    SwiGLURule,
    formula,
)
from roundalign.quant.schemes import NONE, Scheme
from roundalign.untrusted import read_json_object


@dataclass(frozen=True)
class Profile:
    """Where one engine build rounds, one rule per region.

    Fields:
        name: short name (``vllm``); custom profiles may use any name.
        rms_norm: decoder norms and the final norm (``RMSNormRule``).
        qk_norm: Qwen3 / Qwen3-MoE per-head q_norm and k_norm (``QKNormRule``).
        residual: every residual add, including the one before the final norm (``ResidualRule``).
        rope: ``RopeRule`` or ``HeadDimRope`` (``"bf16/once"`` strings are accepted).
        swiglu: dense MLPs (``SwiGLURule``).
        expert_swiglu: MoE experts; engines often run a different kernel there (vLLM's fused MoE always
            calls its CUDA ``silu_and_mul``).
        engines: the engine builds and flags the profile describes.
        source: where each rule was read.
        rope_angles: ``fp32`` (default: inv_freq from the config in fp32, as engines compute it) or ``module``
            (the rotary module's own buffer, as stock HF reads it).
        attention: the attention kernel (``AttentionKernel``; default ``hf``, the model's own).
        gemm: the linear layers' GEMM kernel (``GemmKernel``; default ``torch``).
        forward: whose forward code computes the element-wise regions (``ForwardKernel``; default ``hf``).
        quantization: what the engine serves (``roundalign.quant.Scheme``, by name: ``w8a8-int8``, ``w4a16``, ...;
            default ``none``, the bf16 copy). Every linear but the lm_head is then computed quantized, at the level
            the GEMM kernel says: ``torch`` quantization-aligned, ``vllm-cpu`` exact (``roundalign.kernels``).

    Names are labels: what a profile does is its ``rules()``, and everything that branches on a profile reads
    them (``apply`` leaves a model untouched when they are stock HF's, whatever the profile is called).
    """

    name: str
    rms_norm: RMSNormRule
    qk_norm: QKNormRule
    residual: ResidualRule
    rope: RopeRule | HeadDimRope
    swiglu: SwiGLURule
    expert_swiglu: SwiGLURule
    engines: str = ""
    source: str = field(default="", compare=False)
    rope_angles: RopeAngles = RopeAngles.FP32
    attention: AttentionKernel = AttentionKernel.HF
    gemm: GemmKernel = GemmKernel.TORCH
    forward: ForwardKernel = ForwardKernel.HF
    quantization: Scheme = NONE

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "rms_norm", RMSNormRule.parse(self.rms_norm, "rms_norm"))
        set_(self, "qk_norm", QKNormRule.parse(self.qk_norm, "qk_norm"))
        set_(self, "residual", ResidualRule.parse(self.residual, "residual"))
        if isinstance(self.rope, dict):
            set_(self, "rope", HeadDimRope(**self.rope))
        elif not isinstance(self.rope, HeadDimRope):
            set_(self, "rope", RopeRule.parse(self.rope))
        set_(self, "swiglu", SwiGLURule.parse(self.swiglu, "swiglu"))
        set_(self, "expert_swiglu", SwiGLURule.parse(self.expert_swiglu, "expert_swiglu"))
        set_(self, "rope_angles", RopeAngles.parse(self.rope_angles, "rope_angles"))
        set_(self, "attention", AttentionKernel.parse(self.attention, "attention kernel"))
        set_(self, "gemm", GemmKernel.parse(self.gemm, "gemm kernel"))
        set_(self, "forward", ForwardKernel.parse(self.forward, "forward kernel"))
        set_(self, "quantization", Scheme.parse(self.quantization))

    def rules(self) -> tuple:
        """What decides this profile's numerics (``RULES``), without its name, engines or source."""
        return tuple(getattr(self, k) for k in RULES)

    def same_rules(self, other: str | Profile) -> bool:
        """Whether ``other`` (a profile or a profile name) computes what this one does."""
        return self.rules() == _BUILTINS.get(other).rules()

    @property
    def is_stock_hf(self) -> bool:
        """True when this profile's rules are stock HF's: ``apply`` then leaves every module as it is."""
        return self.same_rules(_BUILTINS.table["hf"])

    @property
    def uses_engine_kernels(self) -> bool:
        """True when the trainer runs an engine's attention or GEMM kernels instead of HF's."""
        return (self.attention, self.gemm, self.forward) != (AttentionKernel.HF, GemmKernel.TORCH, ForwardKernel.HF)

    def rounding_only(self) -> Profile:
        """This profile with HF's kernels: its rounding rules alone, as the reference engine and ``fit`` use them
        (``vllm-0.32-cpu-eager-kernels`` -> ``vllm-0.32-cpu-eager``)."""
        if not self.uses_engine_kernels:
            return self
        stock = dataclasses.replace(self, attention=AttentionKernel.HF, gemm=GemmKernel.TORCH, forward=ForwardKernel.HF)
        # The served quantization stays: it is what the engine computes, not a kernel of the trainer's
        # (``vllm-..-kernels+quantization=w8a8-int8`` -> ``vllm-..+quantization=w8a8-int8``, quantization-aligned).
        name, plus, tag = self.name.partition("+quantization=")
        suffixes = ("-reference-kernels", "-compiled-kernels", "-kernels")
        base_name = next((name.removesuffix(x) for x in suffixes if name.endswith(x)), name)
        base = _BUILTINS.table.get(base_name)
        unquantized = dataclasses.replace(stock, quantization=NONE)
        name = base.name if base is not None and base.rules() == unquantized.rules() else f"{name}-rounding"
        return dataclasses.replace(stock, name=name + plus + tag)

    def rope_for(self, head_dim: int) -> RopeRule:
        """The RoPE rule a model with this head_dim gets."""
        return self.rope.for_head_dim(head_dim) if isinstance(self.rope, HeadDimRope) else self.rope

    def replace(self, **overrides) -> Profile:
        """A copy with some regions or kernels overridden; the name records what changed (``vllm+rope=fp32/once``)."""
        unknown = set(overrides) - set(REGIONS) - set(KERNELS) - {"quantization"}
        if unknown:
            raise TypeError(
                f"unknown region(s) {sorted(unknown)}; the regions are {', '.join(REGIONS)}, the kernels "
                f"{', '.join(KERNELS)}, and quantization"
            )
        new = dataclasses.replace(self, **overrides)  # parses and validates every override
        changed = sorted(k for k in overrides if getattr(new, k) != getattr(self, k))
        if not changed:
            return self  # e.g. apply(model, "vllm", rope="bf16/once") is just "vllm"
        base_name, _, tags = self.name.partition("+")
        base = _BUILTINS.table.get(base_name)
        if base is None:
            tag = "+".join(f"{k}={getattr(new, k)}" for k in changed)
            return dataclasses.replace(new, name=f"{self.name}+{tag}")
        # A built-in with overrides: one tag per field that differs from the built-in, whatever the order of the
        # replacements (vllm+quantization=w8a8-int8 with quantization=none again is vllm).
        pairs = dict(t.partition("=")[::2] for t in tags.split("+") if t)
        pairs.update({k: str(getattr(new, k)) for k in changed})
        pairs = {k: v for k, v in pairs.items() if k not in RULES or str(getattr(base, k)) != v}
        return dataclasses.replace(new, name="+".join([base_name, *(f"{k}={v}" for k, v in pairs.items())]))

    def to_dict(self) -> dict:
        rope = self.rope
        rope_json = (
            {"head_dims": list(rope.head_dims), "rule": str(rope.rule), "other": str(rope.other)}
            if isinstance(rope, HeadDimRope)
            else str(rope)
        )
        out = {k: str(getattr(self, k)) for k in ("name", *RULES, "engines", "source")}
        out["rope"] = rope_json
        return out

    @classmethod
    def from_dict(cls, data: dict) -> Profile:
        missing = [k for k in ("name", *REGIONS) if k not in data]
        if missing:
            raise UserError(f"profile is missing field(s) {missing}; a profile file needs name and {REGIONS}")
        extra = set(data) - {"name", *RULES, "engines", "source"}
        if extra:
            raise UserError(f"profile has unknown field(s) {sorted(extra)}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        durable.write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """A profile file (``save``'s JSON); a ``UserError`` naming the file for anything else."""
        data = read_json_object(path, "a profile file (roundalign profiles --save writes one)")
        try:
            return cls.from_dict(data)
        except UserError as e:
            raise UserError(f"{path}: {e}") from None
        except (TypeError, ValueError) as e:  # a field of the wrong type or value
            raise UserError(f"{path}: not a valid profile ({e})") from None

    def describe(self) -> dict[str, str]:
        """Each region's rule as its formula, for tables and reports (the kernels are ``attention``/``gemm``)."""
        return {region: formula(region, getattr(self, region)) for region in REGIONS}


@dataclass
class _Builtins:
    table: dict = field(default_factory=dict)  # name -> Profile
    get: object = None  # get_profile: a name, a .json path or a Profile -> Profile


_BUILTINS = _Builtins()


def register_builtins(table: dict, get) -> None:
    """Called by ``roundalign.profiles.builtin`` with its table and its ``get_profile`` (module docstring: why)."""
    _BUILTINS.table, _BUILTINS.get = table, get
