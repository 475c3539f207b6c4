"""The GPU formats as served linear layers: a weight on its block-scaled grid and the linear an emulating engine runs.

NVFP4, MXFP4, MXFP8 and blockwise FP8 are served by GPU engines only (vLLM's CPU build serves none). Here the
reference engine and the trainer compute them from their definitions (``roundalign.quant.formats``: the
quantizers, each tested bit for bit against its source), in the arithmetic of the engines' own emulation paths,
so that an exact trainer can be checked against the reference engine before any GPU is involved:

- **NVFP4** (vLLM 0.32's ``run_nvfp4_emulations``): the weight dequantized as ``bf16(q * (s * (1 / gs)))`` (the
  global scale inverted once, at load), the activations quantized and dequantized as ``bf16(q * (s / gs))``, then a
  bf16 matmul and the bias added in bf16. The weight's global scale is shared by the projections an engine fuses
  (q/k/v, gate/up: llm-compressor gives them one, and vLLM serves the fused layer with one). The activations'
  global scale is a calibrated constant in a vLLM checkpoint and the current tensor's amax in TransformerEngine's
  training recipe; both make a token's log-prob depend on data outside its row, so here it is each token's own
  amax (``448 * 6 / amax``), which keeps every row independent of the batch it is computed in.
- **MXFP4, MXFP8** (vLLM's MX emulation kernels): both operands quantized and dequantized to bf16 (exact: E2M1 and
  E4M3 values times a power of two), then ``F.linear`` in bf16 with the bias.
- **Blockwise FP8** (1 x 128 activations, 128 x 128 weights, fp32 scales; DeepSeek-V3's and verl's format): the
  activations quantized as vLLM's ``QuantFP8`` group quantizer does (``s = max(amax / 448, 1 / (448 * 512))``,
  ``q = e4m3(x / s)``), then the block GEMM as its definition (and vLLM's ``native_w8a8_block_matmul`` test
  reference) states it: for each 128-wide slice of the inputs in order, the codes' dot products, times the
  activation's and the weight's scales, added to an fp32 accumulator; rounded once to bf16, the bias added in bf16.
  Each slice's dot product is computed exactly (in fp64, where 128 products of E4M3 values always fit) and rounded
  once to fp32, so it does not depend on a GEMM library's reduction order; a GPU's FP8 tensor cores may accumulate
  with fewer bits (scripts/gpu_quant_check.py measures that where a GPU is available).

Every layer is a function of its own row, so the reference engine (one GEMM call per row) and the trainer compute
the same bits.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from roundalign.quant import formats
from roundalign.quant.formats import E2M1_MAX, E4M3_MAX, Blocked
from roundalign.quant.schemes import Scheme

# vLLM's floor on a dynamic FP8 scale (quant.grid.FP8_MIN_SCALE, restated: grid dispatches to this module, so
# importing it from there would close an import circle)
FP8_MIN_SCALE = 1.0 / (E4M3_MAX * 512.0)


def quantize_weight(w: torch.Tensor, scheme: Scheme, amax: torch.Tensor | None = None) -> Blocked:
    """``w`` (out, in) in ``scheme``'s format, from its bf16 cast (what the served checkpoint holds). ``amax``: the
    absolute maximum the NVFP4 global scale is computed from, where fused projections share it (else ``w``'s)."""
    x = w.detach().to(torch.bfloat16).float()
    if scheme.weights == "nvfp4":
        amax = x.abs().amax() if amax is None else amax.float()
        return formats.nvfp4(x, formats.nvfp4_global_scale(_nonzero(amax), scheme.convention), scheme.convention)
    if scheme.weights == "mxfp4":
        return formats.mxfp4(x, scheme.convention)
    if scheme.weights == "mxfp8":
        return formats.mxfp8(x)
    if scheme.weights == "fp8-block":
        return formats.fp8_blockwise(x, 128)
    raise ValueError(f"{scheme} is not an emulated GPU format")


def fused_amax(weights: list[torch.Tensor]) -> torch.Tensor:
    """The absolute maximum of fused projections' bf16 weights together: what their shared NVFP4 global scale is
    computed from."""
    return torch.stack([w.detach().to(torch.bfloat16).float().abs().amax() for w in weights]).amax()


def cat(parts: list[Blocked]) -> Blocked:
    """Projections fused as the engine fuses them: their rows (and their blocks' scales) one after the other."""
    gs = parts[0].global_scale
    if gs is not None and any(not torch.equal(p.global_scale, gs) for p in parts):
        raise ValueError("fused NVFP4 projections must share one global scale (quantize them with fused_amax)")
    return replace(parts[0], codes=torch.cat([p.codes for p in parts]), scales=torch.cat([p.scales for p in parts]))


def dequantize(w: Blocked, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight the engine's emulation multiplies by, rounded once to ``dtype``: for NVFP4 in vLLM's convention
    ``q * (s * (1 / gs))`` (its ``dequantize_to_dtype`` with the inverted global scale), else the format's value."""
    if w.global_scale is not None and w.convention == "vllm":
        inverse = 1.0 / w.global_scale  # vLLM inverts the checkpoint's global scale once, at load
        return (w.codes * (w.scales * inverse).repeat_interleave(w.block[1], 1)).to(dtype)
    return w.dequantize(dtype)


def _nonzero(amax: torch.Tensor) -> torch.Tensor:
    """An all-zero tensor has no scale to take from its maximum; any finite global scale quantizes it to zeros."""
    return torch.where(amax == 0, torch.ones_like(amax), amax)


def quant_dequant(x: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """Activations ``x`` (rows, in) quantized to ``scheme``'s format and back, as its emulated linear uses them
    (module docstring), in ``x``'s dtype."""
    xf = x.float()
    if scheme.activations == "nvfp4":
        gs = formats.nvfp4_global_scale(_nonzero(xf.abs().amax(-1, keepdim=True)), scheme.convention)  # per token
        q = formats.nvfp4(xf, gs[..., None], scheme.convention)
        # vLLM's ref_nvfp4_quant_dequant: q * (s / gs); TransformerEngine's: q * (s * g)
        scale = q.scales / gs if scheme.convention == "vllm" else q.scales * gs
        return (q.codes * scale.repeat_interleave(16, 1)).to(x.dtype)
    if scheme.activations == "mxfp4":
        return formats.mxfp4(xf, scheme.convention).dequantize(x.dtype)
    if scheme.activations == "mxfp8":
        return formats.mxfp8(xf).dequantize(x.dtype)
    raise ValueError(f"{scheme} has no quantize-dequantize activation path")


def quantize_activations_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's dynamic 1 x 128 FP8 group quantizer (``QuantFP8._quantize_group_native``): ``(codes as fp32 E4M3
    values (rows, in), scales fp32 (rows, in / 128))``."""
    rows, cols = x.shape
    g = x.float().view(rows, cols // 128, 128)
    scale = (g.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp(min=FP8_MIN_SCALE)
    codes = (g / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return codes.view(rows, cols), scale[..., 0]


def block_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """``a`` (M, K) codes with scales (M, K/128) times ``b`` (N, K) codes with 128 x 128 scales (N/128, K/128):
    fp32 (M, N), each slice's exact dot product rounded to fp32, scaled, accumulated in slice order (docstring)."""
    m, k = a.shape
    n = b.shape[0]
    slices = k // 128
    exact = torch.bmm(a.double().view(m, slices, 128).transpose(0, 1), b.double().view(n, slices, 128).permute(1, 2, 0))
    partial = exact.float()  # (slices, M, N)
    b_full = b_scale.repeat_interleave(128, 0)  # (N, slices)
    out = torch.zeros(m, n, dtype=torch.float32, device=a.device)
    for i in range(slices):
        out += partial[i] * (a_scale[:, i : i + 1] * b_full[:, i][None, :])
    return out


def linear(scheme: Scheme):
    """The emulated layer of ``scheme``: ``(x (rows, in), Blocked weight, bias) -> (rows, out)`` in ``x``'s dtype."""
    if scheme.weights == "fp8-block":

        def fp8_block_linear(x, w: Blocked, bias=None):
            codes, scale = quantize_activations_1x128(x)
            out = block_gemm(codes, scale, w.codes, w.scales).to(x.dtype)
            return out if bias is None else out + bias

        return fp8_block_linear
    if scheme.weights == "nvfp4":

        def nvfp4_linear(x, w: Blocked, bias=None):
            out = torch.matmul(quant_dequant(x, scheme), dequantize(w, x.dtype).t())
            return out if bias is None else out + bias  # vLLM adds the bias after its matmul, in bf16

        return nvfp4_linear

    def mx_linear(x, w: Blocked, bias=None):
        return F.linear(quant_dequant(x, scheme), dequantize(w, x.dtype), bias)

    return mx_linear


__all__ = [
    "E2M1_MAX", "FP8_MIN_SCALE", "block_gemm", "cat", "dequantize", "fused_amax", "linear", "quant_dequant",
    "quantize_activations_1x128", "quantize_weight",
]  # fmt: skip
