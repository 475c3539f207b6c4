"""Qwen3-MoE family (``model_type="qwen3_moe"``): which HF modules get aligned numerics.

Source: transformers ``models/qwen3_moe/modeling_qwen3_moe.py`` (5.x). Like Qwen3 (per-head q_norm/k_norm), plus
the experts: ``Qwen3MoeExperts`` holds all experts' weights as 3D tensors, and its SwiGLU follows the profile's
``expert_swiglu`` rule, which differs from the dense rule for vLLM (its fused MoE always rounds silu first).
Dense layers (``mlp_only_layers``, ``decoder_sparse_step``) use ``Qwen3MoeMLP`` with the ``swiglu`` rule. The
router (linear, fp32 softmax, top-k) is not an element-wise rounding region and is left as is.
"""

from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

from roundalign.patch.registry import define_family

FAMILY = define_family(
    "qwen3_moe",
    globals(),
    has_qk_norm=True,
    norm=hf.Qwen3MoeRMSNorm,
    mlp=hf.Qwen3MoeMLP,
    attention=hf.Qwen3MoeAttention,
    decoder_layer=hf.Qwen3MoeDecoderLayer,
    rotary=hf.Qwen3MoeRotaryEmbedding,
    experts=hf.Qwen3MoeExperts,
)
