"""Rotary position embedding (NeoX / rotate-half layout) with the rounding point of a rule.

For the first half of a head, ``o1 = x1*c - x2*s`` (the second half, ``o2 = x2*c + x1*s``, is symmetric):

- ``per_op`` (HF, vLLM <= 0.17 CUDA, Liger):  ``r(r(x1*c) - r(x2*s))``  -- three roundings.
- ``once`` (vLLM Inductor and >= 0.23 CUDA, FlashInfer, TE):  ``r(x1*c - x2*s)``  -- one rounding.
- ``truncate`` (vLLM's CPU ``rotary_embedding`` on CPUs without AVX512-BF16):  ``t(x1*c - x2*s)``  -- one
  conversion, toward zero. Its backward is ``once``'s: truncation, like rounding, is straight-through.

``c``/``s`` come in the profile's dtype: ``c16 = r(cos(theta))`` (the model's 16-bit dtype, bf16 or fp16) or
``c32 = cos(theta)``; see ``roundalign.rotary`` for how theta is computed. ``x`` is bf16/fp16, or the fp32 output of
a q/k norm whose rule is ``fused_into_rope``.
"""

from __future__ import annotations

import torch

from roundalign.numerics.dtypes import compute_dtype, default_out_dtype
from roundalign.numerics.formulas import EAGER
from roundalign.numerics.formulas import rope as _rope
from roundalign.ops._custom import define_pair
from roundalign.profiles import RopeRounding


def _rotate_half_backward(g: torch.Tensor) -> torch.Tensor:
    """The gradient through ``rotate_half``: ``(g1, g2) -> (g2, -g1)``, exact."""
    g1, g2 = g.chunk(2, dim=-1)
    return torch.cat((g2, -g1), dim=-1)


def _rope_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rounding: str,
    out_dtype: torch.dtype,
    num=EAGER,
) -> torch.Tensor:
    """Autograd's backward of ``_rope`` with respect to ``x``, op for op, without replaying it under
    ``torch.func.vjp``. ``x`` is a shape-and-dtype stand-in (RoPE is linear in it: its values are not saved)."""
    shape = x.shape  # a product's gradient is summed back to x's shape where cos/sin broadcast x
    if rounding == RopeRounding.PER_OP:
        # Each product's gradient comes back in the product's dtype and is cast to x's before the two are added,
        # in x's dtype, as autograd accumulates them.
        g_cos = num.to(grad, torch.promote_types(x.dtype, cos.dtype))
        g_sin = num.to(grad, torch.promote_types(x.dtype, sin.dtype))
        via_cos = num.to(num.sum_to(num.ew(torch.mul, g_cos, cos), shape), x.dtype)
        via_sin = num.to(num.sum_to(num.ew(torch.mul, g_sin, sin), shape), x.dtype)
        return num.ew(torch.add, via_cos, _rotate_half_backward(via_sin))
    if rounding in (RopeRounding.ONCE, RopeRounding.TRUNCATE):
        acc = compute_dtype(x)
        g = num.to(grad, acc)
        via_cos = num.sum_to(g * num.to(cos, acc), shape)
        return num.to(via_cos + _rotate_half_backward(num.sum_to(g * num.to(sin, acc), shape)), x.dtype)
    raise ValueError(f"unknown rope rounding {rounding!r}")


# RoPE is linear in x: the backward needs cos and sin only, so x is not saved.
_ROPE_CONSTS = [("str", "rounding"), ("ScalarType", "out_dtype")]
_rope_op, _rope_compiled_op = define_pair(
    "rope", _rope, ["x", "cos", "sin"], _ROPE_CONSTS, 1, [0], needed=[1, 2], backward=_rope_backward
)


def rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rounding: RopeRounding | str,
    out_dtype: torch.dtype | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """Rotate ``x`` (..., head_dim) by ``cos``/``sin`` broadcastable to it, rounding per ``rounding``.

    ``compiled``: the Inductor-fused variant, bitwise equal (``roundalign.ops._custom``). ``out_dtype`` defaults to
    ``x``'s dtype; when ``x`` is an fp32 norm output, to the 16-bit dtype of a c16
    ``cos``/``sin`` (the model's), else bf16 (``default_out_dtype``). Callers that know the model dtype pass it.
    """
    rounding = RopeRounding.parse(rounding, "rope rounding")
    if x.shape[-1] % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {x.shape[-1]}")
    op = _rope_compiled_op if compiled else _rope_op
    return op(x, cos, sin, rounding.value, out_dtype or default_out_dtype(x, cos, sin))
