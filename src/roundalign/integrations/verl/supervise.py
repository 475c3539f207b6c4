"""Run verl's ``main_ppo`` as a child process, and say which process failed first when it fails.

verl's loop is many processes: the driver, Ray's GCS and raylet, the TaskRunner, the FSDP ranks, the vLLM servers
and their engine cores and workers, the agent loops. Two things a user needs from a launcher follow:

- **No hang, no leftovers.** When a vLLM engine process dies, verl's driver can wait for it forever (nothing tells
  it). ``supervise`` runs verl in its own process group and kills the group (the driver, Ray's services, and with
  them every worker) when a traceback in the log is not followed by the run's end within ``FATAL_GRACE_S``, past the
  timeout, or on Ctrl-C.
- **The cause, not its echo.** Ray and vLLM interleave every process's output in one log, each line prefixed with
  the actor or worker and its pid. ``first_failure`` reports the first traceback and the process that raised it;
  the driver's ``RayTaskError`` that repeats it comes later.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

# After a fatal error in an engine process verl's driver can wait forever (the engine core died; nothing tells the
# driver). A traceback in the log that the run does not end within this long is taken as that.
FATAL_GRACE_S = 90
_TRACEBACK = b"Traceback (most recent call last)"


def supervise(command: list[str], env: dict, out: Path, timeout: float) -> int:
    """Run verl in its own process group with its output in ``verl.log``; kill the group (driver, Ray's GCS and
    raylet, and with them every worker) on a hang after a traceback, past ``timeout`` seconds (0: none), or on
    Ctrl-C, so a failed run leaves no processes behind. The exit status (-9 when killed)."""
    log_path = out / "verl.log"
    with open(log_path, "wb") as log, open(log_path, "rb") as tail:
        proc = subprocess.Popen(command, env=env, cwd=out, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        start, failed_at, seen = time.monotonic(), None, b""
        try:
            while proc.poll() is None:
                time.sleep(2)
                now = time.monotonic()
                if failed_at is None:
                    # only what verl wrote since the last look, with the marker's length of overlap in front
                    seen = seen[-len(_TRACEBACK) :] + tail.read()
                    if _TRACEBACK in seen:
                        failed_at = now
                if (failed_at is not None and now - failed_at > FATAL_GRACE_S) or (timeout and now - start > timeout):
                    _kill_group(proc)
        finally:
            if proc.poll() is None:
                _kill_group(proc)
    return proc.returncode


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PROCESS = re.compile(r"^((?:\([A-Za-z0-9_]+ pid=\d+\)\s*)+)")  # Ray's "(Actor pid=N)", vLLM's "(Worker pid=N)"
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b")


def first_failure(log: str, context: int = 12) -> str:
    """The first traceback in verl's combined log, with the process that raised it (Ray and vLLM prefix each line
    with the actor or worker and its pid): the rank or engine that failed first, not the driver's echo of it."""
    lines = [_ANSI.sub("", line) for line in log.splitlines()]
    for i, line in enumerate(lines):
        if "Traceback (most recent call last)" not in line:
            continue
        match = _PROCESS.match(line)
        who = match.group(1).strip() if match else "the driver"
        frames = []
        for later in lines[i + 1 :]:
            if (_PROCESS.match(later).group(1).strip() if _PROCESS.match(later) else "the driver") != who:
                continue
            text = re.sub(r"^.*?\[[\w.]+:\d+\] ", "", later[len(match.group(1)) :] if match else later)
            frames.append(text)
            if _RAISED.match(text.strip()):
                break
        return f"{who} raised {frames[-1].strip() if frames else '(no exception line)'}\n" + "\n".join(
            frames[-context:]
        )
    return "no traceback in the log; its last lines:\n" + "\n".join(lines[-context:])


__all__ = ["FATAL_GRACE_S", "first_failure", "supervise"]
