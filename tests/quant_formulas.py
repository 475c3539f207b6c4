"""Reference quantizers written from the formats' definitions, one value at a time, for tests/test_quant.py.

Nothing here calls roundalign. Each function restates a definition in the plainest terms, scalar by scalar, so that
the vectorized code under test is compared with its specification, not with itself:

- compressed-tensors' round-to-nearest (``calculate_qparams`` and ``_quantize`` in compressed_tensors/quantization;
  the GPTQ/AWQ asymmetric convention for zero points): every intermediate in the weight's dtype (bf16), that is,
  each operation computed exactly and rounded to bf16 (``r`` below);
- the ``pack-quantized`` format: unsigned 4-bit values (signed + 8), eight per 32-bit word, the first value in the
  lowest bits;
- vLLM's online per-channel FP8 (``fp8_per_channel``): fp32 scale and fp32 true division;
- OCP FP8 E4M3 (``torch.float8_e4m3fn``): the nearest representable value, ties to even, saturating at 448;
- vLLM's dynamic per-token activation quantizers, as measured against its CPU ops: int8 ``round(x * (1/s))`` with
  ``s = amax/127``, FP8 ``e4m3(x * (1/s))`` with ``s = max(amax/448, 1/(448*512))``, in fp32.
"""

from __future__ import annotations

import math
import struct


def f32(v: float) -> float:
    """``v`` rounded to fp32 (nearest, ties to even), via its IEEE bytes."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def r(v: float) -> float:
    """An fp32 value rounded to bf16: keep the top 16 bits of its pattern, rounding to nearest, ties to even."""
    bits = struct.unpack("<I", struct.pack("<f", f32(v)))[0]
    if (bits & 0x7F800000) == 0x7F800000:
        return f32(v)
    low = bits & 0xFFFF
    top = bits >> 16
    if low > 0x8000 or (low == 0x8000 and top & 1):
        top += 1
    return struct.unpack("<f", struct.pack("<I", (top << 16) & 0xFFFFFFFF))[0]


def round_half_even(v: float) -> int:
    return int(round(v))  # Python's round() is half to even


def int_qparams(values: list[float], bits: int, symmetric: bool) -> tuple[float, int]:
    """compressed-tensors' scale and zero point for one group of bf16 ``values``."""
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    mn, mx = min(min(values), 0.0), max(max(values), 0.0)
    if symmetric:
        scale = r(max(abs(mn), mx) / ((hi - lo) / 2))
        zero = 0
    else:
        scale = r(r(mx - mn) / (hi - lo))
    if scale == 0:
        scale = 2.0**-7  # bf16's epsilon
    if not symmetric:
        zero = round_half_even(min(max(r(lo - r(mn / scale)), lo), hi))
    return scale, zero


def int_codes(values: list[float], bits: int, symmetric: bool) -> tuple[list[int], float, int]:
    """One group's codes: ``clamp(round(r(r(w / scale) + zp)))``."""
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    scale, zero = int_qparams(values, bits, symmetric)
    codes = [round_half_even(min(max(r(r(w / scale) + zero), lo), hi)) for w in values]
    return codes, scale, zero


def e4m3(v: float) -> float:
    """The E4M3 (``fn``: no infinities, max 448) value nearest ``v``, ties to even, saturating at 448."""
    if math.isnan(v):
        return v
    a = min(abs(v), 448.0)
    if a == 0:
        return math.copysign(0.0, v)
    exp = max(math.floor(math.log2(a)), -6)  # subnormals below 2^-6 share its spacing
    step = 2.0 ** (exp - 3)  # three mantissa bits
    q = a / step
    n = math.floor(q)
    frac = q - n
    if frac > 0.5 or (frac == 0.5 and n % 2 == 1):
        n += 1
    return math.copysign(min(n * step, 448.0), v)


def fp8_codes(values: list[float]) -> tuple[list[float], float]:
    """compressed-tensors' FP8 weight channel: ``scale = r(amax / 448)``, ``code = e4m3(r(w / scale))``."""
    amax = max(max(abs(v) for v in values), 0.0)
    scale = r(amax / 448.0) or 2.0**-7
    return [e4m3(min(max(r(w / scale), -448.0), 448.0)) for w in values], scale


def fp8_online_codes(values: list[float]) -> tuple[list[float], float]:
    """vLLM's own per-channel FP8 quantizer (quantization="fp8_per_channel"): ``scale = max(amax / 448,
    1 / (448 * 512))`` in fp32, ``code = e4m3(clamp(w / scale))`` with the division in fp32."""
    scale = max(f32(max(abs(v) for v in values) / 448.0), f32(1.0 / (448.0 * 512.0)))
    return [e4m3(min(max(f32(w / scale), -448.0), 448.0)) for w in values], scale


def pack_nibbles(values: list[int]) -> list[int]:
    """Signed 4-bit values, eight to a signed 32-bit word, the first in the lowest bits."""
    words = []
    for i in range(0, len(values), 8):
        word = sum((v + 8) << (4 * j) for j, v in enumerate(values[i : i + 8]))
        words.append(word - (1 << 32) if word >= 1 << 31 else word)
    return words


def int8_token(row: list[float]) -> tuple[list[int], float]:
    """vLLM's dynamic per-token int8 quantizer on one row (fp32 arithmetic)."""
    scale = f32(max(abs(v) for v in row) / 127.0)
    inverse = f32(1.0 / scale) if scale else 0.0
    return [min(max(round_half_even(f32(v * inverse)), -128), 127) for v in row], scale


def fp8_token(row: list[float]) -> tuple[list[float], float]:
    """vLLM's dynamic per-token FP8 quantizer on one row (fp32 arithmetic)."""
    scale = max(f32(max(abs(v) for v in row) / 448.0), f32(1.0 / (448.0 * 512.0)))
    inverse = f32(1.0 / scale)
    return [e4m3(min(max(f32(v * inverse), -448.0), 448.0)) for v in row], scale
