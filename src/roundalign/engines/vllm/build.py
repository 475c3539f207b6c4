"""What vLLM build this is: its environment, version, CPU bf16 conversion, and what it resolved and built.

``engine_info`` records what vLLM resolved for this model and machine (compilation mode, custom ops, IR op
priority, attention backend and its ISA, the linear layers' kernel), because the rounding profile belongs to that
configuration, not to "vLLM". vLLM's CPU build, for example, runs ``weight_packed_linear`` on AMX CPUs but falls
back to torch's linear elsewhere ("Failed to create oneDNN linear"), and its attention ISA follows the CPU.
``build_info`` says the same of the build installed here without starting it, for choosing its profile.

Read against vLLM 0.32 (``vllm/v1/worker/cpu_model_runner.py``, ``vllm/v1/attention/backends/cpu_attn.py``); the
attribute walks in ``engine_info`` are defensive, recording ``None`` where another version keeps things elsewhere,
rather than failing a dump.
"""

from __future__ import annotations

import importlib.metadata

from roundalign.engines.host import cpu_model
from roundalign.errors import UserError

# Set before vLLM is imported (a value the user set wins). The engine core runs in this process (no worker process
# to start, and engine_info can read the model runner); a CPU KV cache of 1 GiB is ample for a dump; the process
# binds its OpenMP threads. VLLM_CPU_ATTN_SPLIT_KV=0: with more than one thread, vLLM's CPU attention splits a
# decode step's long KV ranges among its threads by the thread count and the whole batch's lengths, and merges the
# parts, which no trainer can replay (it does not know the step's batch); unsplit, each decoded row is the row a
# prefill computes, at any thread count (docs/kernels.md: the engine's thread count).
ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "auto",
    "VLLM_CPU_ATTN_SPLIT_KV": "0",
    "HF_HUB_OFFLINE": "1",
}


def _walk(obj, *names):
    for name in names:
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def _name(value) -> str:
    return getattr(value, "name", None) or str(value)


def detect_cpu_bf16_conversion(torch, device: str) -> str | None:
    """How vLLM's CPU C++ kernels convert fp32 to bf16 here. On x86 vLLM loads ``vllm._C`` where the CPU has
    AVX512-BF16 (``_mm512_cvtneps_pbh``: round to nearest even), else ``_C_AVX512`` or ``_C_AVX2``, whose vector
    code keeps the top 16 bits of the fp32 pattern (truncation). Elsewhere: not known (None)."""
    import platform

    if device != "cpu" or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    return "round_to_nearest" if torch.cpu._is_avx512_bf16_supported() else "truncate"


def engine_info(llm, enforce_eager: bool) -> dict:
    """What this vLLM runs: its configuration as resolved, and what the model runner actually built."""
    import torch
    import vllm

    config = llm.llm_engine.vllm_config
    cc = config.compilation_config
    info = {
        "engine": "vllm",
        "engine_version": vllm.__version__,
        "torch_version": torch.__version__,
        "device": str(config.device_config.device_type),
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_bf16_conversion": detect_cpu_bf16_conversion(torch, str(config.device_config.device_type)),
        "enforce_eager": enforce_eager,
        "compilation_mode": _name(getattr(cc, "mode", getattr(cc, "level", None))),
        "compile_backend": getattr(cc, "backend", None),
        "custom_ops": list(getattr(cc, "custom_ops", []) or []),
        "splitting_ops": list(getattr(cc, "splitting_ops", []) or []),
        "ir_op_priority": None,
        "enable_prefix_caching": _walk(config, "cache_config", "enable_prefix_caching"),
        "max_model_len": config.model_config.max_model_len,
        "logprobs_mode": str(config.model_config.logprobs_mode),
        "attention_backend": None,
        "linear_kernel": None,
        # The engine's OpenMP threads and whether its CPU attention splits KV among them (see ENVIRONMENT).
        "threads": torch.get_num_threads(),
        "attn_split_kv": _split_kv(),
    }
    priority = _walk(config, "kernel_config", "ir_op_priority")
    if priority is not None:
        info["ir_op_priority"] = {k: list(v) for k, v in vars(priority).items() if isinstance(v, list | tuple)}
    runner = _walk(llm.llm_engine, "engine_core", "engine_core", "model_executor", "driver_worker", "worker")
    runner = _walk(runner, "model_runner")
    if runner is None:  # the engine core runs in another process: only the configuration is known here
        return info
    groups = [g for gs in getattr(runner, "attn_groups", []) or [] for g in gs]
    if groups:
        info["attention_backend"] = groups[0].backend.__name__
    layer = runner.model.model.layers[0]
    impl = _walk(layer, "self_attn", "attn", "impl")
    if impl is not None:
        info["attention_impl"] = type(impl).__name__
    qkv = _walk(layer, "self_attn", "qkv_proj")
    if qkv is not None:
        # vLLM's CPU linear dispatch (vllm 0.32 keeps the chosen function on the layer as cpu_linear): packed
        # weights for oneDNN/AMX when the primitive could be built, else torch's own linear
        fn = getattr(qkv, "cpu_linear", None) or getattr(getattr(qkv, "quant_method", None), "_gemm_impl", None)
        info["linear_kernel"] = getattr(fn, "__qualname__", None) or type(getattr(qkv, "quant_method", None)).__name__
    return info


def _split_kv() -> bool | None:
    try:
        from vllm import envs

        return bool(envs.VLLM_CPU_ATTN_SPLIT_KV)
    except (ImportError, AttributeError):
        return None


def installed_version() -> str:
    """The vLLM installed in this Python (``vllm-cpu`` or ``vllm``); ``UserError`` naming the fix when none is."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise UserError(
        "--engine vllm runs vLLM in this process, and it is not installed here. Run roundalign train in the "
        "environment that has it (`make vllm` builds .venv-vllm with vllm-cpu 0.32: .venv-vllm/bin/roundalign "
        "train --engine vllm ...)"
    )


def build_info(enforce_eager: bool) -> dict:
    """What ``engine.json`` would say of the vLLM build in this environment, for choosing its profile."""
    import torch

    return {
        "engine": "vllm",
        "engine_version": installed_version(),
        "device": "cpu",
        "enforce_eager": enforce_eager,
        "cpu_bf16_conversion": detect_cpu_bf16_conversion(torch, "cpu"),
    }


__all__ = ["ENVIRONMENT", "build_info", "detect_cpu_bf16_conversion", "engine_info", "installed_version"]
