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
    # 64 tiles of 128 x 128 at magnitudes a factor of 2^(1/4) apart: the descale 1 / (448 / amax) is one rounding
    # from another for about a quarter of tiles, depending on how 448 / amax is computed.
    tiles = torch.exp2(torch.arange(64.0) / 4 - 12).view(8, 8).repeat_interleave(128, 0).repeat_interleave(128, 1)
    return {"x": x, "w": w, "w_tiles": (torch.randn(1024, 1024, generator=g) * tiles).bfloat16()}


def vllm(out: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from safetensors.torch import save_file
    from vllm.model_executor.layers.quantization.utils import mxfp8_utils, nvfp4_emulation_utils

    x = inputs()["x"]
    gs = (448.0 * 6.0) / x.abs().amax().float()
    codes, scales = nvfp4_emulation_utils.ref_nvfp4_quant(x, gs, 16)
    dequantized = nvfp4_emulation_utils.ref_nvfp4_quant_dequant(x.bfloat16(), gs, 16)
    m8, s8 = mxfp8_utils._mxfp8_e4m3_quantize_torch(x)
    # vLLM's emulated NVFP4 linear (run_nvfp4_emulations, its torch path), on the weight as vLLM loads it: the E2M1
    # codes packed two to a byte, the E4M3 block scales, the global scale inverted at load. Each token's activations
    # get their own global scale (a (rows, 1, 1) tensor, which vLLM's code broadcasts).
    w = inputs()["w"].t().contiguous()  # (384 outputs, 256 inputs)
    gs_w = (448.0 * 6.0) / w.abs().amax().float()
    w_codes, w_scales = nvfp4_emulation_utils.ref_nvfp4_quant(w.float(), gs_w, 16)
    gs_x = ((448.0 * 6.0) / x.bfloat16().abs().amax(-1).float())[:, None, None]
    nvfp4_out = nvfp4_emulation_utils.run_nvfp4_emulations(
        x.bfloat16(), gs_x, _pack_e2m1(w_codes), w_scales.to(torch.float8_e4m3fn), 1.0 / gs_w, swizzle=False
    )
    # vLLM's dynamic 1 x 128 FP8 group quantizer (blockwise FP8 activations), its native path (a CustomOp, which
    # needs a running engine's config to be built: its method is called on the three attributes it reads).
    from types import SimpleNamespace

    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8

    group = SimpleNamespace(group_size=128, use_ue8m0=False, column_major_scales=False)
    q8, g8 = QuantFP8._quantize_group_native(group, x)
    save_file({
        "nvfp4_codes": codes.contiguous(), "nvfp4_scales": scales.contiguous(), "nvfp4_qdq_bf16": dequantized,
        "mxfp8_codes": m8.float(), "mxfp8_scales": s8.contiguous(), "nvfp4_linear_bf16": nvfp4_out.contiguous(),
        "fp8_1x128_codes": q8.float().contiguous(), "fp8_1x128_scales": g8.contiguous(),
    }, out)  # fmt: skip


def _pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 values (fp32) as vLLM's packed uint8: a sign bit and the value's index, two to a byte, the first in the
    low four bits."""
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    index = (codes.abs()[..., None] == table).int().argmax(-1)
    nibbles = (index | ((codes < 0).int() << 3)).to(torch.uint8)
    return (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).contiguous()


def verl(out: str) -> None:
    os.environ["VERL_DISABLE_TRITON_FP8"] = "1"  # the CPU path (the Triton kernel is the same arithmetic on a GPU)
    from safetensors.torch import save_file
    from verl.utils.kernel.fp8_kernel import scaled_fp8_blockwise

    out_tensors = {}
    for key in ("w", "w_tiles"):
        codes, descale = scaled_fp8_blockwise(inputs()[key], [128, 128])
        out_tensors |= {f"{key}_fp8_codes": codes.float(), f"{key}_fp8_descale": descale.contiguous()}
    save_file(out_tensors, out)


if __name__ == "__main__":
    {"vllm": vllm, "verl": verl}[sys.argv[1]](sys.argv[2])
