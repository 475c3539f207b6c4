"""The element-wise formulas of every rounding rule, as plain torch code: each ``.to(out_dtype)`` is a rounding
point ``r(.)``, each ``truncate(., out_dtype)`` a truncating one ``t(.)``, everything between two of them is fp32
(float64 under gradcheck).

One definition serves two users that must agree bit for bit: the trainer's aligned ops (``roundalign.ops``, which
wrap these in custom ops with a backward) and the reference engine's ``kernels`` backend (``roundalign.engine``).
The rules and their formulas are documented in ``roundalign.ops`` and docs/engine-rounding.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from roundalign.numerics.dtypes import compute_dtype
from roundalign.profiles import QKNormRule, RMSNormRule, RopeRounding, SwiGLURule


def rstd_aten(x32: torch.Tensor, eps: float) -> torch.Tensor:
    """nu(x) = rsqrt(mean(x^2) + eps) in fp32, with ATen's reduction order."""
    return torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x, weight, eps: float, rule: str, out_dtype: torch.dtype, rstd=None):
    """RMSNorm by ``rule`` (an ``RMSNormRule`` or ``QKNormRule`` value); ``rstd(x32, eps)`` computes nu(x), ATen's
    order by default."""
    rstd = rstd or rstd_aten
    acc = compute_dtype(x)
    x32 = x.to(acc)
    normed = x32 * rstd(x32, eps)  # x * nu(x), fp32
    if rule == RMSNormRule.ROUND_BEFORE_WEIGHT:
        return weight * normed.to(out_dtype)  # r(w * r(x * nu(x))): HF's expression, weight on the left
    if rule == RMSNormRule.ROUND_AFTER_WEIGHT:
        return (normed * weight.to(acc)).to(out_dtype)  # r(x * nu(x) * w)
    if rule == QKNormRule.FUSED_INTO_ROPE:
        return normed * weight.to(acc)  # x * nu(x) * w, left unrounded for RoPE
    raise ValueError(f"unknown rms_norm rule {rule!r}")


def add_rounded(a: torch.Tensor, h: torch.Tensor):
    return h + a  # R = r(h + a): one bf16 add, as HF's `residual + hidden_states`


def add_fp32_sum(a: torch.Tensor, h: torch.Tensor, out_dtype: torch.dtype):
    s = h.to(compute_dtype(h)) + a.to(compute_dtype(a))  # S = h + a in fp32, not rounded
    return s.to(out_dtype, copy=True), s  # (R = r(S), S); a copy even when out_dtype is S's (float64 gradcheck)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)``; negation is exact, so this never rounds."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def truncate(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t(x)``: ``x`` converted to ``dtype`` rounding toward zero, as vLLM's CPU C++ kernels convert fp32 to bf16 on
    CPUs without AVX512-BF16 (they keep the top 16 bits of the fp32 pattern).

    fp32 to bf16 clears the low 16 bits of the fp32 pattern, which leaves a bf16 value exactly (one integer ``and``
    and an exact cast). Any other pair rounds to nearest, then steps one unit back toward zero wherever that
    overshot: in the sign-magnitude bit pattern of a 16-bit float, the next value toward zero is the pattern minus
    1, whatever the sign. A value beyond the largest finite one becomes the largest finite one, NaN stays NaN. Into
    a dtype as wide as ``x``'s nothing rounds.
    """
    if x.dtype == torch.float32 and dtype == torch.bfloat16:
        return (x.view(torch.int32) & -65536).view(torch.float32).to(dtype)
    y = x.to(dtype)
    if dtype.itemsize >= x.dtype.itemsize:
        return y
    overshot = y.to(x.dtype).abs() > x.abs()
    return torch.where(overshot, (y.view(torch.int16) - 1).view(dtype), y)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rounding: str, out_dtype: torch.dtype):
    if rounding == RopeRounding.PER_OP:
        # HF's `(q * cos) + (rotate_half(q) * sin)`: each product rounds, then the sum does. With bf16 x and
        # cos the casts are no-ops and this is HF's expression exactly; with fp32 operands they round.
        return (x * cos).to(out_dtype) + (rotate_half(x) * sin).to(out_dtype)
    if rounding in (RopeRounding.ONCE, RopeRounding.TRUNCATE):
        acc = compute_dtype(x)
        x32 = x.to(acc)
        rotated = x32 * cos.to(acc) + rotate_half(x32) * sin.to(acc)  # x1*c - x2*s, fp32
        if rounding == RopeRounding.ONCE:
            return rotated.to(out_dtype)  # r(x1*c - x2*s)
        return truncate(rotated, out_dtype)  # t(x1*c - x2*s)
    raise ValueError(f"unknown rope rounding {rounding!r}")


def swiglu(gate: torch.Tensor, up: torch.Tensor, rule: str):
    if rule == SwiGLURule.ROUND_SILU:
        return F.silu(gate) * up  # HF's `act_fn(gate) * up`: silu rounds to gate's dtype, then the product does
    if rule == SwiGLURule.ONCE:
        acc = compute_dtype(gate)
        return (F.silu(gate.to(acc)) * up.to(acc)).to(gate.dtype)  # r(silu(g) * u)
    raise ValueError(f"unknown swiglu rule {rule!r}")
