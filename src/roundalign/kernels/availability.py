"""Whether this model can run a profile's kernels here, checked once at ``apply`` time.

The engine kernels have requirements a profile name alone does not show (vLLM importable, a CPU model, a dense
model, a compiled forward only with vLLM's attention and GEMM inside it). ``apply`` calls ``check`` before it
patches anything, so that a model that cannot run them fails with an error that names the fix instead of midway
through a forward.
"""

from __future__ import annotations

from roundalign.errors import UserError
from roundalign.profiles import AttentionKernel, ForwardKernel, GemmKernel, Profile


def check(profile: Profile, model) -> None:
    """Raise a clear error, at ``apply`` time, where this model cannot run the profile's kernels here."""
    config = model.config
    if profile.quantization.emulated and profile.gemm is GemmKernel.VLLM_CPU:
        raise UserError(
            f"{profile.quantization} is a GPU format: vLLM's CPU build has no kernel for it, so the trainer cannot "
            f"take vLLM's. Its emulation runs under the reference engine's profile (vllm-reference-kernels+"
            f"quantization={profile.quantization}) or the aligned one (vllm+quantization={profile.quantization})"
        )
    if profile.forward is ForwardKernel.VLLM_CPU_COMPILED:
        if (profile.attention, profile.gemm) != (AttentionKernel.VLLM_CPU, GemmKernel.VLLM_CPU):
            raise UserError(
                f"forward='vllm-cpu-compiled' is vLLM's compiled forward, with vLLM's attention and GEMM inside it; "
                f"profile {profile.name!r} names attention={profile.attention!s}, gemm={profile.gemm!s}. Use "
                "attention='vllm-cpu' and gemm='vllm-cpu' (the vllm-0.32-cpu-kernels profile)"
            )
        if profile.quantization.quantized:
            eager = profile.name.replace("-compiled-kernels", "-eager-kernels")
            raise UserError(
                f"forward='vllm-cpu-compiled' computes vLLM's compiled bf16 forward; a quantized engine "
                f"({profile.quantization}) is reproduced in vLLM's enforce_eager mode only. Sample with "
                f"--enforce-eager and use the eager profile ({eager})"
            )
        from roundalign.kernels import graph

        graph.check(model)
    if profile.attention is AttentionKernel.VLLM_CPU or profile.gemm is GemmKernel.VLLM_CPU:
        from roundalign.kernels import vllm_cpu

        if profile.attention is AttentionKernel.VLLM_CPU:
            vllm_cpu.check_model(config)
        else:
            vllm_cpu.load()
        # "meta": a model built without storage, to be loaded on the CPU later (verl builds its actor so on every rank
        # but the first, and FSDP fills it from rank 0's weights).
        devices = {p.device.type for p in model.parameters()} - {"meta"}
        if devices - {"cpu"}:
            raise UserError(
                f"the vllm-cpu kernels run on the CPU; this model's parameters are on {sorted(devices)}. Use the "
                "profile without '-kernels' on a GPU (vLLM's CUDA kernels are not wired in yet: docs/kernels.md)"
            )
    if profile.gemm is not GemmKernel.TORCH and getattr(config, "num_experts", None):
        raise UserError(
            f"gemm={profile.gemm!s} covers dense models: the experts' GEMMs (vLLM's CPU MoE kernel cpu_fused_moe, the "
            "reference engine's expert loop) are not reproduced, so a MoE model would not be exact. Use gemm='torch' "
            "for Qwen3-MoE"
        )
