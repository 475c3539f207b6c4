"""The trainer profile that matches the vLLM build installed here: its measured profile, with vLLM's kernels.

``train --engine vllm``, TRL's ``VllmRolloutFunc`` and the benchmarks ask this, so that the trainer's log-probs are
the sampler's bit for bit where that is possible on this CPU (docs/kernels.md says where and why).
"""

from __future__ import annotations

from roundalign.engines.vllm.build import build_info
from roundalign.profiles import PROFILES, for_engine


def trainer_profile(enforce_eager: bool) -> str:
    """The exact trainer for this build: in eager mode its measured profile with vLLM's kernels (``-kernels``); in
    the compiled mode also vLLM's compiled forward (``-compiled-kernels``) where vLLM's GEMM is torch's on this CPU
    (elsewhere ``-kernels``, which is not exact there: docs/kernels.md); else the profile alone."""
    base = for_engine(build_info(enforce_eager))
    if not enforce_eager and f"{base}-compiled-kernels" in PROFILES and torch_gemm():
        return f"{base}-compiled-kernels"
    return f"{base}-kernels" if f"{base}-kernels" in PROFILES else base


def torch_gemm() -> bool:
    """Whether vLLM's CPU GEMM dispatch falls back to torch's here, for small and large weights alike."""
    from roundalign.kernels import vllm_cpu

    return all(vllm_cpu.gemm_kind(shape) == "torch" for shape in ((64, 64), (4096, 4096)))


__all__ = ["torch_gemm", "trainer_profile"]
