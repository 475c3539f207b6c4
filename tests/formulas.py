"""Independent test-only reference for the rounding formulas of docs/engine-rounding.md, sections 1-2.

Written from the fact sheet, not from ``roundalign.ops`` (which these tests never import here), in the plainest form:
every value is upcast to fp32 with ``f(.)`` (exact for bf16), the arithmetic is fp32, and every ``r(.)`` of the
fact sheet is an explicit ``.to(torch.bfloat16)`` (round to nearest, ties to even). Nothing is computed in bf16
arithmetic: where the fact sheet writes a bf16 op, e.g. HF's ``w * r(x*nu)``, the reference writes
``r(f(w) * f(r(x*nu)))``, which is what "per-op equivalence" (fact sheet section 1) says a bf16 op computes.

Notation (fact sheet section 1):

- ``r(t)``: round fp32 to bf16 (RNE).  ``nu(x) = rsqrt(mean_j x_j^2 + eps)`` in fp32.
- residual add: ``a`` sublayer output, ``h`` incoming residual, ``S = a + h`` in fp32, ``R = r(S)``.
- RoPE (NeoX / rotate-half): ``o1 = x1*c - x2*s``, ``o2 = x2*c + x1*s`` on the two halves of a head.
- SwiGLU: ``sigma(g)`` = SiLU of the gate in fp32, times ``u``.

Two fp32 building blocks are taken from torch rather than re-derived, because the fact sheet does not pin them and
the rounding *location* is what is under test: the reduction ``mean(x^2)`` and ``rsqrt`` (HF's own expression,
``x.pow(2).mean(-1, keepdim=True)`` and ``torch.rsqrt``), and ``sigma(g)`` in fp32, for which HF's
``act_fn`` is ``torch.nn.functional.silu``. ``F.silu`` and the literal ``g * sigmoid(g)`` differ by one fp32 ulp
for some inputs; ``tests/test_ops.py::test_silu_formula_choice`` measures that and pins which one the ops use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BF16 = torch.bfloat16
FP32 = torch.float32


def r(t: torch.Tensor, dtype: torch.dtype = BF16) -> torch.Tensor:
    """r(.): round to bf16 (or to ``dtype``), round-to-nearest-even."""
    return t.to(dtype)


def t_(t: torch.Tensor, dtype: torch.dtype = BF16) -> torch.Tensor:
    """t(.): to bf16 (or fp16) by truncation toward zero.

    bf16, as vLLM's CPU vector code converts without AVX512-BF16: keep the top 16 bits of the fp32 bit pattern (an
    arithmetic shift of the int32 view; the low 16 bits of the result are the pattern's high half whatever the
    sign). fp16, by arithmetic in float64: |x| = m * 2^e (frexp, exact), the unit in the last place at that
    exponent is 2^(max(e-1, -14) - 10) (subnormals below 2^-14), whole units are kept, finite values beyond the
    largest fp16 (65504) become it, infinities stay."""
    if dtype == BF16:
        return (t.to(FP32).view(torch.int32) >> 16).to(torch.int16).view(BF16)
    assert dtype == torch.float16, dtype
    a = t.double().abs()
    _, e = torch.frexp(a)
    ulp = torch.pow(2.0, (torch.clamp(e - 1, min=-14) - 10).double())
    kept = torch.where(torch.isinf(a), a, torch.clamp(torch.floor(a / ulp) * ulp, max=65504.0))
    return torch.copysign(kept, t.double()).to(dtype)  # exact: every kept value is an fp16 value


def f(t: torch.Tensor) -> torch.Tensor:
    """Upcast to fp32 (exact for bf16/fp16; identity for fp32)."""
    return t.to(FP32)


def nu(x32: torch.Tensor, eps: float) -> torch.Tensor:
    """nu(x) = rsqrt(mean(x^2) + eps), fp32, over the last dim."""
    return torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def silu32(g32: torch.Tensor) -> torch.Tensor:
    """sigma(g) in fp32 (HF's act_fn)."""
    return F.silu(g32)


# ------------------------------------------------------------------------------------------------------ RMSNorm


def rms_norm_round_before_weight(x, w, eps, dtype=BF16):
    """HF / vLLM CUDA / Liger: r(w * r(x * nu(x)))."""
    x32 = f(x)
    return r(f(w) * f(r(x32 * nu(x32, eps), dtype)), dtype)


def rms_norm_round_after_weight(x, w, eps, dtype=BF16):
    """FlashInfer / Inductor / TE: r(x * nu(x) * w)."""
    x32 = f(x)
    return r(x32 * nu(x32, eps) * f(w), dtype)


def rms_norm_fp32(x, w, eps, dtype=None):
    """q/k norm fused into RoPE: x * nu(x) * w, left in fp32 (RoPE does the only rounding)."""
    x32 = f(x)
    return x32 * nu(x32, eps) * f(w)


RMS_NORM = {
    "round_before_weight": rms_norm_round_before_weight,
    "round_after_weight": rms_norm_round_after_weight,
    "fused_into_rope": rms_norm_fp32,
}


# ------------------------------------------------------------------------------------------------- residual add


def residual_rounded(a, h):
    """HF: R = r(a + h); the next norm reads R. Returns (R, what the norm reads)."""
    big_r = r(f(a) + f(h))
    return big_r, big_r


def residual_fp32(a, h):
    """Fused add+norm: S = a + h in fp32, R = r(S) is carried, the norm reads S. Returns (R, S)."""
    s = f(a) + f(h)
    return r(s), s


# The compiled-engine rules add exactly as normalize_fp32_sum does; they differ only in which of R and S a decoder
# layer carries on, which the model-level reference (tests/model_reference.py) checks.
RESIDUAL = {
    "normalize_rounded_sum": residual_rounded,
    "normalize_fp32_sum": residual_fp32,
    "round_at_attention": residual_fp32,
    "never_round": residual_fp32,
}


def add_rms_norm(a, h, w, eps, norm_rule, residual_rule):
    """Residual add then RMSNorm: returns (norm output, R)."""
    big_r, x_norm = RESIDUAL[residual_rule](a, h)
    return RMS_NORM[norm_rule](x_norm, w, eps), big_r


# ---------------------------------------------------------------------------------------------------------- RoPE


def rope(x, cos, sin, rounding, dtype=BF16):
    """NeoX RoPE. ``cos``/``sin`` already in the rule's dtype (c16 = r(c32) or c32), broadcastable to ``x``.

    once:     o1 = r(x1*c - x2*s),            o2 = r(x2*c + x1*s)
    truncate: o1 = t(x1*c - x2*s),            o2 = t(x2*c + x1*s)
    per_op:   o1 = r(r(x1*c) - r(x2*s)),      o2 = r(r(x2*c) + r(x1*s))
    """
    half = x.shape[-1] // 2
    x32, c32, s32 = f(x), f(cos), f(sin)
    x1, x2 = x32[..., :half], x32[..., half:]
    c1, c2 = c32[..., :half], c32[..., half:]
    s1, s2 = s32[..., :half], s32[..., half:]
    if rounding == "once":
        o1 = r(x1 * c1 - x2 * s1, dtype)
        o2 = r(x2 * c2 + x1 * s2, dtype)
    elif rounding == "truncate":
        o1 = t_(x1 * c1 - x2 * s1, dtype)
        o2 = t_(x2 * c2 + x1 * s2, dtype)
    elif rounding == "per_op":
        o1 = r(f(r(x1 * c1, dtype)) - f(r(x2 * s1, dtype)), dtype)
        o2 = r(f(r(x2 * c2, dtype)) + f(r(x1 * s2, dtype)), dtype)
    else:
        raise ValueError(rounding)
    return torch.cat((o1, o2), dim=-1)


def rope_fp32_pre_round(x, cos, sin):
    """The fp32 value that the "once" rule rounds (for checking that test inputs really hit ties)."""
    half = x.shape[-1] // 2
    x32, c32, s32 = f(x), f(cos), f(sin)
    x1, x2 = x32[..., :half], x32[..., half:]
    return torch.cat((x1 * c32[..., :half] - x2 * s32[..., :half], x2 * c32[..., half:] + x1 * s32[..., half:]), -1)


def cos_sin(positions: torch.Tensor, head_dim: int, base: float = 10000.0):
    """fp32 c32, s32 of shape (*positions.shape, head_dim), HF 5.x style:
    inv_freq = 1 / base^(2i/d), theta = pos * inv_freq, emb = cat(theta, theta)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=FP32) / head_dim))
    theta = positions[..., None].to(FP32) * inv_freq
    emb = torch.cat((theta, theta), dim=-1)
    return emb.cos(), emb.sin()


def cos_sin_in(c32, s32, cos_sin_dtype: str):
    """The cache in a rule's dtype: 'bf16' -> c16 = r(c32); 'fp32' -> c32."""
    if cos_sin_dtype == "bf16":
        return r(c32), r(s32)
    if cos_sin_dtype == "fp32":
        return c32, s32
    raise ValueError(cos_sin_dtype)


# -------------------------------------------------------------------------------------------------------- SwiGLU


def swiglu_round_silu(g, u):
    """HF / vLLM CUDA / Liger: r(r(sigma(g)) * u)."""
    return r(f(r(silu32(f(g)))) * f(u))


def swiglu_once(g, u):
    """Fused kernels / Inductor / TE: r(sigma(g) * u)."""
    return r(silu32(f(g)) * f(u))


SWIGLU = {"round_silu": swiglu_round_silu, "once": swiglu_once}


# ------------------------------------------------------------------------------------------------ whole regions


def qk_norm_then_rope(q, w, eps, qk_rule, cos, sin, rounding):
    """Qwen3 q/k norm over head_dim of q (B, T, H, D), then RoPE on (B, H, T, D); returns (B, H, T, D) bf16."""
    normed = RMS_NORM[qk_rule](q, w, eps)
    return rope(normed.transpose(1, 2), cos, sin, rounding)


# -- Fair Cast's noise stream (docs/sync.md, "The noise stream"), written from Threefry's definition in numpy ---------


def threefry2x32(key: int, c0, c1: int):
    """Threefry-2x32-20 (Salmon et al., SC'11) of counters ``(c0, c1)`` under 64-bit ``key``, in numpy uint32 (whose
    arithmetic wraps by definition). Checked against Random123's known answers in tests/test_sync_noise.py."""
    import numpy as np

    rot = (13, 15, 26, 6, 17, 29, 16, 24)
    k = [np.uint32(key & 0xFFFFFFFF), np.uint32(key >> 32)]
    k.append(k[0] ^ k[1] ^ np.uint32(0x1BD11BDA))
    x0 = np.asarray(c0, dtype=np.uint32) + k[0]
    x1 = np.full_like(x0, np.uint32(c1)) + k[1]
    for r in range(20):
        x0 = x0 + x1
        x1 = (x1 << np.uint32(rot[r % 8])) | (x1 >> np.uint32(32 - rot[r % 8]))
        x1 = x1 ^ x0
        if r % 4 == 3:
            i = r // 4 + 1
            x0 = x0 + k[i % 3]
            x1 = x1 + k[(i + 1) % 3] + np.uint32(i)
    return x0, x1


def sr_noise_bf16(key: int, step: int, elements: torch.Tensor) -> torch.Tensor:
    """bf16 SR noise of elements ``g``: 16-bit part ``(g >> 3) & 3`` of block ``8 * (g >> 5) + (g & 7)`` at counter
    high word ``4 * step`` (parts: x0 low, x0 high, x1 low, x1 high), as int64."""
    import numpy as np

    g = elements.numpy().astype(np.uint64)
    x0, x1 = threefry2x32(key, (8 * (g >> 5) + (g & 7)).astype(np.uint32), 4 * step)
    part = (g >> 3) & 3
    word = np.where(part >= 2, x1, x0)
    return torch.from_numpy(np.where(part % 2 == 1, word >> 16, word & 0xFFFF).astype(np.int64))


def tiny_draws(key: int, step: int, elements: torch.Tensor) -> torch.Tensor:
    """fp16's five Bernoulli words of elements ``g``: (x0, x1) of block ``g`` at ``4 * step + 1``, then at
    ``4 * step + 2``, then x0 at ``4 * step + 3``; shape (n, 5), int64."""
    import numpy as np

    g = elements.numpy().astype(np.uint32)
    words = []
    for stream in (1, 2, 3):
        words += list(threefry2x32(key, g, 4 * step + stream))
    return torch.from_numpy(np.stack(words[:5], axis=1).astype(np.int64))


def sr_noise_fp16(key: int, step: int, elements: torch.Tensor) -> torch.Tensor:
    """fp16 SR noise words of elements ``g``: bf16's 16-bit part (``sr_noise_bf16``) in the low half, x1 of block
    ``g`` at ``4 * step + 3`` in the high half, as int64 (the low d bits are the noise, d <= 23)."""
    import numpy as np

    _, high = threefry2x32(key, elements.numpy().astype(np.uint32), 4 * step + 3)
    return sr_noise_bf16(key, step, elements) | (torch.from_numpy(high.astype(np.int64)) << 16)
