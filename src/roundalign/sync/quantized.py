"""The served copy of a quantized engine: the trainer's weights exported into the engine's format.

A quantized sampler serves the policy on an int8, int4 or FP8 grid. ``export_quantized`` is the whole export for
one sync: the fp32 master rounded to the bf16 copy (round to nearest even, as ``Exporter("rne")`` exports it), then
quantized as the format's producer quantizes that copy (``roundalign.quant``: the default a checkpoint, an
independent producer and vLLM's own loader all start from), into the tensors a compressed-tensors checkpoint holds;
``write_quantized`` writes that checkpoint for ``vllm.LLM``. A running vLLM takes the same weights in place with
``roundalign.engines.vllm.reload.reload``. docs/quantization.md has the formats and what was measured.
"""

from __future__ import annotations

from pathlib import Path

import torch

from roundalign.quant import checkpoint
from roundalign.quant.schemes import Scheme


def export_quantized(master: dict[str, torch.Tensor], scheme: str | Scheme) -> dict[str, torch.Tensor]:
    """The checkpoint tensors the engine serves for ``master`` (HF-named, fp32 or bf16) in ``scheme``; for a scheme
    vLLM quantizes itself at load (``fp8-online``), the bf16 copy it loads."""
    return checkpoint.served_state_dict(master, Scheme.parse(scheme))  # quantizes the RNE bf16 cast


def write_quantized(
    model_dir: str | Path, out_dir: str | Path, scheme: str | Scheme, master: dict | None = None
) -> Path:
    """A compressed-tensors checkpoint of ``master`` (default: ``model_dir``'s weights) in ``scheme``, with
    ``model_dir``'s config and tokenizer, for ``vllm.LLM(out_dir)``."""
    return checkpoint.write(model_dir, out_dir, Scheme.parse(scheme), state_dict=master)


__all__ = ["export_quantized", "write_quantized"]
