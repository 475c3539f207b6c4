"""An independent producer's checkpoint: compressed-tensors (the library llm-compressor writes with) quantizes a bf16
model, for tests/test_quant_vllm.py. Runs in the engine's Python, where compressed-tensors is installed (vLLM
depends on it).

    python tests/quant_producer.py MODEL_DIR SCHEME OUT_DIR

Follows llm-compressor's recipe for a round-to-nearest scheme: the quantization config on every Linear but the
lm_head (``apply_quantization_config``), each weight's scale and zero point from its min and max in the model's
dtype (``calculate_qparams``, as the min-max observer computes them), then compressed-tensors' own compressor
(``ModelCompressor.compress_model``) and ``save_pretrained``. Nothing of roundalign's is used.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams
from transformers import AutoModelForCausalLM

SCHEMES = {
    "w8a8-int8": (
        QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True, dynamic=False),
        QuantizationArgs(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True),
    ),
    "fp8": (
        QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False),
        QuantizationArgs(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True),
    ),
    "w4a16": (QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=128, symmetric=True), None),
    "w4a16-g32-zp": (QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=32, symmetric=False), None),
}


def main(model_dir: str, scheme: str, out: str) -> None:
    weights, activations = SCHEMES[scheme]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    config = QuantizationConfig(
        config_groups={
            "group_0": QuantizationScheme(targets=["Linear"], weights=weights, input_activations=activations)
        },
        ignore=["lm_head"],
        quantization_status=QuantizationStatus.INITIALIZED,
    )
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is None:
                continue
            w = module.weight
            if weights.strategy == "group":
                w = w.view(w.shape[0], -1, weights.group_size)
            scale, zero_point = calculate_qparams(w.amin(-1), w.amax(-1), weights)
            module.weight_scale.copy_(scale.view(module.weight_scale.shape))
            if not weights.symmetric:
                module.weight_zero_point.copy_(zero_point.view(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    compressor.update_config(out)
    for f in Path(model_dir).iterdir():
        if f.name.startswith("tokenizer") or f.name == "generation_config.json":
            shutil.copyfile(f, Path(out) / f.name)


if __name__ == "__main__":
    main(*sys.argv[1:4])
