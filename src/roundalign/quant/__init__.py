"""Quantized rollouts: the scheme an engine serves (``schemes``), its quantizers (``grid``) and the served
checkpoint (``checkpoint``).

The trainer side (the linear layers computed as the quantized engine computes them) is ``roundalign.kernels``'
``quantized`` and ``vllm_quant``; a profile carries the scheme (``Profile.quantization``). docs/quantization.md
is the guide.
"""

from roundalign.quant.grid import Quantized, quantize_activations, quantize_weight
from roundalign.quant.schemes import NONE, SCHEMES, Scheme, from_compressed_tensors

__all__ = [
    "NONE",
    "SCHEMES",
    "Quantized",
    "Scheme",
    "from_compressed_tensors",
    "quantize_activations",
    "quantize_weight",
]
