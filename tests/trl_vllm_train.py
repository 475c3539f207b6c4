"""The TRL side of tests/test_real_vllm_trl.py, run in the engine's Python (vLLM and TRL 1.16 installed there).

    python tests/trl_vllm_train.py OUT.pt [SCHEME]

TRL's ``GRPOTrainer`` on the shipped tiny-qwen3 (fp32 parameters, ``bf16=True`` autocast: TRL's usual setup),
sampling with the real vLLM in ``enforce_eager`` mode through ``VllmRolloutFunc``, RNE sync after every step. One
vLLM serves two runs: a stock HF policy (2 steps), then the policy patched with the build's ``-kernels`` profile
(3 steps). Writes, per generation batch of each run: the sampler's log-probs as TRL holds them
(``sampling_per_token_logps``), TRL's recompute (``old_per_token_logps``), the loss forward's log-probs with the
completions they belong to (TRL shuffles the batch before the loss), the masks, the IS ratio and the step's logs.
With SCHEME, vLLM serves a quantized copy in that scheme (docs/quantization.md), and the exact policy computes it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import trl_setup  # noqa: E402
from roundalign import models  # noqa: E402
from roundalign.integrations.trl import patch_policy  # noqa: E402
from roundalign.integrations.trl_vllm import VllmRolloutFunc  # noqa: E402

TEMPERATURE = 0.9


def run(rollout: VllmRolloutFunc, out: str, steps: int, profile: str | None) -> dict:
    model, tokenizer = trl_setup.policy(fp32=True)
    if profile is not None:
        patch_policy(model, profile)
    trainer = trl_setup.trainer(
        model, tokenizer, out, steps=steps, temperature=TEMPERATURE, rollout_func=rollout,
        rewards=(trl_setup.reward_exact, trl_setup.reward_brevity),  # a gradient at every step, on every CPU
    )  # fmt: skip
    rollout.attach(trainer)
    batches, scored = [], []
    generate, score = trainer._generate_and_score_completions, trainer._get_per_token_logps_and_entropies

    def generate_and_record(inputs):
        output = generate(inputs)
        keys = ("completion_ids", "completion_mask", "sampling_per_token_logps", "old_per_token_logps")
        batches.append({k: output[k].detach().clone() for k in keys} | {"is": output["importance_sampling_ratio"]})
        return output

    def score_and_record(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        result = score(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        scored.append((input_ids[:, -logits_to_keep:].clone(), result[0].detach().clone()))
        return result

    trainer._generate_and_score_completions = generate_and_record
    trainer._get_per_token_logps_and_entropies = score_and_record
    trainer.train()
    return {"batches": batches, "scored": scored, "logs": trl_setup.step_logs(trainer), "syncs": rollout.syncs}


def main(out: str, quantization: str | None = None) -> None:
    torch.manual_seed(0)
    model_dir = models.path("tiny-qwen3")
    stock = VllmRolloutFunc(model_dir, enforce_eager=True, seed=3, quantization=quantization)
    result = {"trainer_profile": stock.trainer_profile, "stock": run(stock, out + ".stock", 2, None)}
    exact = VllmRolloutFunc(model_dir, enforce_eager=True, seed=3, engine=stock.vllm, quantization=quantization)
    result["exact"] = run(exact, out + ".exact", 3, exact.trainer_profile)
    torch.save(result, out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
