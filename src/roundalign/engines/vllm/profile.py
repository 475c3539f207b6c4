"""The trainer profile that matches the vLLM build installed here: its measured profile, with vLLM's kernels.

``train --engine vllm``, TRL's ``VllmRolloutFunc`` and the benchmarks ask this, so that the trainer's log-probs are
the sampler's bit for bit where that is possible on this CPU (docs/kernels.md says where and why).
"""

from __future__ import annotations

from roundalign.engines.vllm.build import build_info
from roundalign.profiles import PROFILES, for_engine


def trainer_profile(enforce_eager: bool) -> str:
    """The exact trainer for this build: in eager mode its measured profile with vLLM's kernels (``-kernels``); in
    the compiled mode also vLLM's compiled forward (``-compiled-kernels``), with the GEMM vLLM picks on this CPU;
    else the profile alone."""
    base = for_engine(build_info(enforce_eager))
    if not enforce_eager and f"{base}-compiled-kernels" in PROFILES:
        return f"{base}-compiled-kernels"
    return f"{base}-kernels" if f"{base}-kernels" in PROFILES else base


__all__ = ["trainer_profile"]
