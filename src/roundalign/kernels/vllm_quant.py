"""vLLM's quantized CPU linear layers, built on a stand-in layer exactly as vLLM builds them from a checkpoint.

For a quantized rollout the engine computes each linear with its compressed-tensors scheme's kernel: the int8 W8A8
kernel (``CPUInt8ScaledMMLinearKernel``: oneDNN's s8s8 GEMM with vLLM's per-token activation quantizer, or, on AMX
CPUs, its fused ``int8_scaled_mm_with_quant``) or the 4-bit W4A16 kernel (``CPUWNA16LinearKernel``:
``cpu_gemm_wna16``). Which one, and with which ISA, vLLM decides per CPU and shape. So the trainer does not call
the ops itself: it creates vLLM's own scheme object (``CompressedTensorsW8A8Int8`` / ``CompressedTensorsWNA16``),
lets it create its parameters on a stand-in module, fills them with the served tensors in the checkpoint's layout
(``quant.checkpoint.tensors`` of the parts' rows one after the other, as vLLM's weight loader fills a fused q/k/v or
gate/up), runs its
``process_weights_after_loading`` (packing, oneDNN handles) and calls its ``apply_weights``: whatever vLLM would
compute on this CPU. Read against vLLM 0.32 (``compressed_tensors/schemes``, ``kernels/linear/scaled_mm/cpu.py``,
``kernels/linear/mixed_precision/cpu.py``).
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

from roundalign.errors import UserError
from roundalign.kernels import vllm_cpu
from roundalign.quant import checkpoint
from roundalign.quant.grid import Quantized
from roundalign.quant.schemes import Scheme


@contextlib.contextmanager
def _one_rank():
    """vLLM's parameters record their tensor-parallel rank at creation, which needs its process groups; a stand-in
    layer is the whole layer (one rank of one), so the two lookups answer that, for the creation only."""
    import vllm.model_executor.parameter as parameter

    with (
        mock.patch.object(parameter, "get_tensor_model_parallel_rank", lambda: 0),
        mock.patch.object(parameter, "get_tensor_model_parallel_world_size", lambda: 1),
    ):
        yield


@contextlib.contextmanager
def _fp8_config():
    """What vLLM's FP8 scheme reads while it is built: the current vLLM config (its ``enforce_eager`` compilation
    mode, under which the kernel pads activations to 17 rows), the model's dtype from it, and the default dtype,
    which it takes as its output dtype: bf16, as the engine serves it."""
    from types import SimpleNamespace

    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.config.compilation import CompilationMode
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w8a8_fp8 as fp8,
    )

    config = VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.NONE))
    served = SimpleNamespace(
        model_config=SimpleNamespace(dtype=torch.bfloat16), compilation_config=config.compilation_config
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with set_current_vllm_config(config), mock.patch.object(fp8, "get_current_vllm_config", lambda: served):
            yield
    finally:
        torch.set_default_dtype(default)


def _scheme(scheme: Scheme):
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        CompressedTensorsW8A8Int8,
        CompressedTensorsWNA16,
    )

    if scheme.weights == "fp8" and scheme.activations == "fp8-token":
        from compressed_tensors.quantization import QuantizationArgs
        from vllm.model_executor.layers.quantization.compressed_tensors.schemes import CompressedTensorsW8A8Fp8

        args = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False)
        return CompressedTensorsW8A8Fp8(args, is_static_input_scheme=False)
    if scheme.weights == "int8" and scheme.activations == "int8-token":
        return CompressedTensorsW8A8Int8(scheme.strategy, is_static_input_scheme=False, input_symmetric=True)
    if scheme.weights == "int4" and scheme.weight_only:
        return CompressedTensorsWNA16(
            strategy=scheme.strategy, num_bits=4, group_size=scheme.group_size, symmetric=scheme.symmetric
        )
    raise UserError(f"the exact trainer has no vLLM CPU kernel for {scheme}; use gemm='torch' (quantization-aligned)")


def _load(param, loaded):
    param.data.copy_(loaded)


def layer(scheme: Scheme, parts: list[Quantized], bias: torch.Tensor | None, dtype=torch.bfloat16):
    """vLLM's scheme object and its processed stand-in layer for the fused ``parts`` (each a projection's served
    weight, in the order vLLM fuses them): ``(method, layer)``, computed by ``method.apply_weights(layer, x, bias)``."""
    vllm_cpu.load()
    with _fp8_config() if scheme.weights == "fp8" else contextlib.nullcontext():
        return _layer(scheme, parts, bias, dtype)


def _layer(scheme: Scheme, parts: list[Quantized], bias: torch.Tensor | None, dtype):
    method = _scheme(scheme)
    widths = [p.codes.shape[0] for p in parts]
    inputs = parts[0].codes.shape[1]
    stand_in = torch.nn.Module()
    with _one_rank():
        method.create_weights(
            stand_in, output_partition_sizes=widths, input_size_per_partition=inputs, output_size=sum(widths),
            input_size=inputs, params_dtype=dtype, weight_loader=_load,
        )  # fmt: skip
    with torch.no_grad():  # the fused layer's checkpoint tensors, each into vLLM's parameter of that name
        for name, tensor in checkpoint.tensors("layer", Quantized.cat(parts), scheme).items():
            getattr(stand_in, name.removeprefix("layer.")).copy_(tensor)
    bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
    stand_in.register_parameter("bias", bias)
    method.process_weights_after_loading(stand_in)
    return method, stand_in


def linear(scheme: Scheme, parts: list[Quantized], bias: torch.Tensor | None, dtype=torch.bfloat16):
    """vLLM's layer for the fused ``parts``, as a function ``x (rows, in) -> (rows, out)``."""
    method, stand_in = layer(scheme, parts, bias, dtype)
    return lambda x: method.apply_weights(stand_in, x, stand_in.bias)


__all__ = ["layer", "linear"]
