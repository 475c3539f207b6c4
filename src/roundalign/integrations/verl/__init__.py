"""roundalign inside verl (0.9.1, FSDP engine): the engine's rounding points in the actor, and Fair Cast weight sync.

Three layers, each usable alone (``docs/verl.md``):

- ``patch_actor(module, profile)``: the call for verl's model-patching seam (after Liger and verl's
  ``apply_monkey_patch``, before ``.to(dtype)`` and FSDP), with checks of what Liger and verl did to the model;
- ``install(profile=, sync=, seed=)``: hooks verl's ``FSDPEngine`` in this process so that it calls ``patch_actor``
  at the seam and exports weights with ``ShardExporter`` (``roundalign.sync`` modes, consistent across FSDP shards);
- ``activate()`` reads ``ROUNDALIGN_PROFILE`` / ``ROUNDALIGN_SYNC`` / ``ROUNDALIGN_SYNC_SEED`` and installs; it is the
  Ray ``worker_process_setup_hook`` that ``ray_runtime_env()`` and ``python -m
  roundalign.integrations.verl.main_ppo`` (verl's ``main_ppo`` with the hook) put into every worker.

``write_rollout_logprobs(batch, path)`` dumps a verl batch's sampler log-probs for ``roundalign probe
--engine-logprobs``. Importing this package does not import verl; ``install`` does.

verl's whole loop on a machine without a GPU (docs/verl.md, "verl's whole loop on a CPU"): ``cpu`` is a platform
for verl's plugin hook (``VERL_PLATFORM=cpu``), ``rollout`` the vLLM side of the weight sync (vLLM's layer-wise
reload, and the read-back of what the engine serves), ``audit`` compares each sync's export with what every engine
replica serves, and ``python -m roundalign.integrations.verl.loop`` runs ``main_ppo`` on the arithmetic task.
"""

from roundalign.integrations.verl.activation import ENV_VARS, SETUP_HOOK, activate, ray_runtime_env, settings_from_env
from roundalign.integrations.verl.dump import rollouts_from_batch, write_rollout_logprobs
from roundalign.integrations.verl.export import ShardExporter, flat_offset
from roundalign.integrations.verl.hooks import install, installed, uninstall
from roundalign.integrations.verl.seam import PatchReport, patch_actor

__all__ = [
    "ENV_VARS", "SETUP_HOOK", "PatchReport", "ShardExporter", "activate", "flat_offset",
    "install", "installed", "patch_actor", "ray_runtime_env", "rollouts_from_batch", "settings_from_env", "uninstall",
    "write_rollout_logprobs",
]  # fmt: skip
