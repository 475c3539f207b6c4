"""Run a function on N CPU processes joined by a gloo process group, and collect what each rank returns.

FSDP2 and DDP need a real process group; these tests build one on the CPU with gloo, the backend verl and
accelerate use when there is no GPU. ``spawn_gloo(fn, 2, *args)`` starts the ranks with the ``spawn`` start method
(the parent may hold threads, so ``fork`` is not safe), so ``fn`` must be a top-level function in an importable test
module. Each rank's return value comes back through ``torch.save`` in a temporary folder, and a rank that raises
fails the call with that rank's traceback.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, out: str, fn, args) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    faulthandler.enable()  # a rank that crashes in native code prints its Python stack (pytest shows the stderr)
    torch.set_num_threads(1)  # two ranks on a 2-core machine
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": result}, Path(out) / f"rank{rank}.pt")
    except BaseException:
        torch.save({"error": traceback.format_exc()}, Path(out) / f"rank{rank}.pt")
        raise
    finally:
        dist.destroy_process_group()


def spawn_gloo(fn, world_size: int, *args) -> list:
    """``[fn(rank, world_size, *args) for each rank]``, each run in its own process of one gloo group."""
    with tempfile.TemporaryDirectory() as out:
        try:
            mp.start_processes(
                _rank_main, args=(world_size, _free_port(), out, fn, args), nprocs=world_size, start_method="spawn"
            )
        except mp.ProcessRaisedException:
            pass  # the rank's own traceback, saved below, says more than the re-raised summary
        results = []
        for rank in range(world_size):
            path = Path(out) / f"rank{rank}.pt"
            if not path.exists():
                raise RuntimeError(f"rank {rank} of {world_size} exited without a result")
            got = torch.load(path, weights_only=False)
            if "error" in got:
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{got['error']}")
            results.append(got["ok"])
        return results


__all__ = ["spawn_gloo"]
