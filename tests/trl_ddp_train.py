"""Two-process GRPO training with the engine as sampler, run by test_integration_trl.py as
``accelerate launch --multi_gpu --num_processes 2 tests/trl_ddp_train.py --out DIR`` on a machine without GPU:
DDP over gloo, on the CPU.

Each rank patches the policy right after building the trainer (``patch_policy(trainer)``), attaches its own
``EngineRolloutFunc``, trains 2 steps, and writes ``DIR/rank{N}.json``: its log history, whether its engine serves the
RNE export of its (DDP-synchronised) fp32 master, a digest of the served bytes, and the completions it sampled.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch

import roundalign
import trl_setup
from roundalign.integrations.trl import EngineRolloutFunc, patch_policy, unwrap_policy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    torch.set_num_threads(1)
    model, tokenizer = trl_setup.policy(fp32=True)
    trainer = trl_setup.trainer(
        model, tokenizer, str(out / "trainer"), steps=2, generations=4, per_device_train_batch_size=4
    )
    patch_policy(trainer, "vllm")  # after construction: patches the unwrapped policy
    rollout = EngineRolloutFunc(engine_profile="vllm", sync="rne", attribution_every=1, prefill_check=True).attach(
        trainer
    )
    trainer.train()

    policy = unwrap_policy(trainer)
    served = rollout.engine.weights.state_dict()
    master = policy.state_dict()
    digest = hashlib.sha256()
    for name in sorted(master):
        digest.update(served[name].view(torch.int16).numpy().tobytes())
    result = {
        "rank": trainer.accelerator.process_index,
        "world_size": trainer.accelerator.num_processes,
        "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        "device": str(trainer.accelerator.device),
        "ddp_wrapped": trainer.model_wrapped is not policy,
        "policy_profile": roundalign.patched_profile(policy).name,
        "syncs": rollout.syncs,
        "served_is_rne_of_master": all(torch.equal(served[n], t.to(torch.bfloat16)) for n, t in master.items()),
        "served_digest": digest.hexdigest(),
        "completions": rollout.last_rollout["completion_ids"],
        "logs": trl_setup.step_logs(trainer),
    }
    (out / f"rank{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
