"""vLLM's ``forward_native`` element-wise ops and its decoder structure: the engine's ``inductor`` backend.

vLLM's default V1 path (torch.compile + Inductor, custom ops off) traces each layer's ``forward_native`` into
Inductor graphs split at the attention op (docs/engine-rounding.md s4.1, s5). vLLM itself needs CUDA,
so this module restates the few lines that matter, in our own words, from the vLLM source:

- RMSNorm.forward_native, with and without residual: ``vllm/model_executor/layers/layernorm.py`` @ 00cba797bda4
  (the 0.11-style code: ``x.to(float32)``; ``x = x + residual.to(float32)``; ``residual = x.to(orig_dtype)``;
  variance of the fp32 ``x``; ``x * rsqrt(variance + eps)``; ``.to(orig_dtype)``; ``* weight``).
- SiluAndMul.forward_native: ``vllm/model_executor/layers/activation.py`` @ 00db0119c376
  (``F.silu(x[..., :d]) * x[..., d:]``).
- RotaryEmbedding: ``vllm/model_executor/layers/rotary_embedding/base.py`` @ 04458da08417 (cache from an fp32
  ``einsum`` of positions and inv_freq, ``cat(cos, sin)``, cast to the model dtype; ``forward_native`` indexes the
  cache by position) and ``common.py`` @ 002d181a55a0 ``apply_rotary_emb_torch`` (NeoX layout:
  ``cos.unsqueeze(-2).to(x.dtype)``, ``x1*cos - x2*sin``, ``x2*cos + x1*sin``, ``cat``).
- Model structure: ``vllm/model_executor/models/qwen3.py`` @ 002456df36fc (q_norm/k_norm per head on the
  ``q.view(..., heads, head_dim)``, then ``rotary_emb(positions, q, k)``, then attention; the decoder layer carries
  ``residual`` through the fused add + RMSNorm; the first layer's input norm has no residual; the final norm is
  fused with the last residual add; logits are computed outside the compiled model). Qwen2 and Llama are the same
  without the q/k norm (Qwen2 with q/k/v biases).

Written plainly, these ops round after every torch op when run eagerly. Compiled, the rounding points are
Inductor's: it drops an explicit ``.to(bf16)`` inside a fused kernel unless the value leaves the kernel's graph, so
the compiled engine rounds where the compiler decides, not where a per-op formula says (docs/engine.md).

Deliberate differences from vLLM, none of which touches an element-wise rounding point: q/k/v and gate/up are
separate linears (vLLM merges them into one GEMM), so that every matmul is HF's own call; rotary_dim == head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# --------------------------------------------------------------------------------------------------------------
# forward_native, restated


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """vLLM RMSNorm.forward_native. Returns ``out`` or ``(out, residual)``."""
    orig_dtype = x.dtype
    x = x.to(torch.float32)
    if residual is not None:
        x = x + residual.to(torch.float32)  # S, fp32
        residual = x.to(orig_dtype)  # R = r(S), the carried residual
    variance = x.pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    x = x.to(orig_dtype)  # eager: rounds; Inductor (default config): elided inside the fused kernel
    x = x * weight
    return x if residual is None else (x, residual)


def silu_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    """vLLM SiluAndMul.forward_native on the merged ``[gate, up]`` tensor."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def cos_sin_cache(inv_freq: torch.Tensor, max_position: int, dtype: torch.dtype, scaling: float = 1.0) -> torch.Tensor:
    """vLLM RotaryEmbedding's cache: fp32 angles from an einsum, ``cat(cos, sin)`` (times YaRN's ``scaling``, as
    vLLM's scaled variants do), then cast to ``dtype``: the model dtype (bf16 or fp16) for vLLM, kept fp32 for
    FlashInfer-style kernels."""
    t = torch.arange(max_position, dtype=torch.float)
    freqs = torch.einsum("i,j -> ij", t, inv_freq.float())
    return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1).to(dtype)


def _rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_native(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cache: torch.Tensor,
    head_dim: int,
    rotary_dim: int | None = None,
):
    """vLLM RotaryEmbedding.forward_native (NeoX style) on ``(tokens, heads * head_dim)`` query and key."""
    rotary_dim = rotary_dim or head_dim
    positions = positions.flatten()
    n = positions.shape[0]
    cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)

    def one(x):
        x = x.view(n, -1, head_dim)  # the rotated part, then the pass-through part (empty here), as vLLM does
        rot = _rotate_neox(x[..., :rotary_dim], cos, sin)
        return torch.cat((rot, x[..., rotary_dim:]), dim=-1)

    return one(query).reshape(query.shape), one(key).reshape(key.shape)


# --------------------------------------------------------------------------------------------------------------
# the model


class NativeModel(nn.Module):
    """vLLM's ``Qwen3Model`` / ``Qwen2Model`` / ``LlamaModel`` forward over the engine's served weights.

    ``forward(input_ids, positions)`` takes flattened tokens (all sequences of a step, one row each) and returns
    the final-norm hidden states; with ``capture=True`` also the residual ``R = r(S)`` after every decoder layer.
    ``logits`` applies the lm_head outside the compiled region, as vLLM's LogitsProcessor does. Attention goes
    through ``attention``, an opaque op at which the piecewise backend splits the graph; it reads its per-sequence
    metadata and KV cache from the engine's forward context (``roundalign.engine.attention``).
    """

    def __init__(self, weights: nn.Module, config, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        from roundalign.engine.loader import head_dim, rope_inv_freq

        self.weights = weights  # a submodule: under torch.compile its buffers are graph inputs, updated in place
        self.eps = config.rms_norm_eps
        self.head_dim = head_dim(config)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        inv_freq, scaling = rope_inv_freq(config)
        # vLLM casts its cos/sin cache to the model dtype: bf16, or fp16 for an fp16 engine.
        cache = cos_sin_cache(inv_freq, config.max_position_embeddings, dtype, scaling)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.ops.roundalign.unified_attention(q, k, v, layer)

    def linear(self, h: torch.Tensor, lin) -> torch.Tensor:
        """Every projection's GEMM (the engine's subclass computes it per sequence: roundalign.engine.gemm)."""
        return F.linear(h, lin.weight, lin.bias)

    def qkv(self, attn, h: torch.Tensor):
        return self.linear(h, attn.q_proj), self.linear(h, attn.k_proj), self.linear(h, attn.v_proj)

    def gate_up(self, mlp, h: torch.Tensor) -> torch.Tensor:
        # vLLM merges gate and up into one GEMM; two linears keep HF's matmuls. SiluAndMul reads [gate, up].
        return torch.cat((self.linear(h, mlp.gate_proj), self.linear(h, mlp.up_proj)), dim=-1)

    def _attention_block(self, i: int, a, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(a, h)
        if a.q_norm is not None:  # Qwen3: per-head norm on q.view(tokens, heads, head_dim)
            q = rms_norm_native(q.view(*q.shape[:-1], -1, self.head_dim), a.q_norm.weight, self.eps).view(q.shape)
            k = rms_norm_native(k.view(*k.shape[:-1], -1, self.head_dim), a.k_norm.weight, self.eps).view(k.shape)
        q, k = rope_native(positions, q, k, self.cos_sin_cache, self.head_dim)
        o = self.attention(i, q, k, v)
        return self.linear(o, a.o_proj)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, capture: bool = False):
        w = self.weights.model
        h = F.embedding(input_ids, w.embed_tokens.weight)
        residual = None
        captured = []
        for i, layer in enumerate(w.layers):  # Qwen3DecoderLayer.forward
            if residual is None:
                residual = h
                h = rms_norm_native(h, layer.input_layernorm.weight, self.eps)
            else:
                h, residual = rms_norm_native(h, layer.input_layernorm.weight, self.eps, residual)
                captured.append(residual)  # R after layer i - 1: it crosses attention, so it leaves a piece anyway
            h = self._attention_block(i, layer.self_attn, positions, h)
            h, residual = rms_norm_native(h, layer.post_attention_layernorm.weight, self.eps, residual)
            mlp = layer.mlp
            h = self.linear(silu_and_mul_native(self.gate_up(mlp, h)), mlp.down_proj)
        h, residual = rms_norm_native(h, w.norm.weight, self.eps, residual)
        if capture:  # the last layer's R is an extra graph output that vLLM's graph does not have
            return h, (*captured, residual)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weights.lm_head.weight)
