"""tests/distributed.py: a failing rank is reported with its own error, not with a peer's collective timeout.

When one rank dies, the others fail in their next collective ("Connection closed by peer"); the harness must put the
rank that failed first, with its traceback or, when it left none, its exit status and the last lines it printed.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch.distributed as dist

from tests.distributed import describe_exit, spawn_gloo


def _ok(rank: int, world_size: int, scale: int) -> int:
    dist.barrier()
    return rank * scale + world_size


def _rank1_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one's own problem")
    dist.barrier()  # rank 0 waits here until rank 1's socket closes


def _rank1_exits_without_traceback(rank: int, world_size: int) -> None:
    if rank == 1:
        print("loading the actor, step 3 of 5")
        sys.stdout.flush()
        os._exit(3)  # as a native crash or a library's exit() would: no Python traceback
    dist.barrier()


def test_results_come_back_in_rank_order():
    assert spawn_gloo(_ok, 2, 10) == [2, 12]


@pytest.mark.parametrize(
    "fn, header, needles",
    [
        (_rank1_raises, "rank 1 of 2 (first to fail, exit code 1)", ["ValueError: rank one's own problem"]),
        (
            _rank1_exits_without_traceback,
            "rank 1 of 2 (first to fail, exit code 3)",
            ["no Python traceback (exit code 3)", "loading the actor, step 3 of 5"],
        ),
    ],
    ids=["traceback", "no-traceback"],
)
def test_the_first_rank_to_fail_is_named_with_its_own_error(fn, header, needles):
    with pytest.raises(RuntimeError) as info:
        spawn_gloo(fn, 2, grace_s=20)
    message = str(info.value)
    assert message.startswith(header)
    for needle in needles:
        assert needle in message
    assert "rank 0 of 2 (after" in message  # the peer's collective error comes after the cause
    assert message.index(needles[-1]) < message.index("rank 0 of 2")


def test_exit_statuses_are_named():
    assert describe_exit(-11) == "signal SIGSEGV (-11)"
    assert describe_exit(2) == "exit code 2"
    assert describe_exit(None) == "still running"
