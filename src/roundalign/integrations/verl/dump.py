"""Sampler log-probs out of a verl batch, in the JSONL that ``roundalign probe --engine-logprobs`` audits.

After generation, verl's batch (``DataProto.batch``, a TensorDict) holds ``prompts`` (left-padded), ``responses``
(right-padded), ``attention_mask`` over both, and, with ``actor_rollout_ref.rollout.calculate_log_probs=True``,
``rollout_log_probs``: the rollout engine's log-prob of each response token. The response mask is the last
``responses.shape[1]`` columns of ``attention_mask``, as verl's ``compute_response_mask`` takes it.
"""

from __future__ import annotations

from pathlib import Path

from roundalign.rollouts import Rollout, write_engine_logprobs

_KEYS = ("prompts", "responses", "attention_mask", "rollout_log_probs")


def rollouts_from_batch(batch) -> list[Rollout]:
    """One ``Rollout`` per row of verl's batch: unpadded prompt ids, response ids and the sampler's log-probs."""
    missing = [k for k in _KEYS if k not in batch.keys()]
    if missing:
        hint = " (set actor_rollout_ref.rollout.calculate_log_probs=True)" if "rollout_log_probs" in missing else ""
        raise KeyError(f"verl batch has no {', '.join(missing)}{hint}")
    prompts, responses = batch["prompts"], batch["responses"]
    mask, logprobs = batch["attention_mask"].bool(), batch["rollout_log_probs"]
    n_prompt, n_response = prompts.shape[1], responses.shape[1]
    if mask.shape[1] != n_prompt + n_response or logprobs.shape != responses.shape:
        raise ValueError(
            f"verl batch shapes do not line up: prompts {tuple(prompts.shape)}, responses {tuple(responses.shape)}, "
            f"attention_mask {tuple(mask.shape)}, rollout_log_probs {tuple(logprobs.shape)}"
        )
    out = []
    for row in range(prompts.shape[0]):
        keep_prompt, keep_response = mask[row, :n_prompt], mask[row, n_prompt:]
        out.append(
            Rollout(
                prompt_token_ids=prompts[row][keep_prompt].tolist(),
                token_ids=responses[row][keep_response].tolist(),
                logprobs=logprobs[row][keep_response].float().tolist(),
            )
        )
    return out


def write_rollout_logprobs(batch, path: str | Path) -> int:
    """Write ``rollouts_from_batch(batch)`` to ``path`` (JSONL); returns the number of records."""
    rollouts = rollouts_from_batch(batch)
    write_engine_logprobs(path, rollouts)
    return len(rollouts)


__all__ = ["rollouts_from_batch", "write_rollout_logprobs"]
