"""``Rollout``: one sampled sequence, the record every part of roundalign passes around.

The engine returns it from ``generate``, a dump file holds one per line (``roundalign.rollouts.jsonl``), the probe
and ``roundalign fit`` recompute its log-probs as a trainer, and the verl and TRL integrations write it. One type for
all of them means a dump read by one command is input to every other (``fit(model, read_engine_logprobs(path))``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rollout:
    """Prompt ids, completion ids and the sampler's log-prob of each completion token.

    ``logprobs[i]`` is the sampler's log-prob of ``token_ids[i]`` given the prompt and ``token_ids[:i]``; None
    where nothing sampled them (a sequence to score). ``finish_reason`` (``"stop"`` or ``"length"``, as vLLM
    reports it) and ``text`` (the decoded completion) are the sampler's, when it gave them.
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    text: str | None = None

    @property
    def ids(self) -> torch.Tensor:
        """Prompt and completion as one 1-D long tensor: what a trainer's teacher-forced forward reads."""
        return torch.tensor(list(self.prompt_token_ids) + list(self.token_ids), dtype=torch.long)
