"""Qwen2 family (``model_type="qwen2"``, which also covers Qwen2.5): which HF modules get aligned numerics.

No q/k norm; the q/k/v projections carry a bias.

Source: transformers ``models/qwen2/modeling_qwen2.py`` (5.x). The decoder norms and the final norm share
``Qwen2RMSNorm``; each instance gets its own rule at patch time.
"""

from transformers.models.qwen2 import modeling_qwen2 as hf

from roundalign.patch.registry import define_family

FAMILY = define_family(
    "qwen2",
    globals(),
    has_qk_norm=False,
    norm=hf.Qwen2RMSNorm,
    mlp=hf.Qwen2MLP,
    attention=hf.Qwen2Attention,
    decoder_layer=hf.Qwen2DecoderLayer,
    rotary=hf.Qwen2RotaryEmbedding,
)
