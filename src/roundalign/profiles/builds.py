"""Which built-in profile an engine build gets: the measured builds by name, else the engine's source-derived one.

The input is a dump's ``engine.json`` (``roundalign dump``): engine, version, device, ``enforce_eager`` and, on a
CPU, how its kernels convert fp32 to bf16. Profiles are returned by name (``roundalign.profiles.builtin``).
"""

from __future__ import annotations

# The built-in profile per measured engine build:
# (engine, version prefix, device, enforce_eager, CPU bf16 conversion or None for any) -> profile.
# Builds not listed fall back to the engine's source-derived profile; `roundalign calibrate` measures one.
ENGINE_BUILDS = {
    ("vllm", "0.32", "cpu", False, None): "vllm-0.32-cpu",  # Inductor's code rounds to nearest on every CPU
    ("vllm", "0.32", "cpu", True, "round_to_nearest"): "vllm-0.32-cpu-eager",
    ("vllm", "0.32", "cpu", True, "truncate"): "vllm-0.32-cpu-eager-nobf16",
}


def cpu_bf16_conversion(info: dict) -> str | None:
    """How the engine's CPU kernels convert fp32 to bf16: ``engine.json``'s ``cpu_bf16_conversion``, or, in a dump
    written before that field existed, ``truncate`` where the CPU capability shows no AVX-512 at all (so no
    AVX512-BF16), else ``round_to_nearest``, the conversion of the AMX machines the first profiles were measured on."""
    if info.get("device") != "cpu":
        return None
    if info.get("cpu_bf16_conversion"):
        return str(info["cpu_bf16_conversion"])
    return "truncate" if str(info.get("cpu_capability", "")).upper() in ("AVX2", "DEFAULT") else "round_to_nearest"


def for_engine(info: dict) -> str:
    """The built-in profile for the engine build a dump's ``engine.json`` describes (``roundalign dump``)."""
    engine, version = info.get("engine"), str(info.get("engine_version", ""))
    device, eager = str(info.get("device", "cuda")), bool(info.get("enforce_eager"))
    conversion = cpu_bf16_conversion(info)
    for (e, v, d, eg, conv), name in ENGINE_BUILDS.items():
        if (e, d, eg) == (engine, device, eager) and (version == v or version.startswith(v + ".")):
            if conv is None or conv == conversion:
                return name
    if engine == "vllm":
        return "vllm-eager" if eager else "vllm"
    return "sglang" if engine == "sglang" else "vllm"


def describe_engine(info: dict) -> str:
    """One line: engine, version, mode, device (``vllm 0.32.0, enforce_eager, cpu (AMD EPYC, AVX2, bf16 by
    truncation)``)."""
    mode = "enforce_eager" if info.get("enforce_eager") else "default mode"
    where = info.get("device", "?")
    truncates = "bf16 by truncation" if cpu_bf16_conversion(info) == "truncate" else None
    detail = [info.get("cpu"), info.get("cpu_capability"), truncates] if where == "cpu" else [info.get("gpu")]
    detail = ", ".join(str(x) for x in detail if x)
    head = f"{info.get('engine')} {info.get('engine_version', '?')}, {mode}, {where}"
    return head + (f" ({detail})" if detail else "")
