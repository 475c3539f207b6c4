"""With the engine's kernels in the trainer, does any single rounding rule other than the profile's come closer?

For vLLM's compiled mode, where the ``-kernels`` profile is not bitwise (docs/kernels.md): the trainer runs the
profile with vLLM's attention and GEMM, then the same with one region's rule changed at a time, against a dump's
sampler log-probs. If every change is worse, what remains is not a rounding location but the compiled element-wise
code's own arithmetic. Run it where vLLM is installed:

    .venv-vllm/bin/python scripts/kernels_rule_sweep.py MODEL_DIR DUMP_DIR [PROFILE]    # default vllm-0.32-cpu-kernels
"""

from __future__ import annotations

import sys

import torch

from roundalign.profiles import SEARCHED_ROPE_RULES, QKNormRule, ResidualRule, RMSNormRule, SwiGLURule, get_profile
from roundalign.rollouts.dumpdir import read_dump
from roundalign.trainer import TrainerSide, load_trainer_model


def main(model_dir: str, dump_dir: str, profile: str = "vllm-0.32-cpu-kernels") -> None:
    side = TrainerSide(load_trainer_model(model_dir))
    config = side.model.config
    dump = read_dump(dump_dir, vocab_size=config.vocab_size, max_model_len=config.max_position_embeddings)
    sampler = torch.tensor([x for r in dump.rollouts for x in r.logprobs])

    def score(p) -> str:
        delta = (torch.cat(side.logprobs(p, dump.rollouts)) - sampler).double()
        return f"bitwise {(delta == 0).double().mean():.1%}, RMS log-ratio {delta.pow(2).mean().sqrt():.4f}"

    base = get_profile(profile)
    print(f"{base.name}: {score(base)}", flush=True)
    alternatives = [("rms_norm", r) for r in RMSNormRule] + [("qk_norm", r) for r in QKNormRule]
    alternatives += [("residual", r) for r in ResidualRule] + [("swiglu", r) for r in SwiGLURule]
    alternatives += [("rope", r) for r in SEARCHED_ROPE_RULES]
    for region, rule in alternatives:
        if str(getattr(base, region)) != str(rule):
            print(f"  {region}={rule}: {score(base.replace(**{region: rule}))}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
