"""roundalign: make an RL trainer round to bf16 exactly where its rollout engine does.

    import roundalign
    roundalign.apply(model, profile="vllm")   # HF Qwen2/Qwen3/Qwen3-MoE/Llama in bf16
    roundalign.revert(model)                  # stock HF numerics again
    roundalign.models.path("tiny-qwen3")      # the small model that ships inside the package

Everything is imported on first use: ``import roundalign`` loads neither torch nor transformers, so the command
line starts at once, and ``roundalign.apply`` costs its imports only when called.
"""

import importlib
import importlib.util

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "apply": "roundalign.patch",
    "revert": "roundalign.patch",
    "patched_profile": "roundalign.patch",
    "supported_model_types": "roundalign.patch",
    "family_of": "roundalign.patch",
    "Profile": "roundalign.profiles",
    "get_profile": "roundalign.profiles",
    "list_profiles": "roundalign.profiles",
    "UserError": "roundalign.errors",
}
_SUBMODULES = ("models",)

__all__ = sorted([*_LAZY, *_SUBMODULES])


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif importlib.util.find_spec(f"roundalign.{name}") is not None:  # a subpackage: roundalign.ops, .sync, ...
        value = importlib.import_module(f"roundalign.{name}")
    else:
        raise AttributeError(f"module 'roundalign' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY, *_SUBMODULES])
