"""The ``kernels`` backend: the engine's decoder, with every element-wise region computed by the profile's formula.

This stands in for engines built from fused kernels (SGLang and FlashInfer, vLLM with custom ops): each region is
one kernel whose rounding points the profile names, and ``roundalign.ops`` computes exactly that formula (a
``torch.library`` op per region). Everything around those ops is the engine's own code, not the trainer's patched
HF model: the served weights, the layer loop over flattened tokens, the residual carried per the profile's
``ResidualRule``, the cos/sin cache, the KV cache and attention (``attention.py``). Agreement with the trainer is
therefore evidence, not a tautology.

Residual carrying, per rule (``S`` = the fp32 sum of an add, ``R = r(S)``; docs/design.md section 4):

| rule                    | the norm reads | carried into the next add after attention | after the MLP (layer output) |
|-------------------------|----------------|-------------------------------------------|------------------------------|
| normalize_rounded_sum   | R              | R                                         | R                            |
| normalize_fp32_sum      | S              | R                                         | R                            |
| round_at_attention      | S              | S                                         | R                            |
| never_round             | S              | S                                         | S                            |

Matmuls are plain ``F.linear`` on 2-D ``(tokens, features)`` inputs, as vLLM flattens tokens; logits are the bf16
lm_head matmul. RoPE reads a cos/sin cache in the profile's dtype (bf16 as vLLM casts it, or fp32 as
SGLang/FlashInfer keep it); under ``qk_norm=fused_into_rope`` the q/k norm returns fp32 and RoPE rounds once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from roundalign import ops
from roundalign.engine.attention import Step, attention
from roundalign.engine.loader import head_dim, rope_inv_freq
from roundalign.engine.native import cos_sin_cache
from roundalign.profiles import CosSinDtype, Profile, QKNormRule, ResidualRule, RopeRounding

BF16 = torch.bfloat16


class KernelsModel:
    """``forward(input_ids, step)`` over flattened tokens -> final-norm hidden states (and, on request, ``R`` after
    every decoder layer)."""

    def __init__(self, weights, config, profile: Profile):
        self.weights = weights
        self.eps = config.rms_norm_eps
        self.head_dim = head_dim(config)
        self.rms_rule = profile.rms_norm
        self.qk_rule = profile.qk_norm
        self.residual = profile.residual
        self.swiglu_rule = profile.swiglu
        rope = profile.rope_for(self.head_dim)
        # fused_into_rope: q/k go from the norm into RoPE in fp32 and round once at RoPE's output, whatever the
        # profile's RoPE rounding (which still applies to families without a q/k norm), as roundalign.apply does.
        has_qk_norm = weights.model.layers[0].self_attn.q_norm is not None
        fused = has_qk_norm and profile.qk_norm is QKNormRule.FUSED_INTO_ROPE
        self.rope_rounding = RopeRounding.ONCE if fused else rope.rounding
        inv_freq, scaling = rope_inv_freq(config)
        dtype = BF16 if rope.cos_sin is CosSinDtype.BF16 else torch.float32  # c16 = r(cos(theta)), or c32
        cos, sin = cos_sin_cache(inv_freq, config.max_position_embeddings, dtype, scaling).chunk(2, dim=-1)
        self.cos, self.sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)  # (positions, head_dim)

    def _linear(self, x: torch.Tensor, lin, key, step: Step) -> torch.Tensor:
        if step.shapes is not None and "matmul" in step.shapes.parts:
            return step.shapes.linear(key, x, lin.weight, lin.bias, list(step.groups()))
        return F.linear(x, lin.weight, lin.bias)

    def _attention(self, i: int, a, h: torch.Tensor, cos, sin, step: Step) -> torch.Tensor:
        n, d = h.shape[0], self.head_dim
        q = self._linear(h, a.q_proj, (i, "attention in"), step)
        k = self._linear(h, a.k_proj, (i, "attention in"), step)
        v = self._linear(h, a.v_proj, (i, "attention in"), step)
        q, k = q.view(n, -1, d), k.view(n, -1, d)  # (tokens, heads, head_dim)
        if a.q_norm is not None:  # Qwen3: per-head RMSNorm; fp32 out under fused_into_rope
            q = ops.rms_norm(q, a.q_norm.weight, self.eps, self.qk_rule, out_dtype=BF16)
            k = ops.rms_norm(k, a.k_norm.weight, self.eps, self.qk_rule, out_dtype=BF16)
        q = ops.rope(q, cos, sin, self.rope_rounding, out_dtype=BF16).view(n, -1)
        k = ops.rope(k, cos, sin, self.rope_rounding, out_dtype=BF16).view(n, -1)
        o = attention(i, q, k, v, step)
        return self._linear(o, a.o_proj, (i, "attention out"), step)

    def _mlp(self, i: int, mlp, h: torch.Tensor, step: Step) -> torch.Tensor:
        gate = self._linear(h, mlp.gate_proj, (i, "mlp in"), step)
        up = self._linear(h, mlp.up_proj, (i, "mlp in"), step)
        return self._linear(ops.swiglu(gate, up, self.swiglu_rule), mlp.down_proj, (i, "mlp out"), step)

    def forward(self, input_ids: torch.Tensor, step: Step, capture: bool = False):
        w, rule, eps = self.weights.model, self.residual, self.eps
        positions = step.positions()
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # (tokens, 1, head_dim)
        x = F.embedding(input_ids, w.embed_tokens.weight)
        rounded = x  # R: the bf16 residual; x: what the next norm reads (R, or the fp32 sum S)
        captured = []
        for i, layer in enumerate(w.layers):
            residual = x if rule is ResidualRule.NEVER_ROUND else rounded
            h = ops.rms_norm(x, layer.input_layernorm.weight, eps, self.rms_rule, out_dtype=BF16)
            h = self._attention(i, layer.self_attn, h, cos, sin, step)
            rounded, x = ops.residual_add(h, residual, rule)
            # Carried into the MLP's add: R, except where a compiled engine keeps the post-attention sum in fp32.
            residual = x if rule in (ResidualRule.ROUND_AT_ATTENTION, ResidualRule.NEVER_ROUND) else rounded
            h = ops.rms_norm(x, layer.post_attention_layernorm.weight, eps, self.rms_rule, out_dtype=BF16)
            h = self._mlp(i, layer.mlp, h, step)
            rounded, x = ops.residual_add(h, residual, rule)
            if capture:
                captured.append(rounded)  # R = r(S) after this layer, whatever the rule carries on
        h = ops.rms_norm(x, w.norm.weight, eps, self.rms_rule, out_dtype=BF16)
        return h, captured

    def logits(self, hidden: torch.Tensor, step: Step, groups) -> torch.Tensor:
        if step.shapes is not None and "matmul" in step.shapes.parts:
            return step.shapes.linear(("lm_head",), hidden, self.weights.lm_head.weight, None, groups)
        return F.linear(hidden, self.weights.lm_head.weight)
