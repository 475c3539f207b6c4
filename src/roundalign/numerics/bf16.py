"""bf16 bit patterns on a number line: how many representable values apart two bf16 numbers are.

Used wherever agreement is measured in bits rather than in values: the fingerprint reader's ordering of results
around a rounding tie (``bf16_ulp_distance``), and the probe's per-layer agreement of hidden states
(``bf16_ulps_of_larger``: a distance that does not count across zero).
"""

from __future__ import annotations

import torch
from torch import Tensor


def bf16_order_key(x: Tensor) -> Tensor:
    """Map bf16 bit patterns onto a monotone integer line: adjacent bf16 values differ by 1, +0 and -0 are 0."""
    bits = x.view(torch.int16).to(torch.int32)  # sign-extended: negative patterns are the negative floats
    magnitude = bits & 0x7FFF
    return torch.where(bits < 0, -magnitude, magnitude)


def _check_pair(a: Tensor, b: Tensor, what: str) -> None:
    """Two bf16 tensors of one shape, without NaN (which has no place on the line), or an error saying which."""
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        raise TypeError(f"{what} compares bf16 tensors, got {a.dtype} and {b.dtype}")
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    for name, x in (("a", a), ("b", b)):
        if torch.isnan(x).any():
            raise ValueError(f"{name} holds NaN, which has no ulp distance; find where the NaN comes from first")


def bf16_ulp_distance(a: Tensor, b: Tensor) -> Tensor:
    """Elementwise distance between two bf16 tensors in bf16 units in the last place (int64).

    0 means equal values (+0 and -0 are equal), 1 means adjacent bf16 numbers; crossing zero counts every
    representable number in between (the smallest positive and negative subnormals are 2 apart). Infinities sit
    one step past the largest finite value. NaN has no place on the line and is an error.
    """
    _check_pair(a, b, "bf16_ulp_distance")
    return (bf16_order_key(a) - bf16_order_key(b)).abs().to(torch.int64)


# bf16 keeps 7 explicit significand bits: a number in [2^e, 2^(e+1)) has an ulp of 2^(e-7); below the smallest
# normal (2^-126) the ulp is the subnormals' fixed 2^-133.
_MANTISSA_BITS = 7
_MIN_ULP_EXPONENT = -133


def bf16_ulps_of_larger(a: Tensor, b: Tensor) -> Tensor:
    """Elementwise ``|a - b|`` in units in the last place of the larger magnitude of the two (float64).

    Equal values give 0; adjacent bf16 numbers in one binade give 1 (0.5 across a binade boundary, in the upper
    binade's ulps). Unlike ``bf16_ulp_distance`` it does not count across zero: ``1e-5`` against ``-1e-5`` is 256
    ulps of ``1e-5`` (their difference is twice the value), not the ~30,000 representable numbers between them.
    An infinity against anything else is ``inf``; NaN is an error.
    """
    _check_pair(a, b, "bf16_ulps_of_larger")
    a64, b64 = a.double(), b.double()
    larger = torch.maximum(a64.abs(), b64.abs())
    _, exponent = torch.frexp(larger)  # larger = m * 2^exponent, m in [0.5, 1): its binade starts at 2^(exponent-1)
    ulp = torch.exp2((exponent - 1 - _MANTISSA_BITS).clamp(min=_MIN_ULP_EXPONENT).double())
    diff = (a64 - b64).abs()
    out = diff / ulp
    return torch.where(a64 == b64, torch.zeros_like(out), torch.where(torch.isinf(larger), torch.inf, out))
