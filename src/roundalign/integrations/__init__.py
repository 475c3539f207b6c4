"""Integrations with the RL frameworks our users already run: TRL's GRPOTrainer and verl.

Each lives in its own module and imports its framework lazily, so ``import roundalign`` never needs TRL or verl:

- ``roundalign.integrations.trl`` (extra ``[trl]``): patch the policy, a ``rollout_func`` backed by the reference
  engine, weight sync with the ``roundalign.sync`` export modes, and a callback that logs the mismatch metrics;
- ``roundalign.integrations.trl_osol``: OSOL's per-token advantage (``roundalign.rl.osol``) in a ``GRPOTrainer``;
- ``roundalign.integrations.verl``: the call for verl's model-patching seam and the Fair Cast export hook for its
  weight sync.
"""
