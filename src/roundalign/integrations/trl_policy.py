"""The policy side of the TRL integration: find the policy inside a trainer, patch it, and refuse what cannot work.

``patch_policy`` is ``roundalign.apply(policy, profile, allow_non_bf16=True)`` on the policy TRL trains, reached
through accelerate's wrappers (``unwrap_policy``), plus the trainer's reference model when there is one. A model
that FSDP has already sharded is refused: ``apply`` swaps module classes, which must happen before wrapping.
``check_trainer`` lists every ``GRPOConfig`` setting the reference engine cannot honour, with the fix, before
anything is built: nothing is silently ignored.
"""

from __future__ import annotations

import torch

import roundalign
from roundalign.extras import require
from roundalign.integrations import trl_logprobs
from roundalign.profiles import Profile, get_profile

__all__ = ["check_not_sharded", "check_trainer", "install_for_trainer", "patch_policy", "unwrap_policy"]


def _is_trainer(obj) -> bool:
    return hasattr(obj, "accelerator") and hasattr(obj, "model") and hasattr(obj, "args")


def check_not_sharded(model, what: str, fix: str | None = None) -> None:
    """FSDP replaces modules and parameters; patching after it would miss them or see shards."""
    from torch.distributed.tensor import DTensor

    fsdp_types = []
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        fsdp_types = [FSDPModule, FullyShardedDataParallel]
    except ImportError:  # a torch without FSDP2's public name
        pass
    sharded = any(isinstance(m, tuple(fsdp_types)) for m in model.modules()) if fsdp_types else False
    sharded = sharded or any(isinstance(p, DTensor) for p in model.parameters())
    if sharded:
        fix = fix or (
            "roundalign patches module classes and must run before wrapping: call patch_policy(model) "
            "before GRPOTrainer(...) and before accelerate or FSDP wraps it"
        )
        raise ValueError(f"the {what} is already wrapped by FSDP (sharded modules or DTensor parameters); {fix}")


def unwrap_policy(model_or_trainer):
    """The policy as an HF ``*ForCausalLM``: ``trainer.model`` unwrapped by accelerate (DDP, torch.compile), or the
    model itself."""
    if _is_trainer(model_or_trainer):
        model = model_or_trainer.accelerator.unwrap_model(model_or_trainer.model)
    else:
        model = model_or_trainer
    if not isinstance(model, torch.nn.Module) or getattr(model, "config", None) is None:
        raise TypeError(f"expected an HF model or a GRPOTrainer, got {type(model_or_trainer).__name__}")
    return model


def patch_policy(model_or_trainer, profile: str | Profile = "vllm", **region_overrides):
    """Patch the policy so that it rounds where ``profile``'s engine does; returns the patched (unwrapped) model.

    Call it on the model before building ``GRPOTrainer``, or on the trainer right after (it then patches
    ``trainer.model`` unwrapped, and ``trainer.ref_model`` when there is one, so the KL term compares like with
    like). fp32 parameters are accepted (TRL's ``bf16=True`` computes under autocast). A model already sharded by
    FSDP is refused: patch before wrapping. ``region_overrides`` as in ``roundalign.apply``.
    """
    prof = get_profile(profile)
    targets = [("policy", unwrap_policy(model_or_trainer))]
    if _is_trainer(model_or_trainer) and getattr(model_or_trainer, "ref_model", None) is not None:
        targets.append(("reference model", unwrap_policy(model_or_trainer.ref_model)))
    for what, model in targets:
        check_not_sharded(model, what)
    for _, model in targets:
        roundalign.apply(model, prof, allow_non_bf16=True, **region_overrides)
    if _is_trainer(model_or_trainer):  # built already: TRL's fused head is in place to be replaced
        install_for_trainer(model_or_trainer)
    return targets[0][1]


def install_for_trainer(trainer) -> list:
    """``trl_logprobs.install`` on the trainer's policy and reference model where their profile runs engine kernels;
    returns the models it installed on."""
    done = []
    for model in (trainer.model, getattr(trainer, "ref_model", None)):
        if model is None:
            continue
        model = unwrap_policy(model)
        profile = roundalign.patched_profile(model)
        if profile is not None and profile.uses_engine_kernels:
            trl_logprobs.install(model, trainer.temperature)
            done.append(model)
    return done


def check_trainer(trainer) -> None:
    """Refuse what the engine cannot honour, naming the setting and the fix; nothing is silently ignored."""
    require("trl", "roundalign.integrations.trl")
    from trl import GRPOTrainer

    if not isinstance(trainer, GRPOTrainer):
        raise TypeError(f"EngineRolloutFunc attaches to a trl.GRPOTrainer, got {type(trainer).__name__}")
    args = trainer.args
    problems = []
    if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False):
        problems.append(
            "FSDP / DeepSpeed: each rank's engine needs the full weights; EngineRolloutFunc runs on one "
            "process or under DDP"
        )
    if args.use_vllm:
        problems.append("use_vllm=True: the engine replaces vLLM as the sampler; set use_vllm=False")
    if not trainer.temperature or trainer.temperature <= 0:
        problems.append(f"temperature={trainer.temperature}: GRPO needs sampling (temperature > 0)")
    if trainer.min_p not in (None, 0, 0.0):
        problems.append(f"min_p={trainer.min_p}: the engine samples with temperature, top_k and top_p only")
    if trainer.repetition_penalty != 1.0:
        problems.append(f"repetition_penalty={trainer.repetition_penalty}: not implemented by the engine; use 1.0")
    if args.generation_kwargs:
        problems.append(f"generation_kwargs={args.generation_kwargs}: the engine takes no extra sampling options")
    if trainer.max_completion_length is None:
        problems.append("max_completion_length=None: the engine needs a completion budget")
    if trainer.tools or trainer.environment_factories is not None:
        problems.append("tools / environment_factory: the engine does single-turn rollouts only")
    if getattr(trainer, "_is_vlm", False):
        problems.append("a vision-language model: the engine serves dense text models (Qwen3, Qwen2, Llama)")
    if hasattr(unwrap_policy(trainer), "peft_config"):
        problems.append("a PEFT model: the engine needs the merged weights; merge the adapter or train fully")
    if (
        args.loss_type == "vespo"
        and args.vllm_importance_sampling_correction
        and args.vllm_importance_sampling_mode not in ("token_truncate", "token_mask")
    ):
        problems.append(
            "loss_type='vespo' needs vllm_importance_sampling_mode 'token_truncate' or 'token_mask' "
            "(TRL checks this only when use_vllm is set at construction)"
        )
    if problems:
        raise ValueError("EngineRolloutFunc cannot honour these GRPOConfig settings:\n  - " + "\n  - ".join(problems))
