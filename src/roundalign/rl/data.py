"""The RL tasks: arithmetic word problems with a verifiable reward, a fixed held-out split, and per-step batches.

The shipped tiny-qwen3 was pretrained on a mix of levels 1/2/3 (40/35/25%) and solves level 3 greedily 55% of the
time (docs/tiny-model.md), so the default RL task, level 3 alone, is harder than its pretraining mix yet leaves
every group of samples a fair chance of mixed rewards, which GRPO needs. The reward is exact: 1.0 when the
completion's final "The answer is N." matches, else 0.0 (``roundalign.tasks.arithmetic.reward``).

Held-out split: ``eval_problems`` problems drawn once from their own seed stream; a training batch never contains a
prompt that is in it. Training batches are a pure function of (run seed, step), so a resumed run sees exactly the
batches the uninterrupted run would have seen, without saving any sampler state. A batch takes fresh draws until it
has its prompts; a task with so few distinct prompts that ``MAX_DRAWS`` draws do not is an error, not a hang.

With ``--domains``, the task is ``MultiDomainTask``: reasoning-gym's domains (``roundalign.tasks.gym``) scored by its
own verifiers, with the same held-out rule per domain. Both tasks answer ``prompt``, ``reward`` and ``domain``.
"""

from __future__ import annotations

import hashlib

from roundalign.errors import UserError
from roundalign.tasks.arithmetic import Problem, format_prompt, make_problems, reward

EVAL_SEED_BASE = 1_000_003  # eval problems come from seeds far from any training step's
MAX_DRAWS = 32  # fresh draws a batch may take to skip the held-out prompts; bounded, never a hang


def _step_seed(seed: int, step: int, what: str) -> int:
    """A 63-bit seed derived from (run seed, step, purpose) with sha256: stable across Python runs and platforms."""
    digest = hashlib.sha256(f"roundalign.rl/{what}/{seed}/{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def sampling_seed(seed: int, step: int) -> int:
    """The engine's sampling seed for a step's rollouts."""
    return _step_seed(seed, step, "sampling")


def _outside(held_out: set[str], want: int, draw, what: str, fix: str) -> list:
    """The first ``want`` items of ``draw(0)``, ``draw(1)``, ... whose prompts are not in ``held_out``. A UserError
    naming ``what`` and the ``fix`` when ``MAX_DRAWS`` draws do not find them (too few distinct prompts)."""
    items: list = []
    for i in range(MAX_DRAWS):
        if len(items) >= want:
            break
        items += [it for it in draw(i) if it.prompt not in held_out][: want - len(items)]
    if len(items) < want:
        raise UserError(
            f"{what}: {MAX_DRAWS} draws found only {len(items)} of {want} prompts outside the held-out split; it has "
            f"too few distinct prompts: {fix}"
        )
    return items


class Task:
    """Problems of one level: ``eval_set`` (fixed) and ``train_batch(step)`` (disjoint from it)."""

    def __init__(self, level: int, seed: int, eval_problems: int):
        self.level, self.seed = level, seed
        self.eval_set = make_problems(eval_problems, level, EVAL_SEED_BASE + seed)
        self._held_out = {p.prompt for p in self.eval_set}

    def train_batch(self, step: int, n: int) -> list[Problem]:
        """``n`` problems for ``step``: drawn from the step's own seed, skipping held-out prompts."""

        def draw(i: int) -> list[Problem]:
            return make_problems(2 * n, self.level, _step_seed(self.seed, step, f"problems/{i}") % 2**31)

        return _outside(self._held_out, n, draw, f"level {self.level}", "lower --eval-problems or use another --level")

    @staticmethod
    def prompt(problem: Problem) -> str:
        return format_prompt(problem)

    domains = ("arithmetic",)

    @staticmethod
    def reward(text: str, problem: Problem) -> float:
        return reward(text, problem)

    @staticmethod
    def domain(problem: Problem) -> int:
        return 0


class MultiDomainTask:
    """reasoning-gym domains (``roundalign.tasks.gym``): each domain's held-out items, and per-step batches that
    give every domain an equal share of the prompts (prompt i of a step comes from domain i mod D), so each
    domain's reward and OSOL's focus domain always have samples.

    Held-out split: ``eval_problems`` items per domain, drawn once from their own seed; a training batch skips their
    prompts. A domain with so few distinct prompts that the held-out split leaves none to train on is an error.
    The held-out items do not depend on the run's seed: they are the ones tiny-llama-chars was pre-trained without
    (scripts/train_gym_model.py draws the same), so every seed of a comparison is scored on items no run and not the
    model's pre-training saw. (Seed-dependent items were not held out from pre-training: seed 1's arithmetic items
    scored 0.61 against seed 0's 0.21 before any RL step.)"""

    def __init__(self, spec: str, seed: int, eval_problems: int):
        from roundalign.tasks import gym

        self._gym = gym
        self.spec, self.seed = spec, seed
        self._domains = gym.parse_domains(spec)
        self.domains = tuple(d.name for d in self._domains)
        self._index = {name: i for i, name in enumerate(self.domains)}
        self.eval_sets = {d.name: _unique(gym.make_items(d, eval_problems, EVAL_SEED_BASE)) for d in self._domains}
        self.eval_set = [item for items in self.eval_sets.values() for item in items]
        self._held_out = {item.prompt for item in self.eval_set}

    def train_batch(self, step: int, n: int) -> list:
        per_domain = {}
        for j, d in enumerate(self._domains):
            want = len(range(j, n, len(self._domains)))

            def draw(i: int, d=d, want=want) -> list:
                return self._gym.make_items(d, 2 * want, _step_seed(self.seed, step, f"gym/{d.name}/{i}"))

            per_domain[d.name] = _outside(
                self._held_out, want, draw, f"domain {d.name!r}", "lower --eval-problems or widen its datasets"
            )
        return [per_domain[self.domains[i % len(self.domains)]][i // len(self.domains)] for i in range(n)]

    @staticmethod
    def prompt(item) -> str:
        return item.prompt

    def reward(self, text: str, item) -> float:
        return self._gym.score(text, item)

    def domain(self, item) -> int:
        return self._index[item.domain]


def _unique(items: list) -> list:
    """``items`` without repeated prompts (a small domain draws some twice), in order."""
    seen: set[str] = set()
    return [it for it in items if not (it.prompt in seen or seen.add(it.prompt))]


def make_task(config):
    """The run's task: the arithmetic problems of ``--level``, or ``--domains``' reasoning-gym domains."""
    if config.domains:
        return MultiDomainTask(config.domains, config.seed, config.eval_problems)
    return Task(config.level, config.seed, config.eval_problems)
