"""Quantized rollouts: the scheme an engine serves (``schemes``), its quantizers (``grid``), the served
checkpoint (``checkpoint``), the GPU formats' quantizers from their definitions (``formats``) and their layers as
the reference engine and the trainer emulate them (``emulated``).

The trainer side (the linear layers computed as the quantized engine computes them) is ``roundalign.kernels``'
``quantized`` and ``vllm_quant``; a profile carries the scheme (``Profile.quantization``). docs/quantization.md
is the guide. The names below load on first use: profiles import ``schemes``, and the command line's help must not
import torch.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "NONE": "roundalign.quant.schemes",
    "SCHEMES": "roundalign.quant.schemes",
    "Scheme": "roundalign.quant.schemes",
    "from_compressed_tensors": "roundalign.quant.schemes",
    "Quantized": "roundalign.quant.grid",
    "quantize_activations": "roundalign.quant.grid",
    "quantize_weight": "roundalign.quant.grid",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in ("checkpoint", "emulated", "formats", "grid", "schemes"):
        return importlib.import_module(f"roundalign.quant.{name}")
    if name not in _LAZY:
        raise AttributeError(f"module 'roundalign.quant' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
