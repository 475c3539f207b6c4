"""bf16 bit patterns on a number line: how many representable values apart two bf16 numbers are.

Used wherever agreement is measured in bits rather than in values: the probe's per-layer agreement of hidden
states, and the fingerprint reader's ordering of results around a rounding tie.
"""

from __future__ import annotations

import torch
from torch import Tensor


def bf16_order_key(x: Tensor) -> Tensor:
    """Map bf16 bit patterns onto a monotone integer line: adjacent bf16 values differ by 1, +0 and -0 are 0."""
    bits = x.view(torch.int16).to(torch.int32)  # sign-extended: negative patterns are the negative floats
    magnitude = bits & 0x7FFF
    return torch.where(bits < 0, -magnitude, magnitude)


def bf16_ulp_distance(a: Tensor, b: Tensor) -> Tensor:
    """Elementwise distance between two bf16 tensors in bf16 units in the last place (int64).

    0 means equal values (+0 and -0 are equal), 1 means adjacent bf16 numbers; crossing zero counts every
    representable number in between (the smallest positive and negative subnormals are 2 apart). Infinities sit
    one step past the largest finite value. NaN has no place on the line and is an error.
    """
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        raise TypeError(f"bf16_ulp_distance compares bf16 tensors, got {a.dtype} and {b.dtype}")
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    for name, x in (("a", a), ("b", b)):
        if torch.isnan(x).any():
            raise ValueError(f"{name} holds NaN, which has no ulp distance; find where the NaN comes from first")
    return (bf16_order_key(a) - bf16_order_key(b)).abs().to(torch.int64)
