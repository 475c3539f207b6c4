"""Test hook: kill the training process at a named point of a step, as a crash would, to prove it recovers.

``ROUNDALIGN_KILL_AT=PHASE:STEP`` makes the run SIGKILL itself (no cleanup, no ``finally``, like the out-of-memory
killer or a pre-empted machine) when step ``STEP`` reaches ``PHASE``:

- ``sampling``: the engine has sampled the step's rollouts;
- ``recompute``: the trainer has recomputed their log-probs;
- ``backward``: gradients are accumulated, the optimizer has not stepped;
- ``export``: the exporter has rounded the new master (its state advanced), the engine has not loaded it;
- ``checkpoint``: the step's checkpoint is half written (in its temporary directory);
- ``metrics``: the step's metrics line is on disk, its checkpoint is not.

``tests/test_rl_chaos.py`` kills a run at each, resumes it, and compares its metrics bit for bit with an
uninterrupted run. The point is a dictionary lookup when the variable is unset. Not for users.
"""

from __future__ import annotations

import os
import signal

ENV = "ROUNDALIGN_KILL_AT"
PHASES = ("sampling", "recompute", "backward", "export", "checkpoint", "metrics")


def point(phase: str, step: int) -> None:
    """SIGKILL this process if ``ROUNDALIGN_KILL_AT`` is ``phase:step``."""
    if os.environ.get(ENV) == f"{phase}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["ENV", "PHASES", "point"]
