"""``apply`` and ``revert``: give an HF model instance an engine's rounding points, and take them away again.

``apply`` swaps the class of each element-wise module (RMSNorm, MLP / experts, attention, decoder layer, rotary
embedding) for its ``Aligned*`` subclass and stores the profile's rule on the instance. Parameters, buffers and
state_dict keys are untouched, so checkpoints load and save as before. Patch before wrapping the model (FSDP,
DDP, torch.compile), as verl and TRL patch with Liger.
"""

from __future__ import annotations

import importlib

import torch

from roundalign import kernels
from roundalign.errors import UserError
from roundalign.ops import _fused
from roundalign.patch._common import AlignedDecoderLayer
from roundalign.patch.registry import FAMILIES, Family
from roundalign.profiles import ForwardKernel, GemmKernel, Profile, QKNormRule, RopeAngles, get_profile
from roundalign.rotary import engine_inv_freq
from roundalign.support import TRAINER_FAMILIES, check_trainer_model, head_dim


def supported_model_types() -> list[str]:
    """The HF ``model_type`` values ``apply`` patches."""
    return list(TRAINER_FAMILIES)


def family_of(model) -> Family:
    """The patch family of an HF model (or its config): which module classes ``apply`` swaps, and for what.

    Raises ``roundalign.errors.UnsupportedModel`` for a model ``apply`` cannot patch (``roundalign.support``)."""
    config = getattr(model, "config", model)
    check_trainer_model(config)
    importlib.import_module(f"roundalign.patch.{config.model_type}")
    return FAMILIES[config.model_type]


def patched_profile(model) -> Profile | None:
    """The profile a model was patched with, or None."""
    return getattr(model, "_roundalign_profile", None)


def _check_dtype(model, allow_non_bf16: bool) -> None:
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes <= {torch.bfloat16} or allow_non_bf16:
        return
    names = ", ".join(sorted(str(d).replace("torch.", "") for d in dtypes))
    raise TypeError(
        f"roundalign.apply needs a bf16 model, got parameters in {names}. The profiles say where a bf16 engine "
        "rounds; in fp32 nothing would round. Load with dtype=torch.bfloat16 or call model.to(torch.bfloat16) "
        "first. For fp32 master weights with bf16 compute (FSDP2 MixedPrecisionPolicy(param_dtype=bf16), or "
        "torch.autocast(dtype=bf16) as HF Trainer/TRL bf16=True run it), or an fp16 engine "
        "(Engine(..., dtype=torch.float16)), pass allow_non_bf16=True: the model then rounds where the engine does, "
        "in the 16-bit compute dtype (docs/mixed-precision.md)."
    )


def apply(
    model,
    profile: str | Profile = "vllm",
    *,
    allow_non_bf16: bool = False,
    compile_ops: bool | None = None,
    **region_overrides,
):
    """Patch ``model`` in place so that its trainer numerics round where ``profile``'s engine does.

    Args:
        model: an HF Qwen2 / Qwen3 / Qwen3-MoE / Llama model (``*ForCausalLM`` or its base model) in bf16.
        profile: a built-in profile name (``roundalign.list_profiles()``) or a ``Profile``.
        allow_non_bf16: accept fp32/fp16 parameters (see the error ``apply`` raises without it). fp32 parameters
            under FSDP2 mixed precision or autocast compute what the bf16 model with weights ``r(W)`` computes
            (``roundalign.mixed_precision``); an fp16 model rounds at the profile's rounding points to fp16.
        compile_ops: run the ops' Inductor-fused kernels (``roundalign.ops._fused``): one kernel per op, no fp32
            temporaries in memory, bitwise equal to the eager ops (tests/test_ops_compiled.py). The default,
            None, uses them wherever Inductor can compile (a C++ compiler on the CPU, Triton on a GPU) unless
            ``$ROUNDALIGN_COMPILE_OPS=0``, and otherwise runs the eager ops with one warning; True insists (an
            error when no compiler is at hand); False runs the eager ops. Each kernel compiles on first use
            (seconds) and is cached on disk by Inductor for later processes. Numerics never change.
        **region_overrides: replace one region's rule, e.g. ``rope="fp32/once"`` or ``qk_norm="fused_into_rope"``.

    Returns the model. A profile with stock HF's rules (``hf``: ``Profile.is_stock_hf``) leaves every module as it
    is and only records the profile.
    Applying the same profile twice only updates ``compile_ops``; applying a different one raises: ``revert`` first.
    """
    prof = get_profile(profile).replace(**region_overrides)
    family = family_of(model)
    current = patched_profile(model)
    if current is not None:
        if current == prof:
            _set_compile_ops(model, compile_ops)
            return model
        raise RuntimeError(
            f"model is already patched with profile {current.name!r}; call roundalign.revert(model) before "
            f"applying {prof.name!r}"
        )
    _check_dtype(model, allow_non_bf16)
    if prof.uses_engine_kernels:
        kernels.check(prof, model)
    config = model.config
    if not prof.is_stock_hf:  # by the rules, not the name: a profile with stock HF's rules changes nothing
        _patch_modules(model, family, prof, config)
        _set_compile_ops(model, compile_ops)
    if prof.forward is ForwardKernel.VLLM_CPU_COMPILED:
        from roundalign.kernels import graph

        graph.install(model)
    model._roundalign_profile = prof
    return model


def _set_compile_ops(model, compile_ops: bool | None) -> None:
    fused = _fused.fused_requested(compile_ops)
    if fused:
        device = next(iter(model.parameters()), torch.empty(0)).device.type
        reason = _fused.unavailable_reason(device)
        if reason is not None and compile_ops:
            raise RuntimeError(
                f"apply(..., compile_ops=True) needs Inductor to compile for {device}, but: {reason}. Pass "
                "compile_ops=None to fall back to the eager ops (same numbers, slower), or False."
            )
        if reason is not None:
            _fused.warn_once(f"unavailable:{device}", f"roundalign: running the eager ops: {reason}.")
            fused = False
    for module in model.modules():
        if hasattr(type(module), "_roundalign_compile_ops"):
            module._roundalign_compile_ops = fused


def _patch_modules(model, family: Family, prof: Profile, config) -> None:
    rope = prof.rope_for(head_dim(config))
    quant = prof.quantization if prof.quantization.quantized else None
    if quant is not None and family.model_type == "qwen3_moe":
        raise UserError(
            f"quantization {quant} is computed for dense models (Qwen2, Qwen3, Llama); Qwen3-MoE's experts are not "
            "served quantized by roundalign yet. Use the profile without quantization for this model"
        )
    if quant is not None:  # a layer the engine's kernel cannot serve fails now, not in the first forward
        from roundalign.quant.schemes import PROJECTIONS

        for name, module in model.named_modules():
            if name.rpartition(".")[2] in PROJECTIONS and isinstance(module, torch.nn.Linear):
                quant.check_shape(name, *module.weight.shape)
    qk_fused = family.has_qk_norm and prof.qk_norm is QKNormRule.FUSED_INTO_ROPE

    def attrs_for(role: str, name: str, module) -> dict:
        if role == "norm":
            is_qk = name.endswith(("q_norm", "k_norm"))
            return {"_roundalign_rule": str(prof.qk_norm if is_qk else prof.rms_norm)}
        if role == "mlp":
            return {"_roundalign_rule": prof.swiglu, "_roundalign_gemm": prof.gemm, "_roundalign_quant": quant}
        if role == "experts":
            return {"_roundalign_rule": prof.expert_swiglu}
        if role == "attention":
            # fused_into_rope: q/k go from the norm through RoPE in fp32 and round once, at RoPE's output (by
            # truncation under a truncating rule), whatever the profile's RoPE rounding (which still applies where
            # there is no q/k norm).
            rounding = rope.rounding.after_fused_norm() if qk_fused else rope.rounding
            return {
                "_roundalign_rope": rounding,
                "_roundalign_attention": prof.attention,
                "_roundalign_gemm": prof.gemm,
                "_roundalign_quant": quant,
            }
        if role == "decoder_layer":
            return {"_roundalign_residual": prof.residual, "_roundalign_profile": prof.name}
        if prof.rope_angles is RopeAngles.MODULE:  # rotary: HF's own buffer and scaling, read at each forward
            return {"_roundalign_rope": rope, "_roundalign_inv_freq": None, "_roundalign_scaling": None}
        inv_freq, scaling = engine_inv_freq(config, type(module).compute_default_rope_parameters)
        return {"_roundalign_rope": rope, "_roundalign_inv_freq": inv_freq, "_roundalign_scaling": scaling}

    hits = [(name, module, family.aligned_for(module)) for name, module in model.named_modules()]
    hits = [(name, module, hit) for name, module, hit in hits if hit is not None]
    shadowed = [name for name, module, _ in hits if "forward" in vars(module)]
    hub = [name for name, module, _ in hits if "_kernel_repo" in vars(module)]
    if hub:
        # The kernels library's _replace_forward binds the Hub kernel's forward on the instance and records the
        # repository it came from in _kernel_repo; transformers >= 5.25 does this in from_pretrained by default.
        raise RuntimeError(
            f"roundalign cannot patch {', '.join(hub[:4])}{' ...' if len(hub) > 4 else ''}: transformers replaced "
            "their forward with kernels from the Hub (from_pretrained's use_kernels, on by default since "
            "transformers 5.25), and that forward would shadow the aligned one. Load the model with "
            "use_kernels=False, or set USE_HUB_KERNELS=0 before loading."
        )
    if shadowed:
        # An instance attribute shadows the class: after the swap these modules would keep their old numerics.
        raise RuntimeError(
            f"roundalign cannot patch {', '.join(shadowed[:4])}{' ...' if len(shadowed) > 4 else ''}: an "
            "instance-level forward (e.g. Liger's _apply_liger_kernel_to_instance) would shadow the aligned one. "
            "Patch with roundalign instead of Liger, or, in verl, use roundalign.integrations.verl.patch_actor, "
            "which removes Liger's bindings first."
        )
    swapped = 0
    for name, module, (role, aligned) in hits:
        attrs = attrs_for(role, name, module)
        module.__class__ = aligned
        for key, value in attrs.items():
            setattr(module, key, value)
        swapped += role == "decoder_layer"
    if not swapped:
        raise ValueError(f"found no {family.model_type} decoder layers to patch in {type(model).__name__}")
    _patch_lm_head(model, prof)
    _patch_positions(model, prof)
    _rename_wrap_classes(model, family)


def _patch_lm_head(model, prof: Profile) -> None:
    """Under an engine's GEMM kernel the lm_head is one of its GEMMs too (``kernels.EngineLMHead``)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if prof.gemm is GemmKernel.TORCH or head is None:
        return
    if type(head) is not torch.nn.Linear:
        raise UserError(
            f"gemm={prof.gemm} computes the lm_head with the engine's GEMM; this model's is a "
            f"{type(head).__name__}, not a plain nn.Linear. Use gemm='torch'"
        )
    head.__class__ = kernels.EngineLMHead
    head._roundalign_gemm = prof.gemm


def _positions_from_mask(module, args, kwargs):
    """A forward pre-hook: ``position_ids`` from the 2-D attention mask when the caller passed none, so that every
    sequence of a left-padded batch starts at position 0, as the engine computed it (verl's positions; HF's default
    counts the padding). Only for whole-sequence forwards: a forward over a KV cache keeps HF's own."""
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    if kwargs.get("position_ids") is not None or mask is None or mask.dim() != 2 or cache is not None:
        return None
    if "attention_mask" not in kwargs:  # positional: leave the call as it is rather than guess its layout
        return None
    return args, {**kwargs, "position_ids": (mask.long().cumsum(-1) - 1).clamp(min=0)}


def _patch_positions(model, prof: Profile) -> None:
    """Under an engine's attention kernel each sequence must start at position 0 (``roundalign.kernels``): derive
    ``position_ids`` from the mask where the trainer (TRL, for one) passes none. ``revert`` removes the hook."""
    if not prof.uses_engine_kernels:
        return
    base = getattr(model, "model", model)
    base._roundalign_positions_hook = base.register_forward_pre_hook(_positions_from_mask, with_kwargs=True)


def _rename_wrap_classes(model, family: Family) -> None:
    """Name the aligned classes in ``_no_split_modules`` instead of HF's.

    FSDP auto-wrap policies find decoder layers by class *name* in that list (accelerate's default
    ``transformer_layer_cls_to_wrap``, verl's ``get_fsdp_wrap_policy``). With HF's names, accelerate fails to find
    the class ("Could not find the transformer layer class") and verl's FSDP2 shards the model as one unit. Set on
    the instances (the HF classes keep their lists); ``revert`` puts the originals back.
    """
    renamed = {hf_cls.__name__: aligned.__name__ for hf_cls, aligned in family.swaps.values()}
    for module in (model, getattr(model, "model", None)):
        names = getattr(module, "_no_split_modules", None)
        if module is None or not names:
            continue
        module._roundalign_no_split = vars(module).get("_no_split_modules")  # None: the class's list
        # HF 5 keeps a set on the instance (collected at post_init), older versions a list on the class.
        module._no_split_modules = type(names)(renamed.get(n, n) for n in names)


def revert(model):
    """Undo ``apply``: every module gets its HF class back, and stock HF numerics return exactly."""
    for module in model.modules():
        hf_cls = getattr(type(module), "_roundalign_hf_class", None)
        if hf_cls is not None:
            module.__class__ = hf_cls
        if "_roundalign_no_split" in vars(module):  # the list apply renamed
            original = module._roundalign_no_split
            if original is None:
                del module._no_split_modules  # the class's list again
            else:
                module._no_split_modules = original
        hook = vars(module).get("_roundalign_positions_hook")
        if hook is not None:
            hook.remove()
        if "_roundalign_graph" in vars(module):  # the compiled engine forward: the class's forward again
            del module.forward
        for key in [k for k in vars(module) if k.startswith("_roundalign_")]:
            delattr(module, key)
    return model


__all__ = ["AlignedDecoderLayer", "apply", "family_of", "patched_profile", "revert", "supported_model_types"]
