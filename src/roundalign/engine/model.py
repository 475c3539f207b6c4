"""The ``kernels`` backend: the engine's decoder, with every element-wise region computed by the profile's formula.

This stands in for engines built from fused kernels (SGLang and FlashInfer, vLLM with custom ops): each region is
one kernel whose rounding points the profile names, and ``roundalign.ops``' formula for that rule computes it.
Everything around those formulas is the engine's own code, not the trainer's patched HF model: the served weights,
the layer loop over flattened tokens, the residual carried per the profile's ``ResidualRule``, the cos/sin cache,
the KV cache and attention (``attention.py``). Agreement with the trainer is therefore evidence, not a tautology.

Residual carrying, per rule (``S`` = the fp32 sum of an add, ``R = r(S)``; docs/design.md section 4):

| rule                    | the norm reads | carried into the next add after attention | after the MLP (layer output) |
|-------------------------|----------------|-------------------------------------------|------------------------------|
| normalize_rounded_sum   | R              | R                                         | R                            |
| normalize_fp32_sum      | S              | R                                         | R                            |
| round_at_attention      | S              | S                                         | R                            |
| never_round             | S              | S                                         | S                            |

Matmuls are ``F.linear`` on 2-D ``(tokens, features)`` inputs, one call per sequence (``roundalign.engine.gemm``:
a batch never changes a sequence's GEMMs), or one per row under the profile's ``reference`` GEMM kernel; logits
are the 16-bit lm_head matmul. RoPE reads a cos/sin cache in the
profile's dtype (c16: the model dtype, as vLLM casts it, or fp32 as SGLang/FlashInfer keep it); under
``qk_norm=fused_into_rope`` the q/k norm returns fp32 and RoPE rounds once.

Every rounding point rounds to the engine's dtype, ``self.dtype``: bf16, or fp16 for an fp16 engine, the same
formulas with ``r(.) = .to(float16)``.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from roundalign.engine.attention import Step, attention
from roundalign.engine.gemm import linear, logits
from roundalign.engine.loader import head_dim, rope_inv_freq
from roundalign.engine.native import cos_sin_cache
from roundalign.numerics import formulas
from roundalign.profiles import CosSinDtype, GemmKernel, Profile, QKNormRule, ResidualRule
from roundalign.quant import emulated
from roundalign.quant.grid import activation_gemm, served_codes

# The profile's formulas are roundalign.numerics.formulas, the functions roundalign.ops' torch.library ops run.
# The engine calls them directly, without the op dispatch that only torch.compile (opacity)
# and autograd (the backward) need: same code, same bits as the trainer's ops, and a faster decode step on the tiny
# models (the dispatch costs more than the formula at a handful of tokens).


def _residual_add(a: torch.Tensor, h: torch.Tensor, rule: ResidualRule, dtype: torch.dtype):
    """``roundalign.ops.residual_add``: (R, what the next norm reads: R, or the fp32 sum S)."""
    if rule is ResidualRule.NORMALIZE_ROUNDED_SUM:
        r = formulas.add_rounded(a, h)  # R = r(h + a), one add in the model dtype
        return r, r
    return formulas.add_fp32_sum(a, h, dtype)  # (R = r(S), S)


def _plain(module):
    """The served weights as plain namespaces over the same tensors (``a.q_proj.weight``, ...), so that a decode
    step reads its ~40 weights per layer without nn.Module's ``__getattr__``. ``load_weights`` copies into these
    tensors in place, so the namespaces stay current."""
    if isinstance(module, nn.ModuleList):
        return [_plain(m) for m in module]
    ns = SimpleNamespace(**module._buffers)
    for name, child in module._modules.items():
        setattr(ns, name, None if child is None else _plain(child))
    return ns


class KernelsModel:
    """``forward(input_ids, step)`` over flattened tokens -> final-norm hidden states (and, on request, ``R`` after
    every decoder layer)."""

    def __init__(self, weights, config, profile: Profile, dtype: torch.dtype = torch.bfloat16):
        self.weights = _plain(weights)
        self.dtype = dtype  # what every r(.) rounds to
        self.eps = config.rms_norm_eps
        self.head_dim = head_dim(config)
        self.rms_rule = str(profile.rms_norm)
        self.qk_rule = str(profile.qk_norm)
        self.residual = profile.residual
        self.swiglu_rule = str(profile.swiglu)
        # gemm "reference": every row its own GEMM call, in prefill as in decode (where a step has one row per
        # sequence), so that a row's bits never depend on how many rows its call had (docs/kernels.md).
        self.rowwise_gemm = profile.gemm is GemmKernel.REFERENCE
        # A quantized engine serves every linear but the lm_head on its scheme's grid (roundalign.quant), quantized
        # from the served bf16 weights at load and again after every load_weights (which bumps their version), or
        # the codes load_weights was given (a quantized checkpoint's tensors: quant.grid.serve).
        self.quant = profile.quantization if profile.quantization.quantized else None
        self._quantized = {}  # id(weight) -> (its version, Quantized, dequantized weight)
        self._fused = {}  # id(weight) -> the weights of the projections the engine fuses it with (q/k/v, gate/up)
        for layer in self.weights.model.layers:
            for mod, names in (
                (layer.self_attn, ("q_proj", "k_proj", "v_proj")),
                (layer.mlp, ("gate_proj", "up_proj")),
            ):
                group = [getattr(mod, n).weight for n in names if hasattr(mod, n)]
                self._fused.update({id(w): group for w in group})
        rope = profile.rope_for(self.head_dim)
        # fused_into_rope: q/k go from the norm into RoPE in fp32 and round once at RoPE's output, whatever the
        # profile's RoPE rounding (which still applies to families without a q/k norm), as roundalign.apply does.
        has_qk_norm = self.weights.model.layers[0].self_attn.q_norm is not None
        fused = has_qk_norm and profile.qk_norm is QKNormRule.FUSED_INTO_ROPE
        self.rope_rounding = str(rope.rounding.after_fused_norm() if fused else rope.rounding)
        inv_freq, scaling = rope_inv_freq(config)
        # c16 = r(cos(theta)) in the model dtype (vLLM casts its cache to the model dtype), or c32.
        cache_dtype = dtype if rope.cos_sin is CosSinDtype.BF16 else torch.float32
        cos, sin = cos_sin_cache(inv_freq, config.max_position_embeddings, cache_dtype, scaling).chunk(2, dim=-1)
        self.cos, self.sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)  # (positions, head_dim)

    def _linear(self, x: torch.Tensor, lin, key, step: Step) -> torch.Tensor:
        if self.quant is not None:
            return self._quantized_linear(x, lin, step)
        if step.shapes is not None and "matmul" in step.shapes.parts:
            return step.shapes.linear(key, x, lin.weight, lin.bias, list(step.groups()))
        rows = [(r, 1) for r in range(x.shape[0])] if self.rowwise_gemm else step.gemm_rows(x.shape[0])
        return linear(x, lin.weight, lin.bias, rows)

    def _served(self, w: torch.Tensor):
        """``w`` on the scheme's grid. An emulated NVFP4 engine gives the projections vLLM fuses (q/k/v, gate/up) one
        global scale, from their bf16 weights' joint amax, as llm-compressor writes them and vLLM serves them."""
        if self.quant.emulated and self.quant.weights == "nvfp4":
            siblings = self._fused.get(id(w), [w])
            return served_codes(w, self.quant, emulated.fused_amax(siblings))[0]
        return served_codes(w, self.quant)[0]

    def _quantized_linear(self, x: torch.Tensor, lin, step: Step) -> torch.Tensor:
        """A served quantized linear: W8A8 int8 and FP8 as vLLM's CPU kernels compute them (``quant.grid.int8_linear``,
        ``fp8_linear``: its activation quantizer, GEMM and epilogue), weight-only schemes as a 16-bit GEMM on the
        dequantized weight; one call per sequence (or row), as every GEMM here."""
        w = lin.weight
        hit = self._quantized.get(id(w))
        if hit is None or hit[0] != w._version or hit[3] is not getattr(w, "_roundalign_served", None):
            q = self._served(w)  # the codes load_weights was given, or w quantized
            hit = self._quantized[id(w)] = (
                w._version,
                q,
                emulated.dequantize(q, w.dtype) if self.quant.emulated else q.dequantize(w.dtype),
                getattr(w, "_roundalign_served", None),
            )
        rows = [(r, 1) for r in range(x.shape[0])] if self.rowwise_gemm else step.gemm_rows(x.shape[0])
        gemm = activation_gemm(self.quant)
        if gemm is None:  # weight-only
            return linear(x, hit[2], lin.bias, rows)
        return torch.cat([gemm(x[start : start + n], hit[1], lin.bias) for start, n in rows])

    def _attention(self, i: int, a, h: torch.Tensor, cos, sin, step: Step) -> torch.Tensor:
        n, d = h.shape[0], self.head_dim
        q = self._linear(h, a.q_proj, (i, "attention in"), step)
        k = self._linear(h, a.k_proj, (i, "attention in"), step)
        v = self._linear(h, a.v_proj, (i, "attention in"), step)
        heads = (q.shape[1] // d, k.shape[1] // d)
        # q and k go through each op together, (tokens, q_heads + kv_heads, head_dim): the ops work per element
        # (the norm per head row), so this changes no bit and halves the per-op call overhead of a decode step.
        qk = torch.cat((q.view(n, -1, d), k.view(n, -1, d)), dim=1)
        if a.q_norm is not None:  # Qwen3: per-head RMSNorm, q_norm's weight on q's heads, k_norm's on k's
            w = torch.cat((a.q_norm.weight.expand(heads[0], d), a.k_norm.weight.expand(heads[1], d)))
            qk = formulas.rms_norm(qk, w, self.eps, self.qk_rule, self.dtype)  # fp32 under fused_into_rope
        qk = formulas.rope(qk, cos, sin, self.rope_rounding, self.dtype)
        q, k = (t.reshape(n, -1) for t in qk.split(heads, dim=1))
        o = attention(i, q, k, v, step)
        return self._linear(o, a.o_proj, (i, "attention out"), step)

    def _mlp(self, i: int, mlp, h: torch.Tensor, step: Step) -> torch.Tensor:
        gate = self._linear(h, mlp.gate_proj, (i, "mlp in"), step)
        up = self._linear(h, mlp.up_proj, (i, "mlp in"), step)
        return self._linear(formulas.swiglu(gate, up, self.swiglu_rule), mlp.down_proj, (i, "mlp out"), step)

    def forward(self, input_ids: torch.Tensor, step: Step, capture: bool = False):
        w, rule, eps, dtype = self.weights.model, self.residual, self.eps, self.dtype
        positions = step.positions()
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # (tokens, 1, head_dim)
        x = F.embedding(input_ids, w.embed_tokens.weight)
        rounded = x  # R: the 16-bit residual; x: what the next norm reads (R, or the fp32 sum S)
        captured = []
        for i, layer in enumerate(w.layers):
            residual = x if rule is ResidualRule.NEVER_ROUND else rounded
            h = formulas.rms_norm(x, layer.input_layernorm.weight, eps, self.rms_rule, dtype)
            h = self._attention(i, layer.self_attn, h, cos, sin, step)
            rounded, x = _residual_add(h, residual, rule, dtype)
            # Carried into the MLP's add: R, except where a compiled engine keeps the post-attention sum in fp32.
            residual = x if rule in (ResidualRule.ROUND_AT_ATTENTION, ResidualRule.NEVER_ROUND) else rounded
            h = formulas.rms_norm(x, layer.post_attention_layernorm.weight, eps, self.rms_rule, dtype)
            h = self._mlp(i, layer.mlp, h, step)
            rounded, x = _residual_add(h, residual, rule, dtype)
            if capture:
                captured.append(rounded)  # R = r(S) after this layer, whatever the rule carries on
        h = formulas.rms_norm(x, w.norm.weight, eps, self.rms_rule, dtype)
        return h, captured

    def logits(self, hidden: torch.Tensor, step: Step, groups) -> torch.Tensor:
        if step.shapes is not None and "matmul" in step.shapes.parts:
            return step.shapes.linear(("lm_head",), hidden, self.weights.lm_head.weight, None, groups)
        return logits(hidden, self.weights.lm_head.weight, groups)
