"""The GPU engines' low-precision formats, emulated from their definitions: NVFP4, MXFP4, MXFP8 and blockwise FP8.

vLLM's CPU build serves none of these (docs/quantization.md), so nothing here is measured against an engine yet;
each function follows a named source, and where two sources round differently both are here, chosen by name:

- **E2M1** (FP4): the values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; ``e2m1`` rounds to the nearest, ties
  to even (so 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), and saturates at 6.
- **NVFP4**: E2M1 values in blocks of 16 along the input, one E4M3 scale per block, one fp32 global scale.
  ``convention="vllm"`` is vLLM's reference (``ref_nvfp4_quant`` in ``nvfp4_emulation_utils.py``, v0.32), whose
  global scale ``gs`` is the *quantizing* one (``448 * 6 / amax``): ``s = e4m3(clamp(gs * (block_amax * (1/6)),
  +-448))``, ``q = e2m1(clamp(x * 1/(s * 1/gs), +-6))``, value ``q * (s / gs)``. ``convention="te"`` is
  TransformerEngine's (``docs/features/low_precision_training/nvfp4``), whose global scale is the *dequantizing*
  one (``amax / (448 * 6)``): ``s = e4m3((block_amax / 6) / g)``, ``q = e2m1(x / (s * g))``, value ``q * s * g``.
- **MXFP4** (OCP Microscaling v1.0): E2M1 values in blocks of 32, one E8M0 (power-of-two) scale per block.
  ``rounding="ocp"``: the shared exponent is ``floor(log2(amax)) - 2`` (E2M1's largest exponent) and elements round
  to nearest with ties away from zero, as the OCP reference code (microsoft/microxcaling, ``mx_ops._quantize_mx``
  with its default ``round="nearest"``) computes them; ``"ocp-even"`` the same with ties to even (its
  ``round="even"``); ``rounding="vllm"``: vLLM 0.32's quantizer
  (``mxfp4_utils.py``, ``_compute_quant_and_scale``) first rounds ``amax`` up one binade when its significand is at
  least 1.75 (``(bits + 0x200000) & 0x7F800000``), so a block whose largest value would round to 8 is scaled one
  step further instead of saturating at 6, and rounds elements ties to even. All clamp the exponent to +-127.
- **MXFP8** (vLLM's ``_mxfp8_e4m3_quantize_torch``, v0.32; TransformerEngine's MXFP8): E4M3 values in blocks of
  32, an E8M0 scale ``2^ceil(log2(amax / 448))`` (biased exponent clamped to [0, 254]), ``q = e4m3(x / scale)``.
- **Blockwise FP8** (DeepSeek-style checkpoints; verl's ``scaled_fp8_blockwise``, ``verl/utils/kernel/
  fp8_kernel.py``): 128 x 128 weight blocks, ``scale = 448 / amax`` in fp32 (1 for an all-zero block), ``q =
  e4m3(clamp(w * scale, +-448))``, and the checkpoint stores the reciprocal ``1 / scale`` (the "descale").

Each quantizer returns a ``Blocked``: the codes as fp32 values on the format's grid (E2M1 or E4M3 values), the
per-block scales as fp32, and the block shape; ``dequantize`` gives the value the format represents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0


@dataclass
class Blocked:
    """Values on a block-scaled grid: ``codes`` (fp32, each an E2M1 or E4M3 value, the tensor's shape),
    ``scales`` (fp32, one per block: ``(rows / block[0], cols / block[1])``), the ``block`` shape, and for NVFP4 the
    fp32 ``global_scale`` as its convention stores it."""

    codes: torch.Tensor
    scales: torch.Tensor
    block: tuple[int, int]
    global_scale: torch.Tensor | None = None
    convention: str = ""

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The represented values, computed in fp32 in the format's order and rounded once to ``dtype``."""
        scale = self.scales
        if self.global_scale is not None:  # NVFP4: s / gs (vLLM) or s * g (TE), per block
            scale = scale / self.global_scale if self.convention == "vllm" else scale * self.global_scale
        full = scale.repeat_interleave(self.block[0], 0).repeat_interleave(self.block[1], 1)
        return (self.codes * full).to(dtype)


def e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to the nearest E2M1 value, ties to even, saturating at +-6 (module docstring)."""
    a = x.abs()
    out = torch.full_like(a, E2M1_MAX)
    # Bounds between neighbours, each tie going to the even one (0, 1, 2, 4 have an even mantissa; 0.5, 1.5, 3 odd).
    for value, upper, inclusive in ((4.0, 5.0, True), (3.0, 3.5, False), (2.0, 2.5, True), (1.5, 1.75, False),
                                    (1.0, 1.25, True), (0.5, 0.75, False), (0.0, 0.25, True)):  # fmt: skip
        below = a <= upper if inclusive else a < upper
        out = torch.where(below, torch.tensor(value), out)
    return torch.copysign(out, x)


def e2m1_away(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to the nearest E2M1 value, ties away from zero (0.25 -> 0.5, 1.25 -> 1.5, 2.5 -> 3,
    5 -> 6), saturating at +-6: the OCP reference code's default element rounding (microxcaling's ``"nearest"``)."""
    a = x.abs()
    out = torch.full_like(a, E2M1_MAX)
    for value, upper in ((4.0, 5.0), (3.0, 3.5), (2.0, 2.5), (1.5, 1.75), (1.0, 1.25), (0.5, 0.75), (0.0, 0.25)):
        out = torch.where(a < upper, torch.tensor(value), out)
    return torch.copysign(out, x)


def _blocks(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``x`` (R, C) as ``(R / rows, C / cols, rows * cols)``: each block's elements on the last axis."""
    r, c = x.shape
    if r % rows or c % cols:
        raise ValueError(f"a {r} x {c} tensor does not split into {rows} x {cols} blocks; pad it first")
    return x.reshape(r // rows, rows, c // cols, cols).permute(0, 2, 1, 3).reshape(r // rows, c // cols, -1)


def _unblocks(b: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    nr, nc, _ = b.shape
    return b.reshape(nr, nc, rows, cols).permute(0, 2, 1, 3).reshape(nr * rows, nc * cols)


def _reciprocal(t: torch.Tensor) -> torch.Tensor:
    """vLLM's ``get_reciprocal``: ``1 / (t + (t == 0) * 1e8)``, so a zero gives 1e-8 rather than inf."""
    return 1.0 / (t + (t == 0) * 1e8)


def nvfp4_global_scale(amax: torch.Tensor, convention: str) -> torch.Tensor:
    """The fp32 global scale of a tensor with absolute maximum ``amax``, as ``convention`` stores it: vLLM's is
    ``448 * 6 / amax`` (it quantizes by multiplying), TransformerEngine's ``amax / (448 * 6)``. vLLM's is computed
    as compressed-tensors' ``generate_gparam`` writes it, a Python float over a tensor: ``reciprocal(amax) * 2688``
    in torch, not a true division."""
    amax = amax.float()
    if convention == "vllm":
        return (E4M3_MAX * E2M1_MAX) / amax
    if convention == "te":
        return amax / (E4M3_MAX * E2M1_MAX)
    raise ValueError(f"unknown NVFP4 convention {convention!r}; choose 'vllm' or 'te'")


def nvfp4(x: torch.Tensor, global_scale: torch.Tensor | None = None, convention: str = "vllm") -> Blocked:
    """NVFP4 of ``x`` (rows, cols) in blocks of 1 x 16: E2M1 codes, E4M3 block scales, the fp32 global scale
    (``nvfp4_global_scale`` of ``x``'s amax unless given)."""
    if global_scale is None:
        global_scale = nvfp4_global_scale(x.abs().amax(), convention)
    gs = global_scale.float()
    b = _blocks(x, 1, 16)
    vec_max = b.abs().amax(-1, keepdim=True).float()
    if convention == "vllm":  # ref_nvfp4_quant, operation for operation
        scale = torch.clamp(gs * (vec_max * (1 / E2M1_MAX)), min=-E4M3_MAX, max=E4M3_MAX)
        scale = scale.to(torch.float8_e4m3fn).float()
        scaled = b.float() * _reciprocal(scale * _reciprocal(gs))
    elif convention == "te":
        scale = ((vec_max / E2M1_MAX) / gs).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float()
        scaled = b.float() / (scale * gs)
        scaled = torch.where(scale == 0, torch.zeros_like(scaled), scaled)
    else:
        raise ValueError(f"unknown NVFP4 convention {convention!r}; choose 'vllm' or 'te'")
    codes = e2m1(scaled.clamp(-E2M1_MAX, E2M1_MAX))
    return Blocked(_unblocks(codes, 1, 16), scale[..., 0], (1, 16), gs, convention)


def mxfp4(x: torch.Tensor, rounding: str = "ocp") -> Blocked:
    """MXFP4 of ``x`` (rows, cols) in blocks of 1 x 32: E2M1 codes, power-of-two (E8M0) scales. ``rounding``:
    ``"ocp"`` (the OCP reference code: shared exponent ``floor(log2(amax)) - 2``, elements to nearest with ties away
    from zero, its default), ``"ocp-even"`` (the same exponent, elements ties to even) or ``"vllm"`` (vLLM's
    exponent, elements ties to even; module docstring)."""
    b = _blocks(x, 1, 32).float()
    amax = b.abs().amax(-1, keepdim=True)
    if rounding == "vllm":  # round amax up one binade when its significand is >= 1.75, keep only the exponent
        amax = ((amax.view(torch.int32) + 0x200000) & 0x7F800000).view(torch.float32)
        exponent = torch.floor(torch.log2(amax + torch.where(amax == 0, 2.0**-126, 0.0))) - 2
    elif rounding in ("ocp", "ocp-even"):
        exponent = torch.floor(torch.log2(torch.where(amax == 0, 2.0**-126, amax))) - 2
    else:
        raise ValueError(f"unknown MXFP4 rounding {rounding!r}; choose 'ocp', 'ocp-even' or 'vllm'")
    scale = torch.exp2(exponent.clamp(-127, 127))
    if rounding == "vllm":  # multiplies by the reciprocal scale
        codes = e2m1(b * torch.where(scale == 0, torch.zeros_like(scale), 1.0 / scale))
    else:  # divides by the power of two (the same value: both exact)
        codes = (e2m1_away if rounding == "ocp" else e2m1)(b / scale)
    return Blocked(_unblocks(codes, 1, 32), scale[..., 0], (1, 32))


def mxfp8(x: torch.Tensor) -> Blocked:
    """MXFP8 of ``x`` (rows, cols) in blocks of 1 x 32: E4M3 codes, E8M0 scales ``2^ceil(log2(amax / 448))``."""
    b = _blocks(x, 1, 32).float()
    amax = b.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    biased = (torch.ceil(torch.log2(amax / E4M3_MAX)) + 127.0).clamp(0, 254)
    scale = torch.exp2(biased - 127.0)
    codes = (b / scale).to(torch.float8_e4m3fn).float()
    return Blocked(_unblocks(codes, 1, 32), scale[..., 0], (1, 32))


def fp8_blockwise(w: torch.Tensor, block: int = 128) -> Blocked:
    """Blockwise FP8 of a weight ``w`` (rows, cols) in ``block`` x ``block`` tiles, as verl exports it: E4M3
    codes and the stored descale ``1 / (448 / amax)`` per tile (1 for an all-zero or infinite tile)."""
    b = _blocks(w, block, block).float()
    amax = b.abs().amax(-1, keepdim=True)
    # A true division, as verl's torch.div(448, amax) computes it. (Python's ``448.0 / tensor`` is not one: torch
    # computes it as ``reciprocal(tensor) * 448``, which differs in the last bit for about a quarter of values.)
    scale = torch.div(torch.tensor(E4M3_MAX), amax)
    scale = torch.where((amax == 0) | (amax == torch.inf), torch.ones_like(scale), scale)
    codes = (b * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return Blocked(_unblocks(codes, block, block), torch.reciprocal(scale)[..., 0], (block, block))


__all__ = [
    "Blocked", "E2M1_MAX", "E4M3_MAX", "e2m1", "e2m1_away", "fp8_blockwise", "mxfp4", "mxfp8", "nvfp4",
    "nvfp4_global_scale",
]  # fmt: skip
