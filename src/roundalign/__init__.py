"""roundalign: make an RL trainer round to bf16 exactly where its rollout engine does.

    import roundalign
    roundalign.apply(model, profile="vllm")   # HF Qwen2/Qwen3/Qwen3-MoE/Llama in bf16
    roundalign.revert(model)                  # stock HF numerics again
"""

from roundalign.patch import apply, patched_profile, revert, supported_model_types
from roundalign.profiles import Profile, get_profile, list_profiles

__all__ = ["Profile", "apply", "get_profile", "list_profiles", "patched_profile", "revert", "supported_model_types"]
__version__ = "0.1.0"
