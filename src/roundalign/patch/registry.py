"""Model families, keyed by ``config.model_type``, and the aligned classes each one swaps in.

A family names its HF module classes; ``define_family`` creates ``Aligned<HFClass>`` for each (the shared mixin
from ``_common`` in front of the HF class) inside the family's own module, so that the classes have importable
names (pickle, ``print(model)``) and one file per family stays a short, readable declaration.

The model types that have a family are listed once, in ``roundalign.support.TRAINER_FAMILIES`` (which the
config checks read without importing this package): each names its module, ``roundalign.patch.<model_type>``,
which ``family_of`` imports on first use and which registers its family in ``FAMILIES`` here. ``define_family``
refuses a model type that list does not name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from roundalign.patch._common import (
    AlignedAttention,
    AlignedDecoderLayer,
    AlignedExperts,
    AlignedMLP,
    AlignedRMSNorm,
)
from roundalign.rotary import AlignedRotary
from roundalign.support import TRAINER_FAMILIES

_MIXINS = {
    "norm": AlignedRMSNorm,
    "mlp": AlignedMLP,
    "attention": AlignedAttention,
    "decoder_layer": AlignedDecoderLayer,
    "rotary": AlignedRotary,
    "experts": AlignedExperts,
}


@dataclass(frozen=True)
class Family:
    """One HF model family: which HF class becomes which aligned class, by role."""

    model_type: str
    swaps: dict[str, tuple[type, type]] = field(default_factory=dict)  # role -> (HF class, aligned class)
    has_qk_norm: bool = False

    def aligned_for(self, module) -> tuple[str, type] | None:
        """(role, aligned class) for an HF module of this family, or None if it is not patched."""
        for role, (hf_cls, aligned_cls) in self.swaps.items():
            if type(module) is hf_cls:
                return role, aligned_cls
        return None


FAMILIES: dict[str, Family] = {}  # model_type -> Family, filled as each TRAINER_FAMILIES module is imported


def define_family(model_type: str, namespace: dict, has_qk_norm: bool = False, **hf_classes: type) -> Family:
    """Create ``Aligned<HFClass>`` for each ``role=HFClass`` in the caller's module and register the family."""
    if model_type not in TRAINER_FAMILIES:
        # check_trainer_model refuses every model type the list does not name: this family would never be used.
        raise ValueError(
            f"model_type {model_type!r} has a family module but is not in roundalign.support.TRAINER_FAMILIES; "
            "list it there"
        )
    foreign = [
        f"{role}={c.__module__}.{c.__name__}"
        for role, c in hf_classes.items()
        if not c.__module__.startswith("transformers.")
    ]
    if foreign:
        # Liger's apply_liger_kernel_to_<family> rebinds the classes in transformers' modeling module; registered
        # now, the family would swap in subclasses of Liger's classes and patch nothing an HF model holds.
        raise ImportError(
            f"roundalign.patch.{model_type} was first imported after another library replaced its transformers "
            f"classes ({', '.join(foreign)}). Import roundalign (or roundalign.patch.{model_type}) before applying "
            "Liger or any other monkey patch to transformers."
        )
    swaps = {}
    for role, hf_cls in hf_classes.items():
        name = f"Aligned{hf_cls.__name__}"
        attrs = {
            "__module__": namespace["__name__"],
            "__qualname__": name,
            "__doc__": _MIXINS[role].__doc__,
            "_roundalign_hf_class": hf_cls,  # what revert() restores
        }
        if role == "attention":
            attrs["_hf_eager_attention"] = staticmethod(_eager_attention_of(hf_cls))
        aligned = type(name, (_MIXINS[role], hf_cls), attrs)
        namespace[name] = aligned
        swaps[role] = (hf_cls, aligned)
    family = Family(model_type=model_type, swaps=swaps, has_qk_norm=has_qk_norm)
    FAMILIES[model_type] = family
    return family


def _eager_attention_of(hf_cls: type):
    import sys

    return sys.modules[hf_cls.__module__].eager_attention_forward
