"""The quantized paths on a CUDA GPU against this machine's CPU results: what holds bit for bit, what does not.

    python scripts/gpu_quant_check.py --out gpu-quant.json              # on a machine with a CUDA GPU and torch
    python scripts/gpu_quant_check.py --device cpu --out /tmp/cpu.json  # the same checks, CPU against CPU (a smoke run)

Not yet run on a GPU (docs/quantization.md). Each check computes one thing on the CPU and on ``--device`` from the
same inputs and records whether the results are equal bit for bit, and if not, how far apart:

- ``formats/*``: the GPU formats' quantizers (``roundalign.quant.formats``: NVFP4 in both conventions, MXFP4 in its
  three roundings, MXFP8, blockwise FP8): the same torch operations, so equal unless a device rounds ``log2``,
  ``exp2`` or the FP8 cast differently;
- ``grid_export/*``: Fair Cast onto the W8A8 and W4A16 grids (``Exporter(sync, scheme=)``): on the CPU the compiled
  Threefry kernel, on the GPU the same stream in torch operations; equal by construction of the stream;
- ``int8_linear``: vLLM's W8A8 layer as ``quant.grid.int8_linear`` computes it, with ``torch._int_mm``: the integer
  GEMM is exact on any device, so equal unless the fp32 epilogue differs;
- ``fp8_linear``: the CPU emulation of ``torch._scaled_mm`` (both operands upcast, an fp32 GEMM) against the GPU's
  ``torch._scaled_mm`` (hardware FP8 on Hopper and later, accumulating in its own order): not expected to be equal;
  the fraction of equal outputs and the largest difference say how far the emulation is from the hardware.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from roundalign.quant import SCHEMES, formats
from roundalign.quant.grid import fp8_linear, int8_linear, quantize_activations_fp8, quantize_weight
from roundalign.sync import Exporter


def compare(cpu: torch.Tensor, dev: torch.Tensor) -> dict:
    a, b = cpu.detach().float(), dev.detach().cpu().float()
    same = a == b
    both_nan = a.isnan() & b.isnan()
    diff = (a - b).abs()[~(same | both_nan)]
    return {
        "equal": bool((same | both_nan).all()),
        "equal_fraction": float((same | both_nan).float().mean()),
        "max_abs_diff": float(diff.max()) if diff.numel() else 0.0,
    }


def formats_checks(device: str) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 512, generator=g) * torch.logspace(-3, 1, 512)[None, :]
    w = torch.randn(256, 384, generator=g) * 0.02
    out = {}
    cases = {
        "nvfp4-vllm": lambda t: formats.nvfp4(t, convention="vllm"),
        "nvfp4-te": lambda t: formats.nvfp4(t, convention="te"),
        "mxfp4-ocp": lambda t: formats.mxfp4(t, "ocp"),
        "mxfp4-ocp-even": lambda t: formats.mxfp4(t, "ocp-even"),
        "mxfp4-vllm": lambda t: formats.mxfp4(t, "vllm"),
        "mxfp8": formats.mxfp8,
    }
    for name, fn in cases.items():
        c, d = fn(x), fn(x.to(device))
        out[name] = {"codes": compare(c.codes, d.codes), "scales": compare(c.scales, d.scales)}
    c, d = formats.fp8_blockwise(w), formats.fp8_blockwise(w.to(device))
    out["fp8-blockwise"] = {"codes": compare(c.codes, d.codes), "scales": compare(c.scales, d.scales)}
    return out


def grid_export_checks(device: str) -> dict:
    g = torch.Generator().manual_seed(1)
    master = {"model.layers.0.mlp.up_proj.weight": torch.randn(256, 512, generator=g) * 0.02}
    out = {}
    for scheme in ("w8a8-int8", "w4a16-g32-zp"):
        for sync in ("rne", "stochastic", "error-feedback"):
            a, b = Exporter(sync, seed=3, scheme=scheme), Exporter(sync, seed=3, scheme=scheme)
            on_dev = {k: v.to(device) for k, v in master.items()}
            results = []
            for _ in range(2):  # the second export: the noise step / the residual carried
                cpu, dev = a.export(master), b.export(on_dev)
                results.append(all(compare(cpu[k], dev[k])["equal"] for k in cpu))
            out[f"{scheme}/{sync}"] = {"equal": all(results)}
    return out


def linear_checks(device: str) -> dict:
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(32, 512, generator=g) * 0.5).bfloat16()
    w = torch.randn(256, 512, generator=g) * 0.02
    out = {}
    q = quantize_weight(w, SCHEMES["w8a8-int8"])
    on_dev = type(q)(q.codes.to(device), q.scale.to(device), None)
    out["int8_linear"] = compare(int8_linear(x, q), int8_linear(x.to(device), on_dev))
    q8 = quantize_weight(w, SCHEMES["fp8"])
    cpu = fp8_linear(x, q8)
    if device.startswith("cuda"):
        codes, scale = quantize_activations_fp8(x.to(device))
        weight = q8.codes.to(device)
        dev = torch._scaled_mm(
            codes, weight.t(), scale_a=scale, scale_b=q8.scale.float().view(1, -1).to(device), out_dtype=torch.bfloat16
        )
    else:
        dev = fp8_linear(x.to(device), type(q8)(q8.codes.to(device), q8.scale.to(device), None))
    out["fp8_linear"] = compare(cpu, dev)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="the device to check against the CPU (default cuda)")
    ap.add_argument("--out", type=Path, required=True, help="write the results here (JSON)")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("no CUDA device here; run on a GPU machine, or pass --device cpu for a smoke run")
    result = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
        "torch": torch.__version__,
        "formats": formats_checks(args.device),
        "grid_export": grid_export_checks(args.device),
        "linear": linear_checks(args.device),
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
