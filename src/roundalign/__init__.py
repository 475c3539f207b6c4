"""roundalign: make an RL trainer round to bf16 exactly where its rollout engine does."""

from roundalign.profiles import Profile, get_profile, list_profiles

__all__ = ["Profile", "get_profile", "list_profiles"]
__version__ = "0.1.0"
