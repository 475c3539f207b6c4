"""Run a function on N CPU processes joined by a gloo process group, and collect what each rank returns.

FSDP2 and DDP need a real process group; these tests build one on the CPU with gloo, the backend verl and
accelerate use when there is no GPU. ``spawn_gloo(fn, 2, *args)`` starts the ranks with the ``spawn`` start method
(the parent may hold threads, so ``fork`` is not safe), so ``fn`` must be a top-level function in an importable test
module. Each rank's return value comes back through ``torch.save`` in a temporary folder.

When a rank fails, the error names the rank that failed *first* (by exit time, a peer's "Connection closed by peer"
counting as a consequence, never a cause) and shows its own traceback, or, when it died
without one (a native crash, ``os._exit``, a signal), its exit status and the last lines of what it printed. The
other ranks then usually fail too, in a collective ("Connection closed by peer"), and those secondary errors are
listed after it. Each rank writes its stdout and stderr (file descriptors 1 and 2, so native and faulthandler output
too) to a log of its own; the parent copies the logs to its stderr, which pytest shows with a failing test.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as std_mp
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from multiprocessing import connection
from pathlib import Path

import torch
import torch.distributed as dist

# After the first rank exits with an error, how long its peers get to notice and exit on their own (a gloo
# collective raises within a second or two when its peer's socket closes) before they are terminated.
PEER_GRACE_S = 30.0
LOG_TAIL_LINES = 40
# What a gloo collective raises on a rank whose peer died: that rank's error is a consequence, listed after the cause.
_PEER_FAILURE_NEEDLES = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _redirect_output(log: Path) -> None:
    """Send this process's fds 1 and 2 (Python, C++ and faulthandler output alike) to ``log``."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _rank_main(rank: int, world_size: int, port: int, out: str, fn, args) -> None:
    _redirect_output(Path(out) / f"rank{rank}.log")
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    faulthandler.enable()  # a rank that crashes in native code prints its Python stack into its log
    torch.set_num_threads(1)  # two ranks on a 2-core machine
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": result}, Path(out) / f"rank{rank}.pt")
    except BaseException:
        torch.save({"error": traceback.format_exc()}, Path(out) / f"rank{rank}.pt")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # not `raise`: the traceback is saved, and the process group must not hang the exit
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def describe_exit(code: int | None) -> str:
    """``exit code 1``, ``signal SIGSEGV (-11)``, or ``still running`` for a process's ``exitcode``."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name} ({code})"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _tail(path: Path, n: int = LOG_TAIL_LINES) -> str:
    if not path.exists():
        return "(no output)"
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-n:]) if lines else "(no output)"


def _wait(procs: list, grace_s: float) -> list[float]:
    """Wait for every process; once one fails, give the rest ``grace_s`` then terminate them. Exit times."""
    ended: dict[int, float] = {}
    deadline = float("inf")
    while len(ended) < len(procs):
        live = {p.sentinel: i for i, p in enumerate(procs) if i not in ended}
        ready = connection.wait(list(live), timeout=max(0.0, min(deadline - time.monotonic(), 1.0)))
        now = time.monotonic()
        for sentinel in ready:
            i = live[sentinel]
            procs[i].join()
            ended[i] = now
            if procs[i].exitcode != 0 and deadline == float("inf"):
                deadline = now + grace_s
        if now >= deadline:
            for i, p in enumerate(procs):
                if i not in ended:
                    p.terminate()
                    p.join(10)
                    if p.exitcode is None:
                        p.kill()
                        p.join()
                    ended[i] = time.monotonic()
    return [ended[i] for i in range(len(procs))]


def _peer_failure(detail: str) -> bool:
    """Whether a rank's error is the collective that saw a peer go away, rather than a cause of its own."""
    return any(needle in detail for needle in _PEER_FAILURE_NEEDLES)


def spawn_gloo(fn, world_size: int, *args, grace_s: float = PEER_GRACE_S) -> list:
    """``[fn(rank, world_size, *args) for each rank]``, each run in its own process of one gloo group."""
    ctx = std_mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out:
        port = _free_port()
        procs = [
            ctx.Process(target=_rank_main, args=(rank, world_size, port, out, fn, args), daemon=False)
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        ended = _wait(procs, grace_s)
        for rank in range(world_size):
            log = Path(out) / f"rank{rank}.log"
            if log.exists() and log.stat().st_size:
                sys.stderr.write(f"---- rank {rank} output ----\n{log.read_text(errors='replace')}\n")

        results, failures = [], []
        for rank, p in enumerate(procs):
            path = Path(out) / f"rank{rank}.pt"
            got = torch.load(path, weights_only=False) if path.exists() else None
            if got is not None and "ok" in got and p.exitcode == 0:
                results.append(got["ok"])
                continue
            if got is not None and "error" in got:
                detail = got["error"]
            else:
                detail = (
                    f"no Python traceback ({describe_exit(p.exitcode)}); the last lines it printed:\n"
                    f"{_tail(Path(out) / f'rank{rank}.log')}"
                )
            failures.append((ended[rank], rank, p.exitcode, detail))
        if failures:
            failures.sort(key=lambda f: (_peer_failure(f[3]), f[0], f[1]))
            parts = [
                f"rank {rank} of {world_size} ({'first to fail' if i == 0 else 'after'}, {describe_exit(code)}):\n"
                f"{detail}"
                for i, (_, rank, code, detail) in enumerate(failures)
            ]
            raise RuntimeError("\n\n".join(parts))
        return results


__all__ = ["describe_exit", "spawn_gloo"]
