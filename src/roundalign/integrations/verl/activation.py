"""Turn the verl hooks on from environment variables, in the driver and in every Ray worker, without forking verl.

verl runs its actor in Ray worker processes that never import roundalign. Two things carry the setting there:

- ``ROUNDALIGN_PROFILE`` (a profile name or a profile JSON path), ``ROUNDALIGN_SYNC`` (``rne`` | ``stochastic`` |
  ``error-feedback``) and ``ROUNDALIGN_SYNC_SEED`` (an int, default 0) ride in the Ray job's ``runtime_env``
  ``env_vars``, which Ray merges into every actor's environment, including actors verl starts with runtime envs of
  their own;
- Ray's ``worker_process_setup_hook`` (``runtime_env["worker_process_setup_hook"] =
  "roundalign.integrations.verl.activate"``) calls ``activate()`` as each worker process starts. Ray implements it
  as one more environment variable, so it reaches the same processes.

``activate()`` reads the variables and does nothing when none is set, so the hook is harmless in rollout, reward and
driver processes. When verl's FSDP engine module is not imported yet (a fresh worker), it installs the hooks the
moment that module finishes importing, so processes that never build an actor never import it.
``ray_runtime_env()`` adds both to a runtime env; ``roundalign.integrations.verl.main_ppo`` does that for verl's
``main_ppo``.
"""

from __future__ import annotations

import os
import sys

from roundalign.integrations.verl import cpu, hooks
from roundalign.integrations.verl.audit import ENV as AUDIT_ENV
from roundalign.integrations.verl.imports import after_import
from roundalign.sync import MODES as SYNC_MODES

ENV_PROFILE, ENV_SYNC, ENV_SEED = "ROUNDALIGN_PROFILE", "ROUNDALIGN_SYNC", "ROUNDALIGN_SYNC_SEED"
ENV_VARS = (ENV_PROFILE, ENV_SYNC, ENV_SEED, AUDIT_ENV)
SETUP_HOOK = "roundalign.integrations.verl.activate"
_ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"
_pending: list = []  # the settings an install waits with for the engine module (one per process)


def settings_from_env(environ=None) -> dict | None:
    """``{"profile", "sync", "seed", "audit"}`` from the ``ROUNDALIGN_*`` variables, or None when none is set."""
    import roundalign
    from roundalign.profiles import Profile

    env = os.environ if environ is None else environ
    raw = {k: env.get(k, "").strip() for k in ENV_VARS}
    if not any(raw.values()):
        return None
    profile = raw[ENV_PROFILE] or None
    if profile is not None:
        profile = Profile.load(profile) if profile.endswith(".json") else roundalign.get_profile(profile)
    sync = raw[ENV_SYNC] or None
    if sync is not None and sync not in SYNC_MODES:
        raise ValueError(f"{ENV_SYNC}={sync!r}: choose {', '.join(SYNC_MODES)} (or leave it unset)")
    try:
        seed = int(raw[ENV_SEED] or 0)
    except ValueError:
        raise ValueError(f"{ENV_SEED}={raw[ENV_SEED]!r} is not an integer") from None
    if raw[ENV_SEED] and sync != "stochastic":
        raise ValueError(f"{ENV_SEED} only seeds {ENV_SYNC}=stochastic, but {ENV_SYNC}={sync!r}")
    return {"profile": profile, "sync": sync, "seed": seed, "audit": bool(raw[AUDIT_ENV])}


def activate() -> dict | None:
    """Install the verl hooks this process's ``ROUNDALIGN_*`` variables ask for (Ray's worker setup hook)."""
    settings = settings_from_env()
    if settings is None:
        return None
    if _ENGINE_MODULE in sys.modules:
        return hooks.install(**settings)
    from roundalign.integrations.verl.seam import import_families

    import_families()  # now, before anything in this process can import Liger
    if not _pending:
        _pending.append(settings)
        after_import(_ENGINE_MODULE, lambda module: hooks.install(**settings))
    return settings


def ray_runtime_env(base: dict | None = None, environ=None) -> dict:
    """``base`` (a Ray runtime_env dict) plus the ``ROUNDALIGN_*`` variables that are set and the setup hook."""
    env = os.environ if environ is None else environ
    runtime_env = dict(base or {})
    hook = runtime_env.get("worker_process_setup_hook")
    if hook not in (None, SETUP_HOOK):
        raise ValueError(
            f"the runtime_env already has worker_process_setup_hook={hook!r}; Ray runs one hook per worker, so call "
            f"{SETUP_HOOK}() from that hook instead"
        )
    env_vars = dict(runtime_env.get("env_vars") or {})
    env_vars.update({k: env[k] for k in ENV_VARS if env.get(k, "").strip()})
    if cpu.active(env):  # verl's CPU platform (cpu.py), in every worker as in the driver
        env_vars.update(cpu.environment(env))
    runtime_env["env_vars"] = env_vars
    runtime_env["worker_process_setup_hook"] = SETUP_HOOK
    return runtime_env


__all__ = ["ENV_VARS", "SETUP_HOOK", "activate", "ray_runtime_env", "settings_from_env"]
