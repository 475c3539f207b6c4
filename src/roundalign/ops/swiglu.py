"""SwiGLU, ``silu(g) * u``, with the rounding point of a rule.

``silu(g) = g * sigmoid(g)`` computed in fp32 (``torch.nn.functional.silu``); ``r(.)`` rounds to the gate's dtype
(bf16, or fp16 in an fp16 model):

- ``round_silu`` (HF, vLLM CUDA ``silu_and_mul``, Liger):  ``r(r(silu(g)) * u)``  -- two roundings.
- ``once`` (vLLM Inductor, FlashInfer, SGLang JIT, TE):    ``r(silu(g) * u)``     -- one rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from roundalign.numerics.formulas import EAGER
from roundalign.numerics.formulas import swiglu as _swiglu
from roundalign.ops._custom import define_pair
from roundalign.profiles import SwiGLURule


def _swiglu_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, rule: str, num=EAGER):
    """Autograd's backward of ``_swiglu``, op for op (derivatives.yaml: mul, silu, the casts), without the cost of
    replaying the formula under ``torch.func.vjp`` on every call."""
    if rule == SwiGLURule.ROUND_SILU:  # silu(g) * u in the 16-bit dtype
        grad_gate = num.silu_backward(num.ew(torch.mul, grad, up), gate)  # in the 16-bit dtype, as autograd's
        return grad_gate, num.ew(torch.mul, grad, num.ew(F.silu, gate))
    if rule == SwiGLURule.ONCE:  # r(silu_backward(grad32 * u32, g32)) and r(grad32 * silu(g32))
        return num.swiglu_backward(grad, up, gate)
    raise ValueError(f"unknown swiglu rule {rule!r}")


_swiglu_op, _swiglu_compiled_op = define_pair(
    "swiglu", _swiglu, ["gate", "up"], [("str", "rule")], 1, [0, 1], backward=_swiglu_backward, rowwise=True
)


def swiglu(gate: torch.Tensor, up: torch.Tensor, rule: SwiGLURule | str, compiled: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` under ``rule``; the output has ``gate``'s dtype. ``compiled``: the Inductor-fused
    variant, bitwise equal (``roundalign.ops._custom``)."""
    rule = SwiGLURule.parse(rule, "swiglu")
    if gate.shape != up.shape:
        raise ValueError(f"swiglu needs gate and up of one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    return (_swiglu_compiled_op if compiled else _swiglu_op)(gate, up, rule.value)
