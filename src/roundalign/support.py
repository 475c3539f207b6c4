"""What roundalign supports, checked in one place: model families, activation, RoPE type, attention.

Two sides have limits of their own. The trainer side (``roundalign.apply``, and with it ``probe``, ``fit``,
``train`` and the integrations) patches the HF modules of the families in ``TRAINER_FAMILIES``. The reference
engine implements the dense ones with full causal attention. Each check raises ``UnsupportedModel`` (exit status 2
on the command line) with one message per limit, and a way forward only where there is one: a model the engine
cannot serve can still be audited from a real engine's dump (``--engine-logprobs``), because the trainer side can
patch it; a model the trainer side cannot patch has no such way, and the message says so rather than send the user
into the same error.

Only config attributes are read here, so the checks run before any weight is loaded.
"""

from __future__ import annotations

from roundalign.errors import UnsupportedModel

# The model types the trainer side patches, the one list of them: each has its family module,
# roundalign.patch.<model_type>, which registers itself in roundalign.patch.registry (and is refused there if it is
# not listed here). Kept here, not derived from the registry, because these checks must not import the patch package.
TRAINER_FAMILIES = ("qwen2", "qwen3", "qwen3_moe", "llama")  # Qwen2 covers Qwen2.5
ENGINE_FAMILIES = ("qwen3", "qwen2", "llama")
SWIGLU_ACTIVATIONS = ("silu", "swish")  # the same function; SwiGLU's rules are written for it
ROPE_TYPES = ("default", "llama3", "yarn")  # what released Qwen2/Qwen3/Llama checkpoints use

_NO_WAY_ROUND = (
    "roundalign cannot patch this model's trainer, so probe, fit and train cannot run on it, with or "
    "without --engine-logprobs"
)
_FROM_A_DUMP = (
    "The trainer side supports it: sample with vLLM or SGLang and compare their log-probs with "
    "`roundalign probe --model PATH --engine-logprobs dump.jsonl` (docs/real-engines.md)"
)


def head_dim(config) -> int:
    """Attention head size: the config's ``head_dim`` (Qwen3 sets it), else hidden_size / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("rope_type", "default")


def check_trainer_model(config) -> None:
    """Refuse what ``roundalign.apply`` cannot patch: another family, another activation, a RoPE type whose angles
    change with the sequence length."""
    model_type = getattr(config, "model_type", None)
    if model_type not in TRAINER_FAMILIES:
        raise UnsupportedModel(
            f"model_type {model_type!r} is not supported; roundalign supports "
            f"{', '.join(TRAINER_FAMILIES)} (Qwen2 covers Qwen2.5). {_NO_WAY_ROUND}"
        )
    act = getattr(config, "hidden_act", "silu")
    if act not in SWIGLU_ACTIVATIONS:
        raise UnsupportedModel(
            f"hidden_act {act!r} is not supported; roundalign's SwiGLU rules need hidden_act='silu'. {_NO_WAY_ROUND}"
        )
    kind = rope_type(config)
    if kind not in ROPE_TYPES:
        raise UnsupportedModel(
            f"rope_type {kind!r} is not supported; roundalign computes engine RoPE angles for "
            f"{', '.join(ROPE_TYPES)} (dynamic and longrope scaling change the angles with the "
            f"sequence length). {_NO_WAY_ROUND}"
        )


def check_engine_model(config) -> None:
    """Refuse what the reference engine does not implement, after what the trainer side refuses."""
    check_trainer_model(config)
    if config.model_type not in ENGINE_FAMILIES:
        raise UnsupportedModel(
            f"the reference engine serves the dense families {', '.join(ENGINE_FAMILIES)}; got "
            f"model_type {config.model_type!r}. {_FROM_A_DUMP}"
        )
    sliding = getattr(config, "use_sliding_window", False) or any(
        t != "full_attention" for t in (getattr(config, "layer_types", None) or ())
    )
    if sliding:
        raise UnsupportedModel(
            "the reference engine implements full causal attention only; this config uses sliding-window layers "
            f"(use_sliding_window / layer_types). Set use_sliding_window=False if the checkpoint allows it. "
            f"{_FROM_A_DUMP}"
        )
