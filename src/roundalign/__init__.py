"""roundalign: make an RL trainer round to bf16 exactly where its rollout engine does.

    import roundalign
    roundalign.apply(model, profile="vllm")   # HF Qwen2/Qwen3/Qwen3-MoE/Llama in bf16
    roundalign.revert(model)                  # stock HF numerics again
    roundalign.models.path("tiny-qwen3")      # the small model that ships inside the package

The engine (``roundalign.engine``) and the audit (``roundalign.probe``) are imported on use.
"""

from roundalign import models
from roundalign.patch import apply, patched_profile, revert, supported_model_types
from roundalign.profiles import Profile, get_profile, list_profiles

__all__ = [
    "Profile", "apply", "get_profile", "list_profiles", "models", "patched_profile", "revert", "supported_model_types",
]  # fmt: skip
__version__ = "0.1.0"
