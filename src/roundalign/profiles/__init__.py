"""Rounding profiles: where an engine rounds to bf16, as data.

A ``Profile`` names one rounding rule per element-wise region (RMSNorm, Qwen3's q/k norm, residual add, RoPE,
SwiGLU, MoE experts' SwiGLU), where RoPE's angles come from, and the attention, GEMM and forward kernels the
trainer runs: HF's own by default, or the engine's (``roundalign.kernels``), which is what makes a trainer bitwise
equal to the engine rather than only closer to it.

Profiles are data, not code paths: an engine build is described by the rules it follows, so a new build is a new
table entry (or a ``roundalign fit`` file), and two profiles with the same rules compute the same bits whatever
their names. ``roundalign.apply(model, profile)`` turns a profile into patched modules; nothing else in the package
branches on engine names.

    rules.py     the rule enums (one per region and kernel), RoPE's rule types, and each rule's formula
    profile.py   ``Profile``: validation, ``replace``, JSON (``save``/``load``), ``describe``
    builtin.py   the built-in profiles (``PROFILES``), ``list_profiles`` and ``get_profile``
    builds.py    the built-in profile for an engine build (``for_engine``, ``describe_engine``)
    cli.py       ``roundalign profiles`` (imported only by the command line)
"""

from roundalign.profiles.builds import ENGINE_BUILDS, cpu_bf16_conversion, describe_engine, for_engine
from roundalign.profiles.builtin import PROFILES, get_profile, list_profiles
from roundalign.profiles.profile import Profile
from roundalign.profiles.rules import (
    KERNELS,
    REGIONS,
    RULES,
    SEARCHED_ROPE_RULES,
    AttentionKernel,
    CosSinDtype,
    ForwardKernel,
    GemmKernel,
    HeadDimRope,
    QKNormRule,
    ResidualRule,
    RMSNormRule,
    RopeAngles,
    RopeRounding,
    RopeRule,
    SwiGLURule,
    formula,
)

__all__ = [
    "ENGINE_BUILDS",
    "KERNELS",
    "PROFILES",
    "REGIONS",
    "RULES",
    "SEARCHED_ROPE_RULES",
    "AttentionKernel",
    "CosSinDtype",
    "ForwardKernel",
    "GemmKernel",
    "HeadDimRope",
    "Profile",
    "QKNormRule",
    "RMSNormRule",
    "ResidualRule",
    "RopeAngles",
    "RopeRounding",
    "RopeRule",
    "SwiGLURule",
    "cpu_bf16_conversion",
    "describe_engine",
    "for_engine",
    "formula",
    "get_profile",
    "list_profiles",
]
