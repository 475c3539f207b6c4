"""``python -m roundalign.integrations.verl.main_ppo [hydra overrides]``: verl's ``main_ppo`` with roundalign on.

The same command line as ``python -m verl.trainer.main_ppo``, with ``ROUNDALIGN_PROFILE`` / ``ROUNDALIGN_SYNC`` /
``ROUNDALIGN_SYNC_SEED`` in the environment. Before handing over to verl's hydra ``main`` it

1. checks the variables (a typo fails here, not in a Ray worker twenty minutes later) and installs the hooks in the
   driver process;
2. makes verl's ``get_ppo_ray_runtime_env`` add the variables and Ray's ``worker_process_setup_hook``
   (``roundalign.integrations.verl.activate``) to the runtime env that ``run_ppo`` passes to ``ray.init``, so every
   TaskRunner and worker actor runs ``activate()`` at start-up.

With ``VERL_PLATFORM=cpu`` it also selects verl's CPU platform (``cpu.py``) in the driver and every worker, with or
without ``ROUNDALIGN_*`` settings.

With a Ray cluster that is already running (``ray.init`` skipped by verl), put the same two things in the job's
runtime env instead (``docs/verl.md``).
"""

from __future__ import annotations

import os
import sys

from roundalign.integrations.verl import cpu
from roundalign.integrations.verl.activation import activate, ray_runtime_env, settings_from_env


def prepare() -> dict | None:
    """Steps 1 and 2 above; returns the settings (None when no ROUNDALIGN_* variable is set)."""
    if cpu.active():  # VERL_PLATFORM=cpu: verl's CPU platform in the driver (before verl is imported) and workers
        os.environ.update(cpu.environment())
    settings = settings_from_env()
    if settings is None:
        print(
            "roundalign: no ROUNDALIGN_PROFILE / ROUNDALIGN_SYNC set; running verl's main_ppo unchanged",
            file=sys.stderr,
        )
        if not cpu.active():
            return None
    else:
        activate()
    import verl.trainer.main_ppo as verl_main

    verl_runtime_env = verl_main.get_ppo_ray_runtime_env
    if not getattr(verl_runtime_env, "_roundalign", False):

        def get_ppo_ray_runtime_env(*args, **kwargs):
            return ray_runtime_env(verl_runtime_env(*args, **kwargs))

        get_ppo_ray_runtime_env._roundalign = True
        verl_main.get_ppo_ray_runtime_env = get_ppo_ray_runtime_env
    return settings


def main() -> None:
    prepare()
    import verl.trainer.main_ppo as verl_main

    verl_main.main()  # hydra reads sys.argv, as under python -m verl.trainer.main_ppo


if __name__ == "__main__":
    main()
