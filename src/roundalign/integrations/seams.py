"""Where roundalign hooks TRL and verl without a documented seam, checked against the source it relies on.

Where a framework offers a documented seam, the integrations use it: TRL's ``rollout_func`` and ``callbacks``; Ray's
``worker_process_setup_hook`` and ``runtime_env`` for verl's workers. Six hooks have none, and each is guarded
here by ``check_source`` before it is installed, so a release that moved the code fails loudly instead of silently
training with stock numerics:

- TRL 1.16 corrects a sampler's log-probs (importance sampling, ``sampling/*`` metrics) only on its vLLM branch;
  ``EngineRolloutFunc.attach`` turns that branch on (``trainer.use_vllm``) with a stand-in ``vllm_generation``
  (``integrations/trl.py``, ``TRL_IS_BRANCH``).
- TRL 1.16 computes advantages inline in ``_generate_and_score_completions``; ``OsolAdvantage.attach`` overrides
  that method on the trainer instance and puts (B, T) advantages in its output, which ``_compute_loss`` reads as
  given (``integrations/trl_osol.py``, ``TRL_ADVANTAGES``).
- verl 0.9.1 patches the actor's model in ``FSDPEngine._build_module`` through the module-level name
  ``apply_monkey_patch``, which the verl hooks rebind (``integrations/verl/hooks.py``).
- verl 0.9.1 casts fp32 shards to bf16 inside ``get_per_tensor_param_shard``, where the verl hooks put Fair Cast.
- verl 0.9.1's actor computes log-probs in ``FSDPEngineWithLMHead.prepare_model_outputs`` through module-level names
  (``logprobs_from_logits``, ``_scale_logits_by_temperature``) that the verl hooks rebind (``verl/logprobs.py``).
- verl 0.9.1's vLLM worker extension loads each sync in place and then runs ``process_weights_after_loading``
  (``update_weights_from_ipc``), which ``verl/rollout.py`` wraps in vLLM's layer-wise reload on the CPU.

docs/design.md ("Where roundalign hooks TRL and verl") lists them with the tests that prove each.
"""

from __future__ import annotations

import inspect

# TRL 1.16 grpo_trainer.py: the IS correction and the per-step weight-sync call sit on the vLLM branch.
TRL_IS_BRANCH = (
    ("_generate_and_score_completions", ["self.use_vllm and self.vllm_importance_sampling_correction"]),
    ("_generate", ["self.vllm_generation.sync_weights()"]),
)

# TRL 1.16 grpo_trainer.py: the advantages leave _generate_and_score_completions per rank in its output dict, reach
# the loss through _prepare_inputs' shuffle and split (row-wise), and the loss unsqueezes only 1-D ones.
TRL_ADVANTAGES = (
    ("_generate_and_score_completions", ["advantages = advantages[process_slice]", '"advantages": advantages']),
    (
        "_prepare_inputs",
        [
            "generation_batch = self._generate_and_score_completions(generation_batch)",
            "shuffle_sequence_dict(generation_batch)",
            "split_tensor_dict(generation_batch",
        ],
    ),
    ("_compute_loss", ['advantages = inputs["advantages"]', "if advantages.dim() == 1:", "advantages.unsqueeze(1)"]),
)


def check_source(func, needles: list[str], what: str, library: str) -> None:
    """``RuntimeError`` unless ``func``'s source holds every one of ``needles``, in that order."""
    source = inspect.getsource(func)
    positions = [source.find(n) for n in needles]
    if min(positions) < 0 or positions != sorted(positions):
        raise RuntimeError(
            f"{library}'s {func.__qualname__} no longer has {what} where roundalign hooks it (expected "
            f"{' then '.join(repr(n) for n in needles)}); this {library} version is not supported"
        )


__all__ = ["TRL_ADVANTAGES", "TRL_IS_BRANCH", "check_source"]
