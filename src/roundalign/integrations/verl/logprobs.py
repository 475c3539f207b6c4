"""verl's actor computes its log-probs the engine's way: fp32 logits, divided by the temperature in fp32, and
``log_softmax`` over the row (``roundalign.kernels.logprobs``).

verl 0.9.1's ``FSDPEngine`` (``workers/engine/fsdp/transformer_impl.py``) scales the model's logits by the
temperature in the logits' dtype (``_scale_logits_by_temperature``: bf16 logits divided in bf16) and takes
``logprobs_from_logits`` (``utils/torch_functional.py``): without flash-attn's cross-entropy, ``x - logsumexp(x)``
row by row for fp32 logits and a bf16 ``log_softmax`` for bf16 ones. vLLM's sampler upcasts the bf16 logits to fp32,
divides by the temperature there and takes ``log_softmax``. Each difference changes a log-prob's low bits, so an
exact trainer inside verl computes what the sampler computes. ``hook`` rebinds both names inside
``transformer_impl`` (where the engine's forward looks them up); the rest of verl's loss is unchanged.
"""

from __future__ import annotations

import torch

from roundalign.kernels.logprobs import engine_logprobs


def scale_logits_by_temperature(logits, temperature, *, is_unit_temperature: bool):
    """The sampler's scaling: fp32 logits, divided in fp32 (at temperature 1 the 16-bit logits are left as they are
    and upcast row by row in ``logprobs_from_logits``)."""
    if is_unit_temperature:
        return logits
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(torch.float32).clamp(min=1e-8)
    return logits.float() / temperature


def logprobs_from_logits(logits, labels, inplace_backward: bool = True):
    """``log_softmax(float(logits))[label]`` for each position: the sampler's log-prob, with its gradient."""
    shape = logits.shape[:-1]
    picked, _ = engine_logprobs(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), 1.0)
    return picked.view(shape)


def hook(ti) -> list:
    """Rebind verl's two names in ``transformer_impl`` (``ti``); returns ``(owner, name, original)`` for uninstall."""
    from roundalign.integrations.seams import check_source

    check_source(ti.FSDPEngineWithLMHead.prepare_model_outputs, ["_scale_logits_by_temperature(",
                 "logprobs_from_logits("], "the actor's log-prob head", "verl")  # fmt: skip
    originals = [(ti, name, getattr(ti, name)) for name in ("logprobs_from_logits", "_scale_logits_by_temperature")]
    ti.logprobs_from_logits = logprobs_from_logits
    ti._scale_logits_by_temperature = scale_logits_by_temperature
    return originals


__all__ = ["hook", "logprobs_from_logits", "scale_logits_by_temperature"]
