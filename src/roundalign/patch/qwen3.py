"""Qwen3 family (``model_type="qwen3"``): which HF modules get aligned numerics.

Its attention has per-head q_norm/k_norm, patched with the profile's qk_norm rule.

Source: transformers ``models/qwen3/modeling_qwen3.py`` (5.x). The decoder norms, the final norm and the q/k norms share
``Qwen3RMSNorm``; each instance gets its own rule at patch time.
"""

from transformers.models.qwen3 import modeling_qwen3 as hf

from roundalign.patch.registry import define_family

FAMILY = define_family(
    "qwen3",
    globals(),
    has_qk_norm=True,
    norm=hf.Qwen3RMSNorm,
    mlp=hf.Qwen3MLP,
    attention=hf.Qwen3Attention,
    decoder_layer=hf.Qwen3DecoderLayer,
    rotary=hf.Qwen3RotaryEmbedding,
)
