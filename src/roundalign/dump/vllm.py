"""Sample with a real vLLM, score the same sequences again in prefill, and say what the engine ran.

Runs inside the engine's Python. Two passes on one ``LLM``:

1. ``generate`` with ``SamplingParams(logprobs=0)``: the sampled token's log-prob at every step, as the sampler
   returns it to an RL framework (``logprobs_mode="raw_logprobs"``: before temperature and top-p, the quantity a
   trainer's ``log_softmax`` computes).
2. Each prompt + completion sent back as a prompt with ``prompt_logprobs=0`` and ``max_tokens=1``: the log-prob of
   every completion token from one prefill forward.

``engine_info`` records what vLLM resolved for this model and machine (compilation mode, custom ops, IR op
priority, attention backend and its ISA, the linear layers' kernel), because the rounding profile belongs to that
configuration, not to "vLLM". vLLM 0.32's CPU build, for example, runs ``weight_packed_linear`` on AMX CPUs but falls
back to torch's linear elsewhere ("Failed to create oneDNN linear"), and its attention ISA follows the CPU.

Read against vLLM 0.32 (``vllm/entrypoints/llm.py`` ``LLM``, ``vllm/sampling_params.py``, ``vllm/v1/worker/
cpu_model_runner.py``, ``vllm/v1/attention/backends/cpu_attn.py``); the attribute walks in ``engine_info`` are
defensive, recording ``None`` where another version keeps things elsewhere, rather than failing a dump.
"""

from __future__ import annotations

import os
import platform
import time

from roundalign.rollouts.record import Rollout

# Set before vLLM is imported. The engine core runs in this process (no worker process to start, and engine_info
# can read the model runner); a CPU KV cache of 1 GiB is ample for a dump; the process binds its OpenMP threads.
ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "auto",
    "HF_HUB_OFFLINE": "1",
}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _walk(obj, *names):
    for name in names:
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def _name(value) -> str:
    return getattr(value, "name", None) or str(value)


def _cpu_bf16_conversion(torch, device: str) -> str | None:
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
        "cpu": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_bf16_conversion": _cpu_bf16_conversion(torch, str(config.device_config.device_type)),
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


def _params(**kw):
    from vllm import SamplingParams

    return SamplingParams(**kw)


def run(cfg, log=print) -> tuple[list[Rollout], list[list[float]], dict]:
    """Sample ``cfg.num_samples`` completions and score them in prefill. Returns (rollouts, prefill, info)."""
    for key, value in ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    t0 = time.perf_counter()
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=cfg.model,
        dtype="bfloat16",
        logprobs_mode="raw_logprobs",
        max_model_len=cfg.max_model_len,
        enforce_eager=cfg.enforce_eager,
        seed=cfg.seed,
        gpu_memory_utilization=cfg.memory_fraction,
    )
    started = time.perf_counter()
    log(f"vllm engine started in {started - t0:.1f} s")
    prompts = cfg.prompt_ids(llm.get_tokenizer())
    sampling = _params(
        n=1,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_tokens=cfg.max_tokens,
        seed=cfg.seed,
        logprobs=0,
        ignore_eos=cfg.ignore_eos,
    )
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
    rollouts = []
    for out in outs:
        c = out.outputs[0]
        ids = list(c.token_ids)
        lps = [float(step[tok].logprob) for step, tok in zip(c.logprobs, ids, strict=True)]
        rollouts.append(Rollout(list(out.prompt_token_ids), ids, lps, c.finish_reason))
    sampled = time.perf_counter()
    tokens = sum(len(r.token_ids) for r in rollouts)
    log(f"sampled {len(rollouts)} completions, {tokens} tokens, in {sampled - started:.1f} s")
    # Prefill: prompt_logprobs[j] is the log-prob of position j's token given positions < j (None at j = 0).
    score = _params(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    seqs = [r.prompt_token_ids + r.token_ids for r in rollouts]
    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], score, use_tqdm=False)
    prefill = []
    for r, out in zip(rollouts, outs, strict=True):
        n = len(r.prompt_token_ids)
        steps = out.prompt_logprobs[n:]
        prefill.append([float(step[tok].logprob) for step, tok in zip(steps, r.token_ids, strict=True)])
    done = time.perf_counter()
    log(f"scored them in prefill in {done - sampled:.1f} s")
    info = engine_info(llm, cfg.enforce_eager)
    info["timings_s"] = {
        "engine_start": round(started - t0, 2),
        "sample": round(sampled - started, 2),
        "prefill": round(done - sampled, 2),
    }
    return rollouts, prefill, info
