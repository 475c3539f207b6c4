"""The RL task: arithmetic word problems with a verifiable reward, a fixed held-out split, and per-step batches.

The shipped tiny-qwen3 was pretrained on a mix of levels 1/2/3 (40/35/25%) and solves level 3 greedily 55% of the
time (docs/tiny-model.md), so the default RL task, level 3 alone, is harder than its pretraining mix yet leaves
every group of samples a fair chance of mixed rewards, which GRPO needs. The reward is exact: 1.0 when the
completion's final "The answer is N." matches, else 0.0 (``roundalign.tasks.arithmetic.reward``).

Held-out split: ``eval_problems`` problems drawn once from their own seed stream; a training batch never contains a
prompt that is in it. Training batches are a pure function of (run seed, step), so a resumed run sees exactly the
batches the uninterrupted run would have seen, without saving any sampler state.
"""

from __future__ import annotations

import hashlib

from roundalign.tasks.arithmetic import Problem, format_prompt, make_problems

EVAL_SEED_BASE = 1_000_003  # eval problems come from seeds far from any training step's


def _step_seed(seed: int, step: int, what: str) -> int:
    """A 63-bit seed derived from (run seed, step, purpose) with sha256: stable across Python runs and platforms."""
    digest = hashlib.sha256(f"roundalign.rl/{what}/{seed}/{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def sampling_seed(seed: int, step: int) -> int:
    """The engine's sampling seed for a step's rollouts."""
    return _step_seed(seed, step, "sampling")


class Task:
    """Problems of one level: ``eval_set`` (fixed) and ``train_batch(step)`` (disjoint from it)."""

    def __init__(self, level: int, seed: int, eval_problems: int):
        self.level, self.seed = level, seed
        self.eval_set = make_problems(eval_problems, level, EVAL_SEED_BASE + seed)
        self._held_out = {p.prompt for p in self.eval_set}

    def train_batch(self, step: int, n: int) -> list[Problem]:
        """``n`` problems for ``step``: drawn from the step's own seed, skipping held-out prompts."""
        out: list[Problem] = []
        draw = 0
        while len(out) < n:
            fresh = make_problems(2 * n, self.level, _step_seed(self.seed, step, f"problems/{draw}") % 2**31)
            out += [p for p in fresh if p.prompt not in self._held_out][: n - len(out)]
            draw += 1
        return out

    @staticmethod
    def prompt(problem: Problem) -> str:
        return format_prompt(problem)
