"""The quantizers: a weight onto its scheme's grid, its dequantized value, and the engine's activation quantizer.

Weights are quantized as the format's reference producer (compressed-tensors, which llm-compressor runs) computes
them, so that a checkpoint we write holds the codes an independent producer writes from the same weights:

- symmetric: ``scale = amax / ((hi - lo) / 2)`` (``amax / 127.5`` for int8, ``amax / 7.5`` for int4: the format's
  half range, so the largest weight lands on ``hi + 0.5`` and clamps to ``hi``; ``amax / 448`` for FP8 E4M3),
  ``code = clamp(round(w / scale))`` (for FP8 the cast to E4M3 rounds);
- with zero points: ``scale = (max(w, 0) - min(w, 0)) / (hi - lo)``, ``zp = round(clamp(lo - min / scale))``,
  ``code = clamp(round(w / scale + zp))``;
- a zero scale becomes the dtype's epsilon; rounding is half to even (``torch.round``).

The arithmetic is in the weight's dtype, as compressed-tensors runs it on the model it is given: on the bf16 cast
of the trainer's weights by default (what the served bf16 checkpoint is, and what the producer reads), so the scale
and ``w / scale`` are rounded to bf16 on the way. ``source="fp32"`` quantizes the fp32 master instead
(docs/quantization.md measures how often the codes differ).

The activation quantizer is vLLM's dynamic per-token int8 quantizer (``onednn_scaled_int8_quant``, measured bit for
bit): ``s = amax(|x_row|) / 127`` in fp32, ``code = clamp(round(x * (1 / s)))`` (a multiply by the reciprocal, not
a division: the two differ in the last bit for about one value in a few hundred).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from roundalign.quant.schemes import Scheme

FP8_MAX = 448.0  # E4M3's largest finite value
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's floor on a dynamic FP8 scale


@dataclass
class Quantized:
    """A weight on its scheme's grid: ``codes`` (``int8``, signed: ``[-8, 7]`` for int4), ``scale`` (per output
    row and group: ``(out, groups)``), ``zero_point`` (signed ``int8``, ``(out, groups)``, or None)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``(code - zp) * scale`` in fp32, rounded once to ``dtype`` (vLLM's CPU W4A16 dequantizes so before its bf16
        GEMM; for int8 this is the straight-through weight of the backward)."""
        out, groups = self.scale.shape
        codes = self.codes.float().view(out, groups, -1)
        if self.zero_point is not None:
            codes = codes - self.zero_point.float()[..., None]
        return (codes * self.scale.float()[..., None]).view(self.codes.shape).to(dtype)

    @classmethod
    def cat(cls, parts: list[Quantized]) -> Quantized:
        """Projections fused as the engine fuses them (q/k/v, gate/up): their rows one after the other."""
        zero = None if parts[0].zero_point is None else torch.cat([p.zero_point for p in parts])
        return cls(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]), zero)


def serve(weight: torch.Tensor, q: Quantized) -> None:
    """Have ``weight`` served as ``q`` until it changes: the codes an export chose (stochastic rounding or error
    feedback onto the grid, ``roundalign.sync``), where quantizing ``weight`` itself would give other codes. The
    trainer's quantized layers and the reference engine read it through ``served_codes``."""
    weight._roundalign_served = (weight._version, q)


def served_codes(weight: torch.Tensor, scheme: Scheme, amax: torch.Tensor | None = None) -> tuple[Quantized, bool]:
    """``(the grid copy of weight, whether it is one given by serve)``: the codes ``serve`` gave it while its data
    is unchanged since (an in-place change bumps the tensor's version), else ``quantize_weight(weight, scheme)``
    (for an emulated GPU format ``quant.emulated.quantize_weight``, with ``amax`` its fused projections' absolute
    maximum: ``emulated.fused_amax``)."""
    hit = getattr(weight, "_roundalign_served", None)
    if hit is not None and hit[0] == weight._version:
        return hit[1], True
    if scheme.emulated:  # a GPU format: a Blocked (quant.emulated)
        from roundalign.quant import emulated

        return emulated.quantize_weight(weight, scheme, amax), False
    return quantize_weight(weight, scheme), False


def _groups(scheme: Scheme, w: torch.Tensor) -> torch.Tensor:
    """``w`` as ``(out, groups, per group)``: one group per row under ``channel``."""
    out, inp = w.shape
    size = scheme.group_size if scheme.strategy == "group" else inp
    return w.reshape(out, inp // size, size)


def _to_grid(scaled: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """Values already clamped to the grid's range, onto its codes: integers (round half to even, as int8) or E4M3
    (the cast rounds to nearest even)."""
    if scheme.weights == "fp8":
        return scaled.to(torch.float8_e4m3fn)
    return torch.round(scaled).to(torch.int8)


def quantize_weight(w: torch.Tensor, scheme: Scheme, source: str = "bf16") -> Quantized:
    """``w`` (``(out, in)``) on ``scheme``'s grid, as compressed-tensors computes it (module docstring).

    ``source``: ``"bf16"`` (default) quantizes the bf16 cast of ``w``, in bf16 arithmetic; ``"fp32"`` quantizes
    ``w`` in fp32 (the scale is still stored in bf16, as the checkpoint holds it, and the codes are computed with
    the stored scale)."""
    if not scheme.quantized:
        raise ValueError("quantize_weight: the 'none' scheme serves bf16 weights")
    if scheme.emulated:
        raise ValueError(f"{scheme} is an emulated GPU format: quantize it with quant.emulated.quantize_weight")
    if source not in ("bf16", "fp32"):
        raise ValueError(f"source must be 'bf16' or 'fp32', got {source!r}")
    if scheme.online:
        return _online_fp8(w.detach().to(torch.bfloat16 if source == "bf16" else torch.float32))
    dtype = torch.bfloat16 if source == "bf16" else torch.float32
    x = _groups(scheme, w.detach().to(dtype))
    lo, hi = scheme.grid
    zero = torch.zeros((), dtype=dtype)
    mn, mx = torch.minimum(x.amin(-1), zero), torch.maximum(x.amax(-1), zero)
    if scheme.symmetric:
        scale = torch.maximum(mn.abs(), mx) / ((hi - lo) / 2)
    else:
        scale = (mx - mn) / float(hi - lo)
    scale = scale.to(torch.bfloat16)  # what the checkpoint stores (the model's dtype)
    scale = torch.where(scale == 0, torch.finfo(torch.bfloat16).eps, scale).to(dtype)
    zp = None
    scaled = x / scale[..., None]
    if not scheme.symmetric:
        zp = torch.round(torch.clamp(lo - mn / scale, lo, hi))
        scaled = scaled + zp[..., None]
    codes = _to_grid(torch.clamp(scaled, lo, hi), scheme).reshape(w.shape)
    return Quantized(codes, scale.to(torch.bfloat16), None if zp is None else zp.to(torch.int8))


def _online_fp8(w: torch.Tensor) -> Quantized:
    """vLLM's own per-channel FP8 quantizer (``Fp8PtpcOnlineLinearMethod``, vllm 0.32): ``s = max(amax / 448, 1 /
    (448 * 512))`` in fp32, ``code = e4m3(clamp(w / s))`` by true division in fp32; the fp32 scale is served as it
    is."""
    amax = torch.maximum(w.amin(-1, keepdim=True).abs(), w.amax(-1, keepdim=True).abs()).float()
    scale = (amax / torch.tensor(FP8_MAX)).clamp_min(FP8_MIN_SCALE)
    codes = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Quantized(codes, scale, None)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's dynamic per-token int8 quantizer on ``x`` (``(rows, in)``): ``(codes int8, scale fp32 (rows, 1))``."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / 127.0
    inverse = torch.where(scale == 0, torch.zeros_like(scale), 1.0 / scale)
    return torch.round(xf * inverse).clamp(-128, 127).to(torch.int8), scale


def int8_linear(x: torch.Tensor, weight: Quantized, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A W8A8 int8 linear as vLLM's CPU oneDNN kernel computes it (measured bit for bit): the activations quantized
    per token (``quantize_activations``), an int32 GEMM (exact in any order where the CPU has VNNI or AMX), then in
    fp32 ``fma(acc * weight_scale, token_scale, bias)``, rounded once to ``x``'s dtype."""
    codes, scale = quantize_activations(x)
    acc = torch._int_mm(codes, weight.codes.t()).float()
    out = acc * weight.scale.float().view(1, -1)
    if bias is None:
        return (out * scale).to(x.dtype)
    # oneDNN applies the token's scale and the bias as one fused multiply-add (one rounding; measured: a multiply
    # and an add differ for a few outputs in ten thousand). fp32 products are exact in fp64, so this is the FMA up
    # to a double rounding, which can differ from it for about one value in 2^29.
    return (out.double() * scale.double() + bias.double()).float().to(x.dtype)


def quantize_activations_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's dynamic per-token FP8 quantizer (``QuantFP8.forward_native``): ``s = max(amax / 448, 1 / (448 *
    512))`` in fp32, ``code = e4m3(clamp(x * (1 / s)))``: ``(codes float8_e4m3fn, scale fp32 (rows, 1))``."""
    amax = x.abs().amax(-1, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    return (x.float() * scale.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_linear(x: torch.Tensor, weight: Quantized, bias: torch.Tensor | None = None) -> torch.Tensor:
    """An FP8 W8A8 linear as vLLM's CPU build computes it without AMX (``ChannelWiseTorchFP8ScaledMMLinearKernel``,
    measured bit for bit): activations quantized per token (padded with zero rows to at least 17, vLLM's
    ``num_token_padding``), ``torch._scaled_mm``'s CPU emulation (both operands upcast to fp32, an fp32 matmul),
    then ``(acc * token_scale) * weight_scale + bias`` in fp32, rounded once to ``x``'s dtype. The padding matters:
    an fp32 GEMM of fewer than 12 rows takes another reduction order here."""
    codes, scale = quantize_activations_fp8(x)
    rows = codes.shape[0]
    a = torch.nn.functional.pad(codes.float(), (0, 0, 0, max(17 - rows, 0)))
    acc = torch.matmul(a, weight.codes.float().t().contiguous())[:rows]
    out = acc * scale * weight.scale.float().view(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def activation_gemm(scheme: Scheme):
    """The layer of a scheme that quantizes activations (``int8_linear``, ``fp8_linear``: ``(x, Quantized, bias)``;
    an emulated GPU format's ``quant.emulated.linear``: ``(x, Blocked, bias)``), or None for a weight-only scheme,
    which multiplies by the dequantized weight."""
    if scheme.emulated:
        from roundalign.quant import emulated

        return emulated.linear(scheme)
    return {"int8-token": int8_linear, "fp8-token": fp8_linear, "none": None}[scheme.activations]


def pack_int4(values: torch.Tensor, dim: int) -> torch.Tensor:
    """compressed-tensors' ``pack-quantized`` packing: signed 4-bit ``values`` shifted to ``[0, 15]`` (``+ 8``), eight
    to an ``int32`` along ``dim``, the first in the lowest four bits."""
    u = (values.to(torch.int32) + 8).movedim(dim, -1)
    u = u.reshape(*u.shape[:-1], -1, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=values.device)
    packed = (u << shifts).sum(-1, dtype=torch.int64)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # the int32 with those bits
    return packed.movedim(-1, dim).contiguous()


def unpack_int4(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """``pack_int4``'s inverse: signed ``int8`` values."""
    p = packed.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=packed.device)
    u = (p[..., None] >> shifts) & 0xF
    return (u.reshape(*p.shape[:-1], -1) - 8).to(torch.int8).movedim(-1, dim).contiguous()


__all__ = [
    "FP8_MAX",
    "activation_gemm",
    "FP8_MIN_SCALE",
    "Quantized",
    "fp8_linear",
    "int8_linear",
    "pack_int4",
    "quantize_activations_fp8",
    "quantize_activations",
    "quantize_weight",
    "serve",
    "served_codes",
    "unpack_int4",
]
