"""The element-wise formulas of every rounding rule, as plain torch code: each ``num.to(., out_dtype)`` is a
rounding point ``r(.)``, each ``truncate(., out_dtype)`` a truncating one ``t(.)``, each ``num.ew(op, ...)`` on 16-bit
operands one 16-bit op (fp32 arithmetic, one rounding); everything else is fp32 (float64 under gradcheck).

One definition serves two users that must agree bit for bit: the trainer's aligned ops (``roundalign.ops``, which
wrap these in custom ops with a backward) and the reference engine's ``kernels`` backend (``roundalign.engine``).
The rules and their formulas are documented in ``roundalign.ops`` and docs/engine-rounding.md.

Every cast and every 16-bit element-wise op goes through ``num``, the rounding primitives: ``EAGER`` (the default)
is plain torch, exactly the expression written beside it; ``roundalign.ops._traced.TRACED`` is the same
arithmetic in a form that Inductor keeps inside a compiled model. So the formulas are written once for both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from roundalign.numerics.dtypes import compute_dtype
from roundalign.profiles import QKNormRule, RMSNormRule, RopeRounding, SwiGLURule


class Eager:
    """The rounding primitives as plain torch: ``to`` casts (``r(.)`` when it narrows to a 16-bit dtype), ``ew``
    runs an element-wise op in its operands' dtype (a 16-bit op computes in fp32 and rounds, as eager does),
    ``sum_to`` sums a broadcast gradient back to a shape, ``silu_backward`` is ATen's. The reductions and SiLU's
    backward are primitives too (``rstd``, ``row_dot``, ``silu_backward_of_product``), so that a compiled model can
    run them as opaque calls in ATen's order (``roundalign.ops._traced``); they are handed the 16-bit tensors their
    fp32 operands widen, for the forms that read those instead."""

    @staticmethod
    def to(t: torch.Tensor, dtype: torch.dtype, copy: bool = False) -> torch.Tensor:
        return t.to(dtype, copy=copy)

    @staticmethod
    def ew(fn, *tensors: torch.Tensor) -> torch.Tensor:
        return fn(*tensors)

    @staticmethod
    def sum_to(t: torch.Tensor, shape) -> torch.Tensor:
        return t.sum_to_size(shape)

    @staticmethod
    def silu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.silu_backward(grad, x)

    @staticmethod
    def rstd(x32: torch.Tensor, eps: float, x: torch.Tensor) -> torch.Tensor:
        """nu(x) from ``x32``, the fp32 widening of ``x``."""
        return rstd_aten(x32, eps)

    def row_dot(self, grad_normed, x32, grad, weight, x, rounded_product: bool) -> torch.Tensor:
        """RMSNorm backward's per-row ``sum(grad_normed * x32)``, where ``grad_normed`` is ``r(grad * weight)``
        widened (``rounded_product``) or ``grad32 * weight32``, and ``x32`` the widening of ``x``."""
        return self.sum_to(grad_normed * x32, (*x32.shape[:-1], 1))

    def silu_backward_of_product(self, grad: torch.Tensor, up: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``r(silu_backward(grad32 * up32, gate32))`` in the gate's dtype: the gate's gradient of SwiGLU ``once``."""
        acc = compute_dtype(gate)
        widened = self.to(grad, acc) * self.to(up, acc)
        return self.to(self.silu_backward(widened, self.to(gate, acc)), gate.dtype)

    def swiglu_backward(self, grad: torch.Tensor, up: torch.Tensor, gate: torch.Tensor):
        """SwiGLU ``once``'s two gradients: the gate's (``silu_backward_of_product``) and the up's,
        ``r(grad32 * silu(gate32))``."""
        acc = compute_dtype(gate)
        grad_gate = self.silu_backward_of_product(grad, up, gate)
        return grad_gate, self.to(self.to(grad, acc) * F.silu(self.to(gate, acc)), up.dtype)


EAGER = Eager()


def rstd_aten(x32: torch.Tensor, eps: float) -> torch.Tensor:
    """nu(x) = rsqrt(mean(x^2) + eps) in fp32, with ATen's reduction order."""
    return torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x, weight, eps: float, rule: str, out_dtype: torch.dtype, *, num=EAGER):
    """RMSNorm by ``rule`` (an ``RMSNormRule`` or ``QKNormRule`` value); nu(x) in ATen's order (``num.rstd``)."""
    acc = compute_dtype(x)
    x32 = num.to(x, acc)
    normed = x32 * num.rstd(x32, eps, x)  # x * nu(x), fp32
    if rule == RMSNormRule.ROUND_BEFORE_WEIGHT:
        # r(w * r(x * nu(x))): HF's `weight * normed.to(out_dtype)`, weight on the left
        return num.ew(torch.mul, weight, num.to(normed, out_dtype))
    if rule == RMSNormRule.ROUND_AFTER_WEIGHT:
        return num.to(normed * num.to(weight, acc), out_dtype)  # r(x * nu(x) * w)
    if rule == QKNormRule.FUSED_INTO_ROPE:
        return normed * num.to(weight, acc)  # x * nu(x) * w, left unrounded for RoPE
    raise ValueError(f"unknown rms_norm rule {rule!r}")


def add_rounded(a: torch.Tensor, h: torch.Tensor, *, num=EAGER):
    return num.ew(torch.add, h, a)  # R = r(h + a): one bf16 add, as HF's `residual + hidden_states`


def add_fp32_sum(a: torch.Tensor, h: torch.Tensor, out_dtype: torch.dtype, *, num=EAGER):
    s = num.to(h, compute_dtype(h)) + num.to(a, compute_dtype(a))  # S = h + a in fp32, not rounded
    return num.to(s, out_dtype, copy=True), s  # (R = r(S), S); a copy even when out_dtype is S's (float64 gradcheck)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)``; negation is exact, so this never rounds."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def truncate(x: torch.Tensor, dtype: torch.dtype, *, num=EAGER) -> torch.Tensor:
    """``t(x)``: ``x`` converted to ``dtype`` rounding toward zero, as vLLM's CPU C++ kernels convert fp32 to bf16 on
    CPUs without AVX512-BF16 (they keep the top 16 bits of the fp32 pattern).

    fp32 to bf16 clears the low 16 bits of the fp32 pattern, which leaves a bf16 value exactly (one integer ``and``
    and an exact cast). Any other pair rounds to nearest, then steps one unit back toward zero wherever that
    overshot: in the sign-magnitude bit pattern of a 16-bit float, the next value toward zero is the pattern minus
    1, whatever the sign. A value beyond the largest finite one becomes the largest finite one, NaN stays NaN. Into
    a dtype as wide as ``x``'s nothing rounds.
    """
    if x.dtype == torch.float32 and dtype == torch.bfloat16:
        return num.to((x.view(torch.int32) & -65536).view(torch.float32), dtype)
    y = num.to(x, dtype)
    if dtype.itemsize >= x.dtype.itemsize:
        return y
    overshot = num.to(y, x.dtype).abs() > x.abs()
    return torch.where(overshot, (y.view(torch.int16) - 1).view(dtype), y)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rounding: str, out_dtype: torch.dtype, *, num=EAGER):
    if rounding == RopeRounding.PER_OP:
        # HF's `(q * cos) + (rotate_half(q) * sin)`: each product rounds, then the sum does. With bf16 x and
        # cos the casts are no-ops and this is HF's expression exactly; with fp32 operands they round.
        via_cos = num.to(num.ew(torch.mul, x, cos), out_dtype)
        return num.ew(torch.add, via_cos, num.to(num.ew(torch.mul, rotate_half(x), sin), out_dtype))
    if rounding in (RopeRounding.ONCE, RopeRounding.TRUNCATE):
        acc = compute_dtype(x)
        x32 = num.to(x, acc)
        rotated = x32 * num.to(cos, acc) + rotate_half(x32) * num.to(sin, acc)  # x1*c - x2*s, fp32
        if rounding == RopeRounding.ONCE:
            return num.to(rotated, out_dtype)  # r(x1*c - x2*s)
        return truncate(rotated, out_dtype, num=num)  # t(x1*c - x2*s)
    raise ValueError(f"unknown rope rounding {rounding!r}")


def swiglu(gate: torch.Tensor, up: torch.Tensor, rule: str, *, num=EAGER):
    if rule == SwiGLURule.ROUND_SILU:
        # HF's `act_fn(gate) * up`: silu rounds to gate's dtype, then the product does
        return num.ew(torch.mul, num.ew(F.silu, gate), up)
    if rule == SwiGLURule.ONCE:
        acc = compute_dtype(gate)
        return num.to(F.silu(num.to(gate, acc)) * num.to(up, acc), gate.dtype)  # r(silu(g) * u)
    raise ValueError(f"unknown swiglu rule {rule!r}")
