"""rl/data.py's training batches: the first fresh draws of the step's seeds whose prompts are not held out, and a
clear error, not a hang, for a task with too few distinct prompts.

The reference here is written from the module's documented rule (a step's draw i comes from sha256 of
``roundalign.rl/<purpose>/<run seed>/<step>``, twice the wanted count, held-out prompts skipped, in draw order), not
from its code, so a change that alters which prompts a run trains on fails here.
"""

from __future__ import annotations

import hashlib

import pytest

from roundalign.errors import UserError
from roundalign.rl import data
from roundalign.rl.data import MAX_DRAWS, MultiDomainTask, Task
from roundalign.tasks.arithmetic import make_problems


def _seed(what: str, seed: int, step: int) -> int:
    digest = hashlib.sha256(f"roundalign.rl/{what}/{seed}/{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _first_outside(held_out: set[str], want: int, draw) -> list:
    out, i = [], 0
    while len(out) < want:
        out += [x for x in draw(i) if x.prompt not in held_out][: want - len(out)]
        i += 1
    return out


@pytest.mark.parametrize("seed", [0, 5])
def test_arithmetic_batches_are_the_first_draws_outside_the_held_out_split(seed):
    task = Task(level=1, seed=seed, eval_problems=200)
    held_out = {p.prompt for p in make_problems(200, 1, data.EVAL_SEED_BASE + seed)}
    for step in (1, 2, 9):
        want = _first_outside(
            held_out, 16, lambda i, s=step: make_problems(32, 1, _seed(f"problems/{i}", seed, s) % 2**31)
        )
        got = task.train_batch(step, 16)
        assert got == want and not {p.prompt for p in got} & held_out


def test_multi_domain_batches_are_each_domains_first_draws_outside_the_held_out_split():
    pytest.importorskip("reasoning_gym")
    from roundalign.tasks import gym

    task = MultiDomainTask("arithmetic,probability", seed=3, eval_problems=32)
    domains = gym.parse_domains("arithmetic,probability")
    held_out = {it.prompt for d in domains for it in gym.make_items(d, 32, data.EVAL_SEED_BASE)}
    for step in (1, 4):
        per = [
            _first_outside(held_out, 3, lambda i, d=d, s=step: gym.make_items(d, 6, _seed(f"gym/{d.name}/{i}", 3, s)))
            for d in domains
        ]
        assert task.train_batch(step, 6) == [per[i % 2][i // 2] for i in range(6)]


def test_a_task_whose_draws_are_all_held_out_is_an_error_not_a_hang(monkeypatch):
    task = Task(level=1, seed=0, eval_problems=4)
    calls = []

    def only_held_out(n, level, seed):
        calls.append(seed)
        return task.eval_set[:1] * n

    monkeypatch.setattr(data, "make_problems", only_held_out)
    with pytest.raises(UserError, match=r"level 1: 32 draws found only 0 of 8 prompts .* --eval-problems"):
        task.train_batch(1, 8)
    assert len(calls) == MAX_DRAWS


def test_a_domain_with_too_few_distinct_prompts_is_an_error_that_names_it(monkeypatch):
    pytest.importorskip("reasoning_gym")
    task = MultiDomainTask("arithmetic,counting", seed=0, eval_problems=4)
    counting = task.eval_sets["counting"]
    real = task._gym.make_items
    monkeypatch.setattr(
        task._gym, "make_items", lambda d, n, seed: counting * n if d.name == "counting" else real(d, n, seed)
    )
    with pytest.raises(UserError, match=r"domain 'counting': 32 draws found only 0 of 2 prompts .* widen its datasets"):
        task.train_batch(1, 4)
