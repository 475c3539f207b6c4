"""Rollouts: the sampled-sequence record (``Rollout``) and the dump format that carries it between tools.

from roundalign.rollouts import Rollout, read_engine_logprobs, write_engine_logprobs
"""

from roundalign.rollouts.jsonl import JSONLError, read_engine_logprobs, read_rollouts, write_engine_logprobs
from roundalign.rollouts.record import Rollout

__all__ = ["JSONLError", "Rollout", "read_engine_logprobs", "read_rollouts", "write_engine_logprobs"]
