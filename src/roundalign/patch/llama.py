"""Llama family (``model_type="llama"``): which HF modules get aligned numerics.

No q/k norm; RoPE types default and llama3.

Source: transformers ``models/llama/modeling_llama.py`` (5.x). The decoder norms and the final norm share
``LlamaRMSNorm``; each instance gets its own rule at patch time.
"""

from transformers.models.llama import modeling_llama as hf

from roundalign.patch.registry import define_family

FAMILY = define_family(
    "llama",
    globals(),
    has_qk_norm=False,
    norm=hf.LlamaRMSNorm,
    mlp=hf.LlamaMLP,
    attention=hf.LlamaAttention,
    decoder_layer=hf.LlamaDecoderLayer,
    rotary=hf.LlamaRotaryEmbedding,
)
