"""The trainer's linear layers computed as a quantized engine computes them, with the straight-through gradient.

Under a profile with a quantization scheme (``Profile.quantization``), each of a module's projections (q/k/v, o,
gate/up, down; never the lm_head, which the engines keep in bf16) is served quantized: ``project`` quantizes the
trainer's current weights onto the scheme's grid (``roundalign.quant.grid``, as the exported checkpoint holds
them) and computes the layer at one of two levels, chosen by the profile's GEMM kernel:

- ``torch`` (quantization-aligned): the engine's quantizer and epilogue order, torch's GEMM. W8A8 int8: vLLM's
  per-token activation quantizer, ``torch._int_mm`` (int32 accumulation is exact in any order), then
  ``bf16((acc * weight_scale) * activation_scale + bias)`` in fp32, the order of vLLM's oneDNN epilogue. FP8: vLLM's
  per-token E4M3 quantizer, the fp32 GEMM its ``torch._scaled_mm`` fallback runs, its epilogue. W4A16: the
  weight dequantized as vLLM does (``(code - zp) * scale`` in fp32, rounded to bf16) and torch's bf16 linear.
- ``vllm-cpu`` (exact): vLLM's own quantized layer for these served tensors (``vllm_quant``), whatever kernel and
  ISA vLLM picks on this CPU.
- ``reference``: the aligned computation, one call per row (the reference engine's decode).

The GPU formats (NVFP4, MXFP4, MXFP8, blockwise FP8) have no vLLM CPU kernel: they run the engines' emulation
(``roundalign.quant.emulated``) at the ``torch`` and ``reference`` levels.

**Backward: straight-through.** The forward's weight is the dequantized served copy ``Q(W)``; the gradient is that
of ``x @ Q(W)^T`` with ``dQ/dW = I``: ``dx = g @ Q(W)`` (the dequantized weight, bf16) and ``dW = g^T x``, which
reaches the fp32 master as a bf16 linear's weight gradient does. This is the estimator quantization-aware training
uses (Bengio et al. 2013; QAT in torchao and llm-compressor); docs/quantization.md says what it does and does not
promise.

The served copy is kept on the module while its weights hold the same bits, as the engine keeps it between syncs;
a change of the weights (an optimizer step) quantizes and prepares it again. Where an export chose the codes
(stochastic rounding or error feedback onto the grid, ``roundalign.sync``) and the trainer computes on the served
copy, the codes it gave the weights (``quant.grid.serve``) are the ones served.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from roundalign.kernels.engine_gemm import _concat, _EngineLinear, _holds, fused_parts
from roundalign.profiles import GemmKernel
from roundalign.quant import emulated
from roundalign.quant.grid import Quantized, activation_gemm, served_codes
from roundalign.quant.schemes import Scheme


def _run(scheme: Scheme, gemm: GemmKernel, parts: list[Quantized], fused: Quantized, dequantized, bias):
    """The forward for the served ``parts`` (``fused``: their rows together): ``x (rows, in) -> (rows, out)``."""
    if gemm is GemmKernel.VLLM_CPU:
        from roundalign.kernels import vllm_quant

        return vllm_quant.linear(scheme, parts, bias, dequantized.dtype)
    gemm_of = activation_gemm(scheme)
    if gemm_of is None:  # weight-only: the dequantized weight in a 16-bit GEMM
        run = lambda x: F.linear(x, dequantized, bias)  # noqa: E731
    else:
        run = lambda x: gemm_of(x, fused, bias)  # noqa: E731
    if gemm is GemmKernel.REFERENCE:  # one call per row, as the reference engine's decode
        return lambda x: torch.cat([run(x[i : i + 1]) for i in range(x.shape[0])])
    return run


def _served(module, key: str, weights, biases, scheme: Scheme, gemm: GemmKernel):
    """``(dequantized fused weight, forward)`` of the served copy of ``weights``, kept on ``module`` for as long as
    they hold the same bits (quantized and prepared again after any change)."""
    cache = module.__dict__.setdefault("_roundalign_quant_cache", {})
    hit = cache.get(key)
    given = [getattr(w, "_roundalign_served", None) for w in weights]  # codes an export chose (quant.grid.serve)
    fresh = (
        hit is not None
        and hit[0] == (scheme, gemm)
        and _holds(hit[1], weights)
        and (hit[2] is None) == (not biases)
        and (not biases or _holds(hit[2], biases))
        and all(a is b for a, b in zip(hit[5], given, strict=True))
    )
    if not fresh:
        old = cache.pop(key, (None,) * 7)
        del hit
        with torch.no_grad():
            source = _concat(weights, old[1])
            bias = _concat(biases, old[2]) if biases else None
            if scheme.emulated:  # a GPU format (quant.emulated): NVFP4's fused projections share a global scale
                amax = emulated.fused_amax(weights) if scheme.weights == "nvfp4" else None
                parts = [served_codes(w, scheme, amax)[0] for w in weights]
                fused = emulated.cat(parts)
                dequantized = emulated.dequantize(fused, weights[0].dtype)
            else:
                parts = [served_codes(w, scheme)[0] for w in weights]
                fused = Quantized.cat(parts)
                dequantized = fused.dequantize(weights[0].dtype)
        del old
        run = _run(scheme, gemm, parts, fused, dequantized, bias)
        rows = [w.shape[0] for w in weights]
        hit = cache[key] = ((scheme, gemm), source, bias, dequantized, run, given, (fused, rows))
    return hit[3], hit[4]


def project(module, names: tuple[str, ...], x: torch.Tensor, gemm: GemmKernel, scheme: Scheme) -> list:
    """``[module.<name>(x) for name in names]`` as the quantized engine computes them (one fused layer, as vLLM
    fuses q/k/v and gate/up), with the straight-through gradient (module docstring)."""
    mods, low, weights, biases = fused_parts(module, names, x)
    for name, w in zip(names, weights, strict=True):
        scheme.check_shape(name, *w.shape)
    dequantized, run = _served(module, ",".join(names), weights, biases, scheme, gemm)
    out = _EngineLinear.apply(x.to(low), run, dequantized, len(weights), *weights, *biases)
    if len(mods) == 1:
        return [out]
    return [t.contiguous() for t in out.split([w.shape[0] for w in weights], dim=-1)]


def served(module) -> dict[str, object]:
    """The served copy this module's projections computed with in their last forward, by projection name (``q_proj``,
    ...): each a ``Quantized``, or an emulated format's ``Blocked``. What an audit compares with the engine's weights
    (the verl FP8 check does)."""
    out = {}
    for key, hit in module.__dict__.get("_roundalign_quant_cache", {}).items():
        fused, rows = hit[6]
        start = 0
        for name, n in zip(key.split(","), rows, strict=True):
            out[name] = _rows(fused, start, n)
            start += n
    return out


def _rows(q, start: int, n: int):
    """Rows ``[start, start + n)`` of a fused served copy, with their scales."""
    if isinstance(q, Quantized):
        zp = None if q.zero_point is None else q.zero_point[start : start + n]
        return Quantized(q.codes[start : start + n], q.scale[start : start + n], zp)
    per = q.block[0]  # rows per scale: 1, or 128 for blockwise FP8
    return dataclasses.replace(q, codes=q.codes[start : start + n], scales=q.scales[start // per : (start + n) // per])


__all__ = ["project", "served"]
