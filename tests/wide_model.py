"""A higher-entropy Qwen3 of another shape than the shipped one, for the real-engine tests and their figures.

The shipped tiny-qwen3 is trained and very confident (about 0.05 nats at its sampled tokens), which flatters
bitwise-equal fractions: most tokens have a log-prob near 0, where bf16 differences vanish. This model is random
but scaled so that its next-token distributions carry about 1.2 nats, as a trained model on open-ended text does,
and it differs in shape: head_dim 128 (the common size of real Qwen3/Llama models), hidden 512, 6 layers, GQA 8:2,
untied embeddings. It reuses the shipped tokenizer (vocabulary 264), so the same prompts run on both.

``build_llama`` is the same idea in the other family the engine tests need: a Llama with head_dim 128 (hidden 256,
2 query heads on 1 KV head, 3 layers), random with the same init and LM-head scale; ``build_qwen2`` a Qwen2 with
q/k/v biases (head_dim 64, 2 layers), for the quantized layers' bias epilogue.

    python tests/wide_model.py OUT_DIR [--llama]      # build it (deterministic: seed 0), as the tests do
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

SEED = 0
# HF's default init: the residual stream grows gently through the layers (std 0.15 after the first, 0.53 after the
# last), as in a trained model. A larger init (0.08 was tried) makes the random layers amplify every perturbation,
# so that kernel differences alone leave no token bitwise equal and every profile looks the same.
INIT_STD = 0.02
# The LM head is scaled up so that next-token entropies are about 1.25 nats (measured on random prompts: 4.2 nats at
# x4, 2.2 at x8, 1.25 at x12, 0.83 at x16).
LOGIT_SCALE = 12.0


def _build(out: str | Path, config_class, model_class, prepare=None, **config) -> Path:
    """A random model of ``config`` (seed ``SEED``, HF's init at ``INIT_STD``), ``prepare``d, saved by ``_save`` into
    ``out`` unless it is there already; returns ``out``."""
    out = Path(out)
    if (out / "model.safetensors").is_file():
        return out
    common = dict(vocab_size=264, tie_word_embeddings=False, initializer_range=INIT_STD, bos_token_id=0,
                  eos_token_id=0, pad_token_id=0)  # fmt: skip
    torch.manual_seed(SEED)
    model = model_class(config_class(**common, **config))
    if prepare is not None:
        prepare(model)
    return _save(model, out)


def build(out: str | Path) -> Path:
    """Write the model (bf16 safetensors, config, the shipped tokenizer) into ``out``; returns ``out``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _build(
        out, Qwen3Config, Qwen3ForCausalLM, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=512,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    )  # fmt: skip


def _save(model, out: Path) -> Path:
    """Random norm weights around 1 (so the norms' rounding is not a multiply by exactly 1), the LM head scaled to
    ``LOGIT_SCALE``, saved in bf16 with the shipped tokenizer."""
    from roundalign import models

    model = model.to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p, dtype=torch.float32))
        model.lm_head.weight.mul_(LOGIT_SCALE)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(models.path("tiny-qwen3") / name, out / name)
    return out


def build_llama(out: str | Path) -> Path:
    """A random Llama (head_dim 128) in ``out``, like ``build``; returns ``out``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _build(
        out, LlamaConfig, LlamaForCausalLM, hidden_size=256, intermediate_size=768, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=512,
        rope_theta=500_000.0, rms_norm_eps=1e-5,
    )  # fmt: skip


def build_qwen2(out: str | Path) -> Path:
    """A random Qwen2 (biases on q/k/v, head_dim 64) in ``out``, like ``build``; returns ``out``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    def biases(model) -> None:  # biases that matter (HF initializes them to zero)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("_proj.bias"):
                    p.normal_(0, 0.5)

    return _build(
        out, Qwen2Config, Qwen2ForCausalLM, biases, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
    )  # fmt: skip


if __name__ == "__main__":
    print(build_llama(sys.argv[1]) if "--llama" in sys.argv[2:] else build(sys.argv[1]))
