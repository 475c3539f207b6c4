"""Fair Cast onto a quantization grid: the fp32 master exported straight onto the scheme's int8, int4 or FP8 codes.

A quantized engine serves ``(code - zero_point) * scale``. Rounding to nearest onto that grid drops every update
smaller than half a grid step (``amax / 255`` of its row for int8, ``amax / 15`` of its group for int4): far more
than a bf16 cast drops, so a quantized sampler lags the trainer further. The export here puts Fair Cast's two
unbiased roundings on the grid itself. The scales and zero points are the scheme's, computed exactly as the RNE
export computes them (``quant.grid.quantize_weight`` on the bf16 cast of the master), so the checkpoint is the
format the engine loads, and only the codes differ:

- ``"rne"``: the codes a checkpoint of the bf16 copy holds (``quantize_weight``), the default everywhere;
- ``"stochastic"``: ``x = clamp(m / scale + zp, lo, hi)`` in fp32, then ``code = b`` with probability
  ``(x - a) / (b - a)`` exactly, else ``a`` (``a <= x <= b`` adjacent codes: integers, or E4M3 values), so
  ``E[(code - zp) * scale] = m`` wherever ``m`` lies inside the grid's range;
- ``"error-feedback"``: ``v = m + e`` (fp32), ``code`` = ``v``'s nearest code (ties to even, as the RNE export),
  ``e <- v - served``, where ``served`` is the weight the engine multiplies by (below): what one export drops is
  added back at the next.

The grid's range ends every row: compressed-tensors' symmetric scale puts a row's largest weight half a step past
the last code, where it is clamped whatever the rounding. Neither mode can serve beyond the range, so where ``x``
is clamped the stochastic draw is the clamped code and error feedback drops that element's residual (carrying it
would grow it without bound); everywhere else both are unbiased.

``served`` (``served_weight``): for W8A8 and FP8 the exact fp32 product ``(code - zp) * scale`` (the engine applies
the scale in its fp32 epilogue); for weight-only schemes its bf16 rounding, the weight vLLM's 4-bit kernel
dequantizes to before its bf16 GEMM. That rounding is a fixed function of the code, so stochastic rounding is
unbiased on the grid, not through it.

The stochastic draws are exact for every fp32 probability and reproducible from ``(key, step, element)`` alone
(``noise.py``'s Threefry): element ``g`` compares the first word of Threefry block ``g`` of stream 0 with
``p * 2^32`` (exact for ``p >= 2^-8``, a multiple of ``2^-31``), and a smaller ``p`` takes the dyadic Bernoulli of
the fp16 export over streams 1 to 3. Nothing here depends on chunking or threads.
"""

from __future__ import annotations

import torch

from roundalign.quant.grid import Quantized, quantize_weight
from roundalign.quant.schemes import Scheme
from roundalign.sync import _native, noise

_CHUNK = 1 << 18  # elements per Threefry pass: its int64 temporaries stay a few MiB each
_SMALL_P = 2.0**-8  # below this a probability may have bits under 2^-32: the dyadic draw


def served_weight(q: Quantized, scheme: Scheme) -> torch.Tensor:
    """The weight the engine multiplies by, in fp32: ``(code - zp) * scale`` exactly for activation-quantizing
    schemes (their epilogue applies the scale in fp32), its bf16 rounding for weight-only ones."""
    return q.dequantize(torch.bfloat16 if scheme.weight_only else torch.float32).float()


def served_weights(served: dict[str, torch.Tensor], scheme: Scheme) -> dict[str, torch.Tensor]:
    """A served copy by HF name as the engine computes with it (what ``UpdateTracker`` measures): a quantized
    engine's checkpoint tensors (``Exporter(..., scheme=)``) with each linear's ``served_weight`` under its weight's
    name; any other served copy as it is."""
    from roundalign.quant import checkpoint

    if not checkpoint.is_checkpoint(served):
        return served

    linears, rest = checkpoint.split(served, scheme)
    return rest | {f"{name}.weight": served_weight(q, scheme) for name, q in linears.items()}


def bernoulli(p: torch.Tensor, key: int, step: int) -> torch.Tensor:
    """One exact Bernoulli(``p``) draw per element of fp32 ``p`` in [0, 1], element ``g`` from Threefry block
    ``g`` under ``key`` at export ``step`` (module docstring)."""
    flat = p.reshape(-1)
    if flat.numel() > noise.MAX_BLOCKS:
        raise ValueError(
            f"one stochastic export draws at most {noise.MAX_BLOCKS} elements; this tensor has {flat.numel()}"
        )
    out = torch.empty(flat.numel(), dtype=torch.bool, device=p.device)
    hi = noise.counter_hi(step, 0)
    for start in range(0, flat.numel(), _CHUNK):
        chunk = flat[start : start + _CHUNK]
        word = _native.words(noise.split_key(key), hi, start, chunk.numel()) if p.device.type == "cpu" else None
        if word is None:  # a GPU, or no compiled kernels here: the same words in torch ops
            index = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=p.device)
            word = noise.threefry2x32(key, index, hi)[0]
        # p * 2^32 is an integer for p >= 2^-8 (its ulp is at least 2^-31), so the comparison's probability is p.
        accept = word < (chunk.double() * 2.0**32).to(torch.int64)
        small = ((chunk > 0) & (chunk < _SMALL_P)).nonzero().squeeze(1)
        if small.numel():
            accept[small] = noise.bernoulli_dyadic(chunk[small], noise.tiny_draws(key, step, small + start))
        out[start : start + chunk.numel()] = accept
    return out.view(p.shape)


def _fp8_neighbours(ax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The E4M3 values ``a <= ax < b`` (``ax`` fp32 in [0, 448]) as uint8 bit patterns; positive E4M3 values are
    ordered as their bits, so the next one up is the bits plus one. At 448, the largest, ``b`` is ``a``."""
    near = ax.to(torch.float8_e4m3fn)
    bits = near.view(torch.uint8).to(torch.int16)
    a = torch.where(near.float() > ax, bits - 1, bits)
    b = torch.where(a == 0x7E, a, a + 1)  # 0x7E is 448; 0x7F is NaN in E4M3FN
    return a.to(torch.uint8), b.to(torch.uint8)


def _stochastic(x: torch.Tensor, scheme: Scheme, state) -> torch.Tensor:
    """Codes for fp32 ``x`` (already in the grid's range) by exact stochastic rounding; sign-symmetric, so the
    draw runs on ``|x|``, whose fraction is exact in fp32."""
    ax = x.abs()
    if scheme.weights == "fp8":
        a, b = _fp8_neighbours(ax)
        lo, hi = a.view(torch.float8_e4m3fn).float(), b.view(torch.float8_e4m3fn).float()
        # ax - lo is exact (Sterbenz: lo >= ax / 2, or lo = 0), and hi - lo is a power of two.
        p = torch.where(hi > lo, (ax - lo) / (hi - lo).clamp_min(2.0**-9), torch.zeros_like(ax))
        bits = torch.where(bernoulli(p, state.key, state.step), b, a)
        bits = torch.where(x < 0, bits | 0x80, bits)  # E4M3's sign bit
        return bits.view(torch.float8_e4m3fn)
    low = ax.floor()
    up = bernoulli(ax - low, state.key, state.step)  # the fraction: exact in fp32
    return torch.copysign(low + up.float(), x).to(torch.int8)


def _nearest(x: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """Codes for fp32 ``x`` in the grid's range, rounded to nearest, ties to even (as the RNE export)."""
    return x.to(torch.float8_e4m3fn) if scheme.weights == "fp8" else torch.round(x).to(torch.int8)


def export_linear(master: torch.Tensor, scheme: Scheme, sync: str, state) -> Quantized:
    """One linear layer's fp32 master ``(out, in)`` onto ``scheme``'s grid by ``sync`` (module docstring); the state
    moves as ``export_bf16``'s does (stochastic: ``state.step`` + 1; error feedback: ``state.residual``)."""
    grid = quantize_weight(master, scheme)  # the scheme's scales and zero points, and the RNE codes
    if sync == "rne":
        return grid
    out, width = master.shape
    groups = grid.scale.shape[1]
    scale = grid.scale.float().view(out, groups, 1)
    zero = None if grid.zero_point is None else grid.zero_point.float().view(out, groups, 1)
    lo, hi = scheme.grid
    if sync == "stochastic":
        v = master.detach().float().view(out, groups, -1)
    else:
        residual = state.residual
        v = master.detach().float() if residual is None else master.detach().float() + residual
        v = v.view(out, groups, -1)
    x = v / scale if zero is None else v / scale + zero
    inside = (x >= lo) & (x <= hi)
    x = x.clamp(lo, hi)
    if sync == "stochastic":
        codes = _stochastic(x, scheme, state).view(out, width)
        state.step += 1
        return Quantized(codes, grid.scale, grid.zero_point)
    codes = _nearest(x, scheme).view(out, width)
    q = Quantized(codes, grid.scale, grid.zero_point)
    # What the engine does not serve carries over; a clamped element's excess cannot be served, and a non-finite
    # one cannot be carried: both start again from zero.
    residual = v.view(out, width) - served_weight(q, scheme)
    keep = inside.view(out, width) & residual.isfinite()
    state.residual = torch.where(keep, residual, torch.zeros_like(residual))
    return q


__all__ = ["bernoulli", "export_linear", "served_weight", "served_weights"]
