"""Tiny bf16 models of the four supported families, built from Config objects (no hub access)."""

from __future__ import annotations

import torch
import transformers

FAMILIES = ("qwen2", "qwen3", "qwen3_moe", "llama")

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=97,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def config(family: str, **overrides):
    kw = dict(_COMMON)
    if family == "qwen2":
        cls = transformers.Qwen2Config
    elif family == "qwen3":
        cls, kw["head_dim"] = transformers.Qwen3Config, 16
    elif family == "qwen3_moe":
        cls = transformers.Qwen3MoeConfig
        kw.update(
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            norm_topk_prob=True,
        )
    elif family == "llama":
        cls = transformers.LlamaConfig
    else:
        raise ValueError(family)
    kw.update(overrides)
    return cls(**kw)


def build(family: str, seed: int = 0, dtype=torch.bfloat16, **overrides):
    """A randomly initialised *ForCausalLM in ``dtype`` with eager attention, loaded the ``dtype=`` way."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config(family, **overrides), dtype=dtype, attn_implementation="eager"
    )
    # Larger norm weights than the init's ones, so that every rounding point sees varied values.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn_like(p, dtype=torch.float32))
    return model.eval()


def token_ids(vocab: int = 97, batch: int = 2, length: int = 13, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return logits.detach(), grads(model)
