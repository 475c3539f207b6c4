"""The rules a profile is made of: a small string enum per region and per kernel, RoPE's rule types, formulas.

Each rounding rule is documented with its formula in the notation of ``docs/engine-rounding.md``: ``r(.)`` rounds
fp32 to bf16 (round-to-nearest-even), ``t(.)`` truncates it (toward zero), everything inside one ``r(...)`` or
``t(...)`` is fp32, ``nu(x) = rsqrt(mean(x^2) + eps)``. ``formula`` writes a rule the same way, for tables and
reports. The kernel enums (``AttentionKernel``, ``GemmKernel``, ``ForwardKernel``) name whose code the trainer runs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

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
# Everything that decides a profile's numerics: the regions' rounding rules, where RoPE's angles come from, the
# kernels and what the engine serves (``quantization``: a ``roundalign.quant`` scheme, none for the bf16 copy). Two
# profiles with the same rules compute the same bits, whatever their names (``Profile.rules``).
RULES = (*REGIONS, "rope_angles", *KERNELS, "quantization")


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
    """A region's rule written as its formula (``Profile.describe``)."""
    if region == "rope":
        if isinstance(rule, HeadDimRope):
            dims = ",".join(map(str, rule.head_dims))
            return f"head_dim in {{{dims}}}: {_rope_formula(rule.rule)}; else {_rope_formula(rule.other)}"
        return _rope_formula(rule)
    return _FORMULAS[(region, str(rule))]
