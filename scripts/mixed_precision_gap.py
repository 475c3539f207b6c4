"""How far each way of running the trainer in bf16 is from the engine, on the shipped model (docs/mixed-precision.md).

The engine (``roundalign.engine``, kernels backend, ``--profile``) samples completions and re-scores them in
prefill, so only the rounding locations differ. The trainer recomputes the same tokens four ways, all from the same
fp32 master weights:

- ``bf16 stock``: the weights cast to bf16, stock HF (the probe's ``hf`` trainer);
- ``autocast stock``: fp32 parameters under ``torch.autocast("cpu", bf16)``, stock HF (HF Trainer / TRL bf16=True);
- ``autocast patched``: the same, after ``roundalign.apply(model, profile, allow_non_bf16=True)``;
- ``bf16 patched``: the bf16 weights, patched (the core issue's setting).

It prints k3_kl (verl's ``rollout_corr/k3_kl``) and the bitwise-equal token fraction for each. Run:
``.venv/bin/python scripts/mixed_precision_gap.py [--profile vllm] [--prompts 32] [--max-tokens 48]``.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import transformers

import roundalign
import roundalign.models
from roundalign.engine import Engine, SamplingParams
from roundalign.probe.metrics import mismatch_metrics
from roundalign.probe.trainer import Rollout, TrainerSide
from roundalign.tasks import arithmetic


def _trainer_logprobs(model, completions, autocast: bool) -> list[torch.Tensor]:
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx:
        return [TrainerSide.token_logprobs(model, Rollout(c.prompt_token_ids, c.token_ids)) for c in completions]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="vllm")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    torch.set_num_threads(1)

    path = roundalign.models.path()
    master = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    engine = Engine(master, args.profile, tokenizer=tokenizer)
    prompts = [arithmetic.format_prompt(p) for p in arithmetic.make_problems(args.prompts, level=3, seed=0)]
    completions = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=0))
    rollout = engine.score([c.prompt_token_ids for c in completions], [c.token_ids for c in completions])

    def bf16_model():
        m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        m.load_state_dict(master.state_dict())
        return m.eval()

    patched32 = roundalign.apply(
        transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
        args.profile,
        allow_non_bf16=True,
    )
    sides = {
        "bf16 stock": (bf16_model(), False),
        "autocast stock": (master.eval(), True),
        "autocast patched": (patched32, True),
        "bf16 patched": (roundalign.apply(bf16_model(), args.profile), False),
    }
    tokens = sum(len(c.token_ids) for c in completions)
    print(
        f"engine: {args.profile} (kernels backend, prefill re-score); {len(completions)} completions, {tokens} tokens"
    )
    print(f"{'trainer':<18} {'rollout_corr/k3_kl':>20} {'bitwise-equal tokens':>22}")
    for name, (model, autocast) in sides.items():
        m = mismatch_metrics(_trainer_logprobs(model, completions, autocast), rollout)
        print(f"{name:<18} {m['rollout_corr/k3_kl']:>20.3e} {m['mismatch/bitwise_equal_frac']:>22.3f}")


if __name__ == "__main__":
    main()
