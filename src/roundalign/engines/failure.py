"""When the real engine fails in this process: an ``EngineFailed`` (exit 7) with the engine's own last log lines.

``train --engine vllm`` and ``roundalign dump`` run vLLM in their own process. An exception from inside vLLM (its
engine core dead, a kernel failing, memory gone) is the engine's failure, not bad input and not a bug of ours, and the
user needs what the engine said last: ``capture`` keeps the last ``LOG_TAIL`` records of vLLM's loggers, and
``guard(what)`` turns an exception raised inside it into ``EngineFailed`` naming the call, the exception and those
lines. A run killed outright (SIGKILL, the out-of-memory killer) leaves no message; ``train --resume`` continues it
from its last checkpoint, and a dump directory is only ever whole (``rollouts/dumpdir.py``).

``ROUNDALIGN_ENGINE_FAULT=CALL:N`` (a test hook) raises inside the guard on the N-th ``CALL`` (``generate``,
``load_weights``), as a crashing engine would.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os

from roundalign.errors import ExitStatus, Failure

LOG_TAIL = 25
FAULT_ENV = "ROUNDALIGN_ENGINE_FAULT"


class EngineFailed(Failure):
    """The real engine failed: the message holds what failed and the end of the engine's log."""

    status = ExitStatus.ENGINE_FAILED


class _Tail(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: collections.deque[str] = collections.deque(maxlen=LOG_TAIL)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self.lines.append(self.format(record))


_tail = _Tail()
_calls: collections.Counter = collections.Counter()


def capture(logger: str = "vllm") -> None:
    """Keep the last lines the engine logs (idempotent). Call it once the engine is up: vLLM applies its logging
    configuration (``logging.config.dictConfig``) while it starts, which drops handlers added before."""
    log = logging.getLogger(logger)
    if _tail not in log.handlers:
        log.addHandler(_tail)


@contextlib.contextmanager
def guard(what: str, resume_hint: str = ""):
    """Run the engine's ``what``; an exception from inside it becomes ``EngineFailed``."""
    _calls[what] += 1
    capture()
    try:
        if os.environ.get(FAULT_ENV) == f"{what}:{_calls[what]}":
            raise RuntimeError(f"simulated engine failure ({FAULT_ENV})")
        yield
    except Failure:
        raise  # ours: already says what is wrong
    except Exception as e:
        lines = "\n".join(_tail.lines) or "(the engine logged nothing)"
        raise EngineFailed(
            f"the engine failed during {what}: {type(e).__name__}: {e}{resume_hint}\nits last log lines:\n{lines}"
        ) from e


__all__ = ["FAULT_ENV", "LOG_TAIL", "EngineFailed", "capture", "guard"]
