"""RMSNorm with the rounding point of a rule, and the residual add that feeds it.

Notation (docs/engine-rounding.md s1): ``r(t)`` rounds to the model's 16-bit dtype (bf16, or fp16 for an
fp16 model), ``nu(x) = rsqrt(mean(x^2) + eps)`` in fp32, ``a`` the sublayer output, ``h`` the incoming residual,
``S = a + h`` in fp32, ``R = r(S)``.

Rounding points, per rule:

- ``round_before_weight`` (HF, vLLM CUDA, Liger):  ``r(w * r(x * nu(x)))``  -- two roundings.
- ``round_after_weight`` (FlashInfer, Inductor):   ``r(x * nu(x) * w)``     -- one rounding.
- ``fused_into_rope`` (q/k norm only):              ``x * nu(x) * w`` in fp32 -- no rounding; RoPE rounds.

Residual add:

- ``normalize_rounded_sum`` (HF): the add rounds, ``R = r(a + h)``, and the norm reads ``R``.
- ``normalize_fp32_sum`` (fused add+norm kernels): the norm reads ``S``; ``R = r(S)`` is carried forward.
- ``round_at_attention``, ``never_round`` (compiled engines): the add is the same as ``normalize_fp32_sum``'s;
  they differ only in which of ``R`` and ``S`` the decoder layer carries on (``roundalign.patch._common``).

``x`` may be bf16/fp16 or the fp32 sum ``S``; the variance is always taken in fp32, as every implementation does.

**Where a norm of ``S`` is differentiated.** Its forward reads ``S``, as the engine's fused add + norm does; its
backward is RMSNorm's gradient at ``R = r(S)``, the residual stock HF differentiates at, and returned in fp32 as
``S``'s gradient. The exact gradient of the formula would need ``S`` itself kept for the backward: 4 bytes an element
where stock keeps the 2 of ``R``, one tensor per norm. Both are bf16-accurate gradients; the log-probs, which is
what the engine is compared on, do not depend on the choice.
"""

from __future__ import annotations

import torch

from roundalign.numerics.dtypes import compute_dtype, default_out_dtype
from roundalign.numerics.formulas import EAGER
from roundalign.numerics.formulas import add_fp32_sum as _add_fp32_sum
from roundalign.numerics.formulas import add_rounded as _add_rounded
from roundalign.numerics.formulas import rms_norm as _rms_norm
from roundalign.ops._custom import define, define_pair
from roundalign.profiles import QKNormRule, ResidualRule, RMSNormRule


def _backward(grad, x, weight, eps: float, rule: str, out_dtype: torch.dtype, num=EAGER, grad_dtype=None):
    """Autograd's backward of the RMSNorm formula, written out op for op (PyTorch's derivatives.yaml): the same bits
    without recording and replaying a graph under ``torch.func.vjp`` on every call. ``num``: the rounding primitives
    and reductions (``roundalign.numerics.formulas``), so that compiled forms keep the reductions ATen's.
    ``grad_dtype``: the dtype of ``x``'s gradient, ``x``'s by default (fp32 where ``x`` is ``R`` standing in for
    ``S``)."""
    acc = compute_dtype(x)
    x32 = num.to(x, acc)
    rstd = num.rstd(x32, eps, x)
    normed = x32 * rstd
    rounded_product = rule == RMSNormRule.ROUND_BEFORE_WEIGHT
    if rounded_product:  # weight * r(normed), in the 16-bit dtype
        # MulBackward, then the broadcast's sum
        grad_w = num.sum_to(num.ew(torch.mul, grad, num.to(normed, out_dtype)), weight.shape)
        grad_normed = num.to(num.ew(torch.mul, grad, weight), acc)  # MulBackward, then the cast's backward
    elif rule in (RMSNormRule.ROUND_AFTER_WEIGHT, QKNormRule.FUSED_INTO_ROPE):  # normed * w32 [then r()]
        g32 = num.to(grad, acc)
        grad_w = num.to(num.sum_to(g32 * normed, weight.shape), weight.dtype)
        grad_normed = g32 * num.to(weight, acc)
    else:
        raise ValueError(f"unknown rms_norm rule {rule!r}")
    grad_x32 = grad_normed * rstd  # normed = x32 * rstd
    grad_rstd = num.row_dot(grad_normed, x32, grad, weight, x, rounded_product)  # sum(grad_normed * x32) per row
    grad_var = (-0.5 * grad_rstd) * rstd.pow(3)  # rsqrt: -0.5 * grad * result^3; `+ eps` passes it on
    grad_sq = grad_var.expand(x32.shape) / x32.shape[-1]  # mean: grad.expand(shape) / n
    grad_x32 = grad_x32 + grad_sq * (2.0 * x32.pow(1.0))  # pow(2): grad * (2 * x^1), added to the product's
    return num.to(grad_x32, grad_dtype or x.dtype), grad_w


# The norm of the fp32 sum: inputs (s, r, weight) with r = r(s); the forward reads s, the backward r (see the
# module docstring), so s is not saved. Its gradient comes back in s's dtype (fp32).


def _rms_norm_of_sum(s, r, weight, eps: float, rule: str, out_dtype: torch.dtype, *, num=EAGER):
    return _rms_norm(s, weight, eps, rule, out_dtype, num=num)


def _rms_norm_of_sum_backward(grad, s, r, weight, eps: float, rule: str, out_dtype: torch.dtype, num=EAGER):
    return _backward(grad, r, weight, eps, rule, out_dtype, num, grad_dtype=s.dtype)


def _add_fp32_sum_backward(grad_r, grad_s, a, h, out_dtype, num=EAGER):
    """Autograd's backward of ``_add_fp32_sum``: S's gradient is its own plus R's widened; the add hands it to both
    operands, each cast back to its dtype. (``a`` and ``h`` are shape-only stand-ins: nothing reads their values.)"""
    g = grad_s + num.to(grad_r, grad_s.dtype)
    return num.to(g, a.dtype), num.to(g, h.dtype)


def _add_rounded_backward(grad, a, h, num=EAGER):
    """Autograd's backward of ``h + a``: the gradient as it is, cast to each operand's dtype."""
    return num.to(grad, a.dtype), num.to(grad, h.dtype)


_RMS_CONSTS = [("float", "eps"), ("str", "rule"), ("ScalarType", "out_dtype")]
# The fused variants: Inductor fuses the elementwise work of the forward and of the written-out backward; the
# variance and the backward's two sums run as opaque ATen ops inside, in ATen's order.
_rms_norm_op, _rms_norm_compiled_op = define_pair(
    "rms_norm", _rms_norm, ["x", "weight"], _RMS_CONSTS, 1, [0, 1], backward=_backward, rowwise=True
)
_rms_norm_of_sum_op, _rms_norm_of_sum_compiled_op = define_pair(
    "rms_norm_of_sum",
    _rms_norm_of_sum,
    ["s", "r", "weight"],
    _RMS_CONSTS,
    1,
    [0, 2],
    needed=[1, 2],
    backward=_rms_norm_of_sum_backward,
    rowwise=True,
)
# The adds are linear: their backward reads no input values, so a and h are not saved.
_add_rounded_op = define(
    "add_rounded", _add_rounded, ["a", "h"], [], 1, [0, 1], needed=[], backward=_add_rounded_backward
)
_add_fp32_sum_op, _add_fp32_sum_compiled_op = define_pair(
    "add_fp32_sum",
    _add_fp32_sum,
    ["a", "h"],
    [("ScalarType", "out_dtype")],
    2,
    [0, 1],
    needed=[],
    backward=_add_fp32_sum_backward,
    rowwise=True,
)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    rule: RMSNormRule | QKNormRule | str,
    out_dtype: torch.dtype | None = None,
    compiled: bool = False,
    rounded: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dim under ``rule``. ``compiled``: the Inductor-fused variant, bitwise equal.

    ``out_dtype`` is the dtype ``r(.)`` rounds to; by default the weight's dtype (the model dtype), or ``x``'s
    when the weight is fp32 (``default_out_dtype``). The ``fused_into_rope`` rule returns fp32 for the RoPE op to
    round. ``rounded``: where ``x`` is the fp32 sum ``S`` of a residual add, its rounded residual ``R = r(S)``; the
    output is the same, and the backward differentiates at ``R`` instead of keeping ``S`` (the module docstring).
    """
    rule = str(rule)
    if rule not in {r.value for r in QKNormRule}:  # RMSNormRule's rules plus fused_into_rope
        raise ValueError(
            f"unknown rms_norm rule {rule!r}; choose round_before_weight, round_after_weight "
            "or fused_into_rope (q/k norm only)"
        )
    out_dtype = out_dtype or default_out_dtype(weight, x)
    if rounded is None or rounded is x:
        op = _rms_norm_compiled_op if compiled else _rms_norm_op
        return op(x, weight, float(eps), rule, out_dtype)
    if rounded.shape != x.shape:
        raise ValueError(
            f"rms_norm: rounded has shape {tuple(rounded.shape)} but x has {tuple(x.shape)}; pass the residual "
            "R = r(S) that the same residual add returned with S"
        )
    op = _rms_norm_of_sum_compiled_op if compiled else _rms_norm_of_sum_op
    return op(x, rounded, weight, float(eps), rule, out_dtype)


def residual_add(
    a: torch.Tensor, h: torch.Tensor, rule: ResidualRule | str, compiled: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add ``h + a`` under ``rule``: returns ``(R, x_for_norm)``.

    ``R`` is the 16-bit residual; ``x_for_norm`` is what the next norm reads: ``R`` itself under
    ``normalize_rounded_sum``, the fp32 sum ``S`` under every other rule. ``h`` may be an fp32 residual that a
    compiled engine carried without rounding (``round_at_attention``, ``never_round``); ``R`` then rounds to the
    sublayer output ``a``'s dtype, the model's (bf16, or fp16 in an fp16 model).
    """
    rule = ResidualRule.parse(rule, "residual")
    if rule is ResidualRule.NORMALIZE_ROUNDED_SUM:
        r = _add_rounded_op(a, h)
        return r, r
    op = _add_fp32_sum_compiled_op if compiled else _add_fp32_sum_op
    return op(a, h, default_out_dtype(h, a))


def add_rms_norm(
    a: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    norm_rule: RMSNormRule | str,
    residual_rule: ResidualRule | str,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm, as engines run it: returns ``(norm output, R)``."""
    residual, x = residual_add(a, h, residual_rule, compiled)
    return rms_norm(x, weight, eps, norm_rule, residual.dtype, compiled, rounded=residual), residual
