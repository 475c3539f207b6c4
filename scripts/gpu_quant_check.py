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
  the fraction of equal outputs and the largest difference say how far the emulation is from the hardware;
- ``emulated_linear/*``: each emulated GPU format's layer (``roundalign.quant.emulated``) run on ``--device``: the
  quantizers and blockwise FP8's exact slice sums are device-independent; the bf16 GEMM of the NVFP4 and MX
  emulations is the device's own (cuBLAS sums in another order than the CPU's GEMM);
- ``fp8_block_scaled_mm``: blockwise FP8 (1 x 128 activations, 128 x 128 weights) through ``torch._scaled_mm``'s
  block-scaled path (Hopper, what vLLM's ``BlockWiseTorchFP8ScaledMMLinearKernel`` calls) against the definition
  (``emulated.block_gemm``): how far the hardware's FP8 accumulation is from exact slice sums;
- ``trainer/*``: the quantization-aligned trainer (``roundalign.apply(model, "vllm+quantization=SCHEME")``) on a
  small random Qwen3, its log-probs on ``--device`` against the CPU's: what an aligned trainer on the GPU keeps of
  the CPU's bits, per scheme.

A check that fails to run on the device records its error instead of a comparison.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from roundalign.quant import SCHEMES, emulated, formats
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


EMULATED = ("nvfp4", "nvfp4-te", "mxfp4", "mxfp4-vllm", "mxfp8", "fp8-block")


def _guarded(fn) -> dict:
    """``fn()``'s comparison, or the error that stopped it (a device without a kernel for an op)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001: recorded, so that one missing kernel does not hide the other checks
        return {"equal": False, "error": f"{type(exc).__name__}: {exc}"[:500]}


def _on(q, device: str):
    """A weight's served copy (``Blocked``) moved to ``device``."""
    import dataclasses

    gs = None if q.global_scale is None else q.global_scale.to(device)
    return dataclasses.replace(q, codes=q.codes.to(device), scales=q.scales.to(device), global_scale=gs)


def emulated_checks(device: str) -> dict:
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(32, 512, generator=g) * 0.5).bfloat16()
    w = torch.randn(256, 512, generator=g) * 0.02
    out = {}
    for name in EMULATED:
        scheme = SCHEMES[name]
        q = emulated.quantize_weight(w, scheme)
        layer = emulated.linear(scheme)
        out[name] = _guarded(lambda layer=layer, q=q: compare(layer(x, q), layer(x.to(device), _on(q, device))))
    return out


def block_scaled_mm_check(device: str) -> dict:
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(64, 512, generator=g) * 0.5).bfloat16()
    w = torch.randn(256, 512, generator=g) * 0.02
    codes, scale = emulated.quantize_activations_1x128(x)
    q = formats.fp8_blockwise(w)
    cpu = emulated.block_gemm(codes, scale, q.codes, q.scales).to(torch.bfloat16)
    if not device.startswith("cuda"):
        return compare(cpu, emulated.block_gemm(codes.to(device), scale.to(device), q.codes.to(device),
                                                q.scales.to(device)).to(torch.bfloat16))  # fmt: skip

    def hardware():
        a = codes.to(device).to(torch.float8_e4m3fn)
        b = q.codes.to(device).to(torch.float8_e4m3fn)
        # torch._scaled_mm's DeepSeek-style block path: scale_a (M, K/128) column-major, scale_b (K/128, N/128)
        scale_a = scale.to(device).t().contiguous().t()
        scale_b = q.scales.to(device).t().contiguous()
        dev = torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
        return compare(cpu, dev[0] if isinstance(dev, tuple) else dev)

    return _guarded(hardware)


def trainer_checks(device: str) -> dict:
    import transformers

    import roundalign

    config = transformers.Qwen3Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=128,
    )  # fmt: skip
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(6))
    out = {}
    for name in ("w8a8-int8", "fp8", "w4a16-g32", *EMULATED):

        def run(name=name):
            logps = []
            for dev in ("cpu", device):
                torch.manual_seed(0)
                model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
                roundalign.apply(model.to(dev), f"vllm+quantization={name}")
                with torch.no_grad():
                    logps.append(model(ids.to(dev)).logits.float().log_softmax(-1))
            return compare(*logps)

        out[name] = _guarded(run)
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
        "emulated_linear": emulated_checks(args.device),
        "fp8_block_scaled_mm": block_scaled_mm_check(args.device),
        "trainer": trainer_checks(args.device),
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
