"""The engines' own quantizers on fixed inputs, for tests/test_quant_formats.py. Runs in the producer's Python.

    python tests/quant_formats_producers.py vllm OUT.safetensors    # .venv-vllm: vLLM 0.32's reference quantizers
    python tests/quant_formats_producers.py verl OUT.safetensors    # .venv-verl: verl's blockwise FP8 export

The inputs come from ``inputs()`` (the test builds the same ones); the outputs are written with safetensors.
"""

from __future__ import annotations

import os
import sys

import torch


def inputs() -> dict[str, torch.Tensor]:
    """Weights and activations of several magnitudes, with all-zero blocks and values on the grids' ties."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 256, generator=g) * torch.logspace(-3, 1, 256)[None, :]  # magnitudes across binades
    x[0, :32] = 0.0  # an all-zero block of 32 (two of 16)
    x[1, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -2.5, -5.0, 7.0, 0.1, 3.0, 4.0, 0.0])
    w = (torch.randn(256, 384, generator=g) * 0.02).bfloat16()
    w[:128, :128] = 0  # an all-zero 128 x 128 tile
    return {"x": x, "w": w}


def vllm(out: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from safetensors.torch import save_file
    from vllm.model_executor.layers.quantization.utils import mxfp8_utils, nvfp4_emulation_utils

    x = inputs()["x"]
    gs = (448.0 * 6.0) / x.abs().amax().float()
    codes, scales = nvfp4_emulation_utils.ref_nvfp4_quant(x, gs, 16)
    dequantized = nvfp4_emulation_utils.ref_nvfp4_quant_dequant(x.bfloat16(), gs, 16)
    m8, s8 = mxfp8_utils._mxfp8_e4m3_quantize_torch(x)
    save_file({
        "nvfp4_codes": codes.contiguous(), "nvfp4_scales": scales.contiguous(), "nvfp4_qdq_bf16": dequantized,
        "mxfp8_codes": m8.float(), "mxfp8_scales": s8.contiguous(),
    }, out)  # fmt: skip


def verl(out: str) -> None:
    os.environ["VERL_DISABLE_TRITON_FP8"] = "1"  # the CPU path (the Triton kernel is the same arithmetic on a GPU)
    from safetensors.torch import save_file
    from verl.utils.kernel.fp8_kernel import scaled_fp8_blockwise

    codes, descale = scaled_fp8_blockwise(inputs()["w"], [128, 128])
    save_file({"fp8_codes": codes.float(), "fp8_descale": descale.contiguous()}, out)


if __name__ == "__main__":
    {"vllm": vllm, "verl": verl}[sys.argv[1]](sys.argv[2])
