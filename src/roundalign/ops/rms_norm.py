"""RMSNorm with the rounding point of a rule, and the residual add that feeds it.

Notation (shared/reference/engine-rounding.md): ``r(t)`` rounds to the model's 16-bit dtype (bf16, or fp16 for an
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
"""

from __future__ import annotations

import torch

from roundalign.ops._custom import compute_dtype, default_out_dtype, define
from roundalign.profiles import QKNormRule, ResidualRule, RMSNormRule


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, rule: str, out_dtype: torch.dtype):
    acc = compute_dtype(x)
    x32 = x.to(acc)
    variance = x32.pow(2).mean(-1, keepdim=True)
    normed = x32 * torch.rsqrt(variance + eps)  # x * nu(x), fp32
    if rule == RMSNormRule.ROUND_BEFORE_WEIGHT:
        return weight * normed.to(out_dtype)  # r(w * r(x * nu(x))): HF's expression, weight on the left
    if rule == RMSNormRule.ROUND_AFTER_WEIGHT:
        return (normed * weight.to(acc)).to(out_dtype)  # r(x * nu(x) * w)
    if rule == QKNormRule.FUSED_INTO_ROPE:
        return normed * weight.to(acc)  # x * nu(x) * w, left unrounded for RoPE
    raise ValueError(f"unknown rms_norm rule {rule!r}")


def _add_rounded(a: torch.Tensor, h: torch.Tensor):
    return h + a  # R = r(h + a): one bf16 add, as HF's `residual + hidden_states`


def _add_fp32_sum(a: torch.Tensor, h: torch.Tensor, out_dtype: torch.dtype):
    s = h.to(compute_dtype(h)) + a.to(compute_dtype(a))  # S = h + a in fp32, not rounded
    return s.to(out_dtype, copy=True), s  # (R = r(S), S); a copy even when out_dtype is S's (float64 gradcheck)


_rms_norm_op = define("rms_norm", _rms_norm, ["x", "weight"], [("float", "eps"), ("str", "rule"),
                                                                 ("ScalarType", "out_dtype")], 1, [0, 1])
# The adds are linear: their backward reads no input values, so a and h are not saved.
_add_rounded_op = define("add_rounded", _add_rounded, ["a", "h"], [], 1, [0, 1], needed=[])
_add_fp32_sum_op = define("add_fp32_sum", _add_fp32_sum, ["a", "h"], [("ScalarType", "out_dtype")], 2, [0, 1],
                          needed=[])


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    rule: RMSNormRule | QKNormRule | str,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dim under ``rule``.

    ``out_dtype`` is the dtype ``r(.)`` rounds to; by default the weight's dtype (the model dtype), or ``x``'s
    when the weight is fp32 (``default_out_dtype``). The ``fused_into_rope`` rule returns fp32 for the RoPE op to
    round.
    """
    rule = str(rule)
    if rule not in {r.value for r in QKNormRule}:  # RMSNormRule's rules plus fused_into_rope
        raise ValueError(f"unknown rms_norm rule {rule!r}; choose round_before_weight, round_after_weight "
                         "or fused_into_rope (q/k norm only)")
    return _rms_norm_op(x, weight, float(eps), rule, out_dtype or default_out_dtype(weight, x))


def residual_add(
    a: torch.Tensor, h: torch.Tensor, rule: ResidualRule | str
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
    return _add_fp32_sum_op(a, h, default_out_dtype(h, a))


def add_rms_norm(
    a: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    norm_rule: RMSNormRule | str,
    residual_rule: ResidualRule | str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm, as engines run it: returns ``(norm output, R)``."""
    residual, x = residual_add(a, h, residual_rule)
    return rms_norm(x, weight, eps, norm_rule, out_dtype=residual.dtype), residual
