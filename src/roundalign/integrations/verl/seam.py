"""``patch_actor``: the call for verl's model-patching seam, and the checks of what else has patched the model there.

verl builds its actor in ``FSDPEngine._build_module`` (``verl/workers/engine/fsdp/transformer_impl.py``, 0.9.1):
``from_pretrained`` in fp32, then Liger's ``_apply_liger_kernel_to_instance`` when ``model.use_liger``, then verl's
``apply_monkey_patch`` (remove-padding / Ulysses attention, fused-kernel forward), then ``module.to(torch_dtype)``
and FSDP wrapping with ``param_dtype=bf16``. ``patch_actor`` runs right after ``apply_monkey_patch``: the modules
are final, nothing is wrapped yet. What it finds there, and what it does about it:

- **Liger** binds its ``forward`` (and ``extra_repr``, ``_get_name``) on each RMSNorm and MLP *instance*. An instance
  attribute shadows the class, so after ``roundalign.apply`` swapped the class those modules would still run Liger's
  kernels, which round elsewhere than the engine (``profiles.md``: ``liger``). Liger also rebinds the family's module
  classes in ``transformers``, so a model built after it (verl's reference policy) holds ``LigerRMSNorm`` and
  ``LigerSwiGLUMLP`` instances. ``patch_actor`` removes the instance bindings and gives Liger-class norms and MLPs
  their HF class back (their parameters and attributes are HF's), then applies the profile: the profile decides
  those rounding points. Liger's RoPE replaces ``apply_rotary_pos_emb``, which aligned attention does not call.
- **verl's attention patch** (``use_remove_padding`` / Ulysses) replaces ``_flash_attention_forward`` in
  ``transformers.integrations.flash_attention``. Aligned attention calls HF's attention interface for
  ``config._attn_implementation``, so it reaches verl's function as stock attention does; RoPE runs before it on the
  rank's own sequence slice, as in stock HF.
- **FSDP wrapping by class name.** verl wraps the classes named in ``model._no_split_modules``
  (``Qwen3DecoderLayer``), matched by ``__class__.__name__``. Aligned layers are ``AlignedQwen3DecoderLayer``;
  ``roundalign.apply`` names them in the instance's ``_no_split_modules`` instead, so each layer stays its own unit.

Nothing is left unreached: ``_undo_liger`` gives every Liger module its HF class back or raises, ``roundalign.apply``
swaps every module of the family's HF classes and refuses one with an instance-level ``forward`` before patching
anything. (A silent miss would leave the trainer rounding where it did before.) The ``hf`` profile patches nothing,
by definition: the stock baseline.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field

import roundalign
from roundalign.errors import UnsupportedModel
from roundalign.patch import family_of, supported_model_types

logger = logging.getLogger(__name__)

_BOUND_BY_LIGER = ("forward", "extra_repr", "_get_name")  # what Liger's _bind_method_to_module puts on instances
_LIGER_CLASS_ROLES = {"LigerRMSNorm": "norm", "LigerSwiGLUMLP": "mlp"}  # Liger classes that stand in for HF ones


@dataclass
class PatchReport:
    """What ``patch_actor`` found and did, for the log (``lines()``) and for tests."""

    profile: str
    model_type: str
    aligned_modules: int = 0
    liger_bindings_removed: list[str] = field(default_factory=list)  # "model.norm.forward", ...
    liger_classes_restored: list[str] = field(default_factory=list)  # "model.layers.0.mlp: LigerSwiGLUMLP", ...
    liger_globals: list[str] = field(default_factory=list)  # transformers names Liger rebound
    fsdp_wrap_classes: list[str] = field(default_factory=list)  # the _no_split_modules verl will wrap
    attn_implementation: str | None = None
    verl_attention_patch: bool = False  # verl's remove-padding/Ulysses _flash_attention_forward is installed
    verl_forward_patch: bool = False  # verl replaced the CausalLM forward (use_fused_kernels)

    def lines(self) -> list[str]:
        out = [
            f"roundalign: {self.model_type} actor patched with profile {self.profile!r} "
            f"({self.aligned_modules} modules aligned)"
        ]
        if self.liger_bindings_removed or self.liger_classes_restored:
            out.append(
                f"  Liger replaced {len(self.liger_bindings_removed)} instance methods and "
                f"{len(self.liger_classes_restored)} modules; the profile's rounding points replace them"
            )
        if self.liger_globals:
            out.append(f"  Liger rebound {', '.join(self.liger_globals)} (aligned modules do not call them)")
        via = " through verl's remove-padding/Ulysses function" if self.verl_attention_patch else ""
        wrap = ", ".join(self.fsdp_wrap_classes) or "nothing per layer"
        out.append(f"  FSDP wraps {wrap}; attention {self.attn_implementation}{via}")
        return out


def patch_actor(module, profile="vllm", **region_overrides) -> PatchReport:
    """Patch verl's freshly built fp32 actor (or reference) model for ``profile``'s rounding points, in place.

    Call it where verl patches the model: after Liger and ``apply_monkey_patch``, before ``module.to(dtype)`` and FSDP
    (``roundalign.integrations.verl.install`` puts it there). ``region_overrides`` go to ``roundalign.apply``.
    Raises ``UnsupportedModel`` (a ``ValueError``) for an unsupported model and ``RuntimeError`` when a module
    cannot be reached.
    """
    config = getattr(module, "config", None)
    try:
        # The family module refuses to register classes another library rebound in transformers (ImportError):
        # ROUNDALIGN_* activation imports every family (import_families) before verl applies Liger.
        family = family_of(module)
    except UnsupportedModel as exc:
        raise UnsupportedModel(
            f"verl's {type(module).__name__}: {exc}. Unset ROUNDALIGN_PROFILE for this run."
        ) from None
    model_type = config.model_type
    report = PatchReport(profile=roundalign.get_profile(profile).name, model_type=model_type)
    _undo_liger(module, family, report)
    roundalign.apply(module, profile, allow_non_bf16=True, **region_overrides)  # fp32 here; bf16 compute under FSDP
    report.aligned_modules = _count_aligned(module, family)
    report.fsdp_wrap_classes = sorted(getattr(module, "_no_split_modules", None) or [])  # apply renamed them
    report.attn_implementation = getattr(config, "_attn_implementation", None)
    report.verl_attention_patch = _verl_attention_patched()
    report.verl_forward_patch = getattr(type(module).forward, "__module__", "").startswith("verl")
    module._roundalign_verl_report = report  # for the log and tests; roundalign.revert removes it
    for line in report.lines():
        logger.info(line)
    return report


def import_families() -> None:
    """Import every family module now, so each binds the real HF classes before Liger rebinds them in transformers."""
    for model_type in supported_model_types():
        importlib.import_module(f"roundalign.patch.{model_type}")


def _undo_liger(module, family, report: PatchReport) -> None:
    import sys

    hf_module = sys.modules[next(iter(family.swaps.values()))[0].__module__]  # transformers' modeling_<family>
    for attr in ("apply_rotary_pos_emb", *(hf_cls.__name__ for hf_cls, _ in family.swaps.values())):
        if _from_liger(getattr(hf_module, attr, None)):
            report.liger_globals.append(f"{hf_module.__name__}.{attr}")
    for name, sub in module.named_modules():
        for attr in _BOUND_BY_LIGER:
            if _from_liger(sub.__dict__.get(attr)):
                del sub.__dict__[attr]
                report.liger_bindings_removed.append(f"{name}.{attr}")
        cls_name = type(sub).__name__
        if _from_liger(type(sub)):
            role = _LIGER_CLASS_ROLES.get(cls_name)
            if role is None or role not in family.swaps:
                raise RuntimeError(
                    f"{name} is Liger's {cls_name}, which roundalign cannot map back to a {family.model_type} module; "
                    "run without actor_rollout_ref.model.use_liger=True"
                )
            sub.__class__ = family.swaps[role][0]  # HF's class: same parameters (weight / gate, up, down_proj)
            report.liger_classes_restored.append(f"{name}: {cls_name}")


def _from_liger(obj) -> bool:
    """Whether ``obj`` (a function, bound method or class) comes from the liger_kernel package."""
    func = getattr(obj, "__func__", obj)  # a bound method's function
    return obj is not None and (getattr(func, "__module__", None) or "").startswith("liger_kernel")


def _count_aligned(module, family) -> int:
    aligned = {aligned_cls for _, aligned_cls in family.swaps.values()}
    return sum(type(sub) in aligned for sub in module.modules())


def _verl_attention_patched() -> bool:
    try:
        from transformers.integrations import flash_attention
    except ImportError:  # pragma: no cover - transformers without the flash-attention integration module
        return False
    return getattr(flash_attention._flash_attention_forward, "__module__", "").startswith("verl")


__all__ = ["PatchReport", "import_families", "patch_actor"]
