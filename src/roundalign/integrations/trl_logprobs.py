"""TRL's log-prob head computed the engine's way, so that an exact policy's log-probs are the sampler's bit for bit.

TRL 1.16's ``GRPOTrainer`` scores completions through its fused LM head (``trl.trainer.utils.add_fused_lm_head``):
the lm_head GEMM in vocabulary tiles, straight on ``lm_head.weight``, folded into an online log-sum-exp and
``target - (max + log(sum exp))``. The engines compute ``log_softmax`` over the full row of fp32 logits instead
(vLLM's sampler: ``logits.to(float32)``, divided by the temperature, ``log_softmax``; the reference engine the same).
The two agree to about 1e-6 nats, not bit for bit, and TRL's tiles bypass the lm_head module, so an engine GEMM
kernel (``gemm='vllm-cpu'``, ``'reference'``) would not run there at all.

``install`` wraps the forward TRL patched: with ``fused_lm_head=True`` it runs the backbone, the model's own lm_head
(the engine's GEMM under an engine-kernel profile) on the positions TRL scores, and ``log_softmax`` of
``logits.float() / temperature`` as the engine does. The result is TRL's own ``FusedCausalLMOutput`` (log-probs and
entropy; the optional fields TRL's GRPO does not ask for stay ``None``), so the rest of TRL is unchanged.

Memory: the 16-bit logits of the scored positions are held, as a stock HF forward holds them; the fp32 log-softmax is
computed in row chunks and recomputed in the backward (``roundalign.kernels.logprobs``), so no ``(tokens, vocab)``
fp32 tensor is kept. Without ``fused_lm_head`` the call is TRL's (and so the model's) own forward.
"""

from __future__ import annotations

import types

from roundalign.errors import UserError
from roundalign.kernels.logprobs import engine_logprobs


def _check(model) -> None:
    config = model.config.get_text_config()
    scaled = [
        f"{k}={getattr(config, k)}"
        for k in ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")
        if getattr(config, k, None) not in (None, 1, 1.0)
    ]
    if scaled:
        raise UserError(
            f"this model scales its logits ({', '.join(scaled)}); the engine log-prob head covers Qwen and Llama "
            "models, whose logits are the lm_head's output. Leave TRL's fused head in place (no engine kernels)"
        )
    if getattr(config, "output_router_logits", False):
        raise UserError(
            "output_router_logits=True: TRL adds the MoE load-balancing loss in its fused head, which the engine "
            "log-prob head does not restate; engine kernels cover dense models (set output_router_logits=False)"
        )


def install(model, temperature: float) -> None:
    """Make ``model(..., labels=, fused_lm_head=True)`` (TRL's scoring call) compute the engine's log-probs.

    Call it after ``GRPOTrainer`` was built (its ``add_fused_lm_head`` replaced ``model.forward``). Idempotent: a
    second call only updates the temperature."""
    from trl.trainer.utils import FusedCausalLMOutput

    if getattr(model, "_roundalign_trl_head", None) is not None:
        model._roundalign_trl_head["temperature"] = float(temperature)
        return
    _check(model)
    trl_forward = model.forward
    # TRL's forward stays reachable (``trl_forward``): to compare with, and for whoever wants TRL's head back.
    state = model._roundalign_trl_head = {"temperature": float(temperature), "trl_forward": trl_forward}

    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            return trl_forward(
                *args, labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch, **kwargs
            )
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        head = self.get_output_embeddings()
        labels = labels.to(head.weight.device)
        mask = labels != -100
        # Only the scored positions go through the lm_head (one GEMM over them, as the engine's one over its rows).
        picked, entropy = engine_logprobs(head(hidden.to(head.weight.device)[mask]), labels[mask], state["temperature"])
        # masked_scatter keeps the output connected to the graph when no label is valid (TRL does the same).
        log_probs = picked.new_zeros(mask.shape).masked_scatter(mask, picked)
        entropy = entropy.new_zeros(mask.shape).masked_scatter(mask, entropy)
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(loss=-log_probs.sum() / count, log_probs=log_probs, entropy=entropy, label_mask=mask)

    model.forward = types.MethodType(forward, model)
