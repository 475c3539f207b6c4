"""An independent reference for the prefill forward pass of HF Llama / Qwen2 / Qwen3 / Qwen3-MoE *ForCausalLM
under a roundalign Profile.

This module deliberately does NOT use ``roundalign.ops`` or ``roundalign.patch``: it re-derives every
element-wise region from ``docs/engine-rounding.md`` (sections 1-4), reading only the
bf16 weights (a state dict) and the HF config. ``roundalign.profiles`` is used only as data (which rule applies
to which region).

Notation (fact sheet s1): ``r(.)`` = round fp32 -> bf16 (RNE), ``f(.)`` = exact bf16 -> fp32 widening,
``nu(z) = rsqrt(mean(z^2) + eps)`` computed in fp32. Every element-wise region is written out in fp32 with
explicit ``r`` calls, never as a chain of bf16 tensor ops, so that *where* the roundings sit is visible in the
code. (For a single ``+ - *`` of two bf16 operands "fp32 op, then r" is the correctly rounded bf16 result, so
the HF rules written this way equal HF's bf16 eager ops bit for bit; fact sheet s1 "per-op equivalence".)

What is NOT a rounding-alignment region mirrors HF eager exactly, with the same torch calls and shapes:
matmuls (``F.linear``), the embedding gather, eager attention (causal + padding mask built like
``masking_utils.eager_mask``, repeat_kv, softmax in fp32 then cast), and the Qwen3-MoE router and the expert
accumulation order (``Qwen3MoeExperts.forward``, eager loop, ``index_add_`` in bf16).

RoPE cos/sin are computed the *engine* way: inv_freq in fp32 from the config (default / llama3 / yarn, from
vLLM's rotary_embedding sources, cited below), ``theta = pos * inv_freq`` in fp32, ``c32 = cos(theta) * scale``
in fp32, ``c16 = r(c32)`` when the profile's cos_sin is bf16.

SiLU: ``silu(g)`` is computed in fp32 with ``torch.nn.functional.silu`` (``g / (1 + exp(-g))`` in ATen's CPU
kernel), which is what HF's ``SiLUActivation`` calls. ``g * torch.sigmoid(g)`` is a *different* fp32 function
on CPU (it differs from F.silu in the last fp32 ulp for ~23% of inputs; after ``r(silu(g))`` they agreed on 4M
samples, but ``r(silu(g) * u)`` differs in ~5 per million elements), so the "once" SwiGLU rule depends on this
choice; ``SILU_FP32`` records it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from roundalign.profiles import (
    CosSinDtype,
    Profile,
    QKNormRule,
    ResidualRule,
    RMSNormRule,
    RopeRounding,
    RopeRule,
    SwiGLURule,
    get_profile,
)

BF16 = torch.bfloat16
FP32 = torch.float32

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")


def SILU_FP32(g32: torch.Tensor) -> torch.Tensor:  # noqa: N802 - a named constant-like function
    """sigma(g) = g * sigmoid(g) in fp32, evaluated as ATen's silu kernel does (what HF's SiLU calls)."""
    return F.silu(g32)


# --------------------------------------------------------------------------------------------- notation ----


def r(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 -> bf16 (round to nearest even)."""
    assert x.dtype == FP32, x.dtype
    return x.to(BF16)


def f(x: torch.Tensor) -> torch.Tensor:
    """Widen to fp32 (exact for bf16)."""
    return x.to(FP32)


def nu(z32: torch.Tensor, eps: float) -> torch.Tensor:
    """nu(z) = rsqrt(mean(z^2) + eps), fp32, over the last dim (same reduction as HF's RMSNorm)."""
    assert z32.dtype == FP32
    return torch.rsqrt(z32.pow(2).mean(-1, keepdim=True) + eps)


# ----------------------------------------------------------------------------------------------- regions ----


def rms_norm(z32: torch.Tensor, w: torch.Tensor, eps: float, rule: RMSNormRule | QKNormRule) -> torch.Tensor:
    """Decoder / final norm (and q/k norm for the two non-fused rules) on an fp32 input ``z32``.

    round_before_weight: r(w * r(z * nu(z)))      (HF, vLLM CUDA)
    round_after_weight:  r(z * nu(z) * w)         (fused kernels, Inductor), evaluated as (z * nu) * w
    """
    zn = z32 * nu(z32, eps)
    if rule.value == "round_before_weight":
        return r(f(w) * f(r(zn)))
    if rule.value == "round_after_weight":
        return r(zn * f(w))
    raise ValueError(f"rms_norm: unexpected rule {rule}")


def qk_norm(x: torch.Tensor, w: torch.Tensor, eps: float, rule: QKNormRule) -> torch.Tensor:
    """Qwen3 per-head q/k norm over head_dim. bf16 out, except fused_into_rope: fp32 ``x * nu(x) * w``."""
    x32 = f(x)
    if rule is QKNormRule.FUSED_INTO_ROPE:
        return (x32 * nu(x32, eps)) * f(w)
    return rms_norm(x32, w, eps, rule)


def swiglu(g: torch.Tensor, u: torch.Tensor, rule: SwiGLURule) -> torch.Tensor:
    """round_silu: r(r(silu(g)) * u);  once: r(silu(g) * u);  silu in fp32."""
    s32 = SILU_FP32(f(g))
    if rule is SwiGLURule.ROUND_SILU:
        return r(f(r(s32)) * f(u))
    if rule is SwiGLURule.ONCE:
        return r(s32 * f(u))
    raise ValueError(f"swiglu: unexpected rule {rule}")


def rope(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, rule: RopeRule, *, fp32_input: bool) -> torch.Tensor:
    """NeoX / rotate-half RoPE on the last dim of ``x`` ([B, H, T, D]); ``c``, ``s``: [B or 1, 1, T, D/2], fp32 tensors
    holding either c32 or f(c16).

    per_op: o1 = r(r(x1*c) - r(x2*s)), o2 = r(r(x2*c) + r(x1*s))      (HF: q*cos + rotate_half(q)*sin)
    once:   o1 = r(x1*c - x2*s),       o2 = r(x2*c + x1*s)
    truncate: o1 = t(x1*c - x2*s),     o2 = t(x2*c + x1*s), t keeping the top 16 bits of the fp32 pattern
    ``fp32_input`` (qk_norm fused_into_rope): x is the unrounded norm output and RoPE's output is the only
    rounding, i.e. "once" whatever the rule's rounding says, or "truncate" under it
    (profiles.QKNormRule.FUSED_INTO_ROPE).
    """
    half = x.shape[-1] // 2
    x32 = x if fp32_input else f(x)
    x1, x2 = x32[..., :half], x32[..., half:]
    if rule.rounding is RopeRounding.PER_OP and not fp32_input:
        o1 = r(f(r(x1 * c)) - f(r(x2 * s)))
        o2 = r(f(r(x2 * c)) + f(r(x1 * s)))
    elif rule.rounding is RopeRounding.TRUNCATE:  # vLLM's CPU kernel without AVX512-BF16: the top 16 bits
        o1 = ((x1 * c - x2 * s).view(torch.int32) >> 16).to(torch.int16).view(BF16)
        o2 = ((x2 * c + x1 * s).view(torch.int32) >> 16).to(torch.int16).view(BF16)
    else:
        o1 = r(x1 * c - x2 * s)
        o2 = r(x2 * c + x1 * s)
    return torch.cat((o1, o2), dim=-1)


# ------------------------------------------------------------------------------------- rope: engine angles ----


def rope_inv_freq(config) -> tuple[torch.Tensor, float]:
    """(inv_freq fp32 [dim/2], cos/sin scale) as the engine builds its cos/sin cache.

    default: vllm/model_executor/layers/rotary_embedding/base.py ``RotaryEmbedding._compute_inv_freq``:
        1 / (base ** (arange(0, dim, 2, float) / dim)); no scale.
    llama3:  .../rotary_embedding/llama3_rope.py ``Llama3RotaryEmbedding._compute_inv_freq``
        (vllm-project/vllm @ 045d7575500e01e0f4a7ff84e039a9f7f7dc3bd0).
    yarn:    .../rotary_embedding/yarn_scaling_rope.py ``YaRNScalingRotaryEmbedding`` (vllm-project/vllm @
        ffdc985737c94233f2c88629c4450022e5bf4925 and @ 0cd5784803d83f81fac0794b82cb592d4317d4bf for
        attention_factor / mscale / truncate) with ``yarn_find_correction_range`` / ``yarn_linear_ramp_mask`` /
        ``yarn_get_mscale`` from .../rotary_embedding/common.py (@ 1593f0c1de61ba1e6efb9315ac8d0a3d2fe14cdd);
        get_rope (``__init__.py``) passes ``original_max_position_embeddings`` as the YaRN
        ``max_position_embeddings`` and ``factor`` as ``scaling_factor``.
    """
    params = dict(config.rope_parameters)
    dim = _head_dim(config)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError("partial_rotary_factor != 1")
    base = float(params["rope_theta"])
    kind = params.get("rope_type", "default")

    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    if kind == "default":
        return inv_freq, 1.0

    if kind == "llama3":
        factor = params["factor"]
        low_freq_factor = params["low_freq_factor"]
        high_freq_factor = params["high_freq_factor"]
        orig_max_position = params["original_max_position_embeddings"]
        low_freq_wavelen = orig_max_position / low_freq_factor
        high_freq_wavelen = orig_max_position / high_freq_factor
        wave_len = 2 * math.pi / inv_freq
        if low_freq_factor != high_freq_factor:
            smooth = (orig_max_position / wave_len - low_freq_factor) / (high_freq_factor - low_freq_factor)
        else:
            smooth = 0
        new = torch.where(
            wave_len < high_freq_wavelen,
            inv_freq,
            torch.where(
                wave_len > low_freq_wavelen,
                inv_freq / factor,
                (1 - smooth) * inv_freq / factor + smooth * inv_freq,
            ),
        )
        return new, 1.0

    if kind == "yarn":
        factor = params["factor"]
        orig_max = params["original_max_position_embeddings"]
        beta_fast = params.get("beta_fast") or 32
        beta_slow = params.get("beta_slow") or 1
        truncate = params.get("truncate", True)
        extrapolation_factor = params.get("extrapolation_factor", 1)

        def get_mscale(scale: float, m: float = 1) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if params.get("attention_factor") is not None:
            mscale = float(params["attention_factor"])
        elif params.get("mscale") and params.get("mscale_all_dim"):
            mscale = float(get_mscale(factor, params["mscale"]) / get_mscale(factor, params["mscale_all_dim"]))
        else:
            mscale = float(get_mscale(factor)) * params.get("attn_factor", 1)

        def correction_dim(num_rotations: float) -> float:
            return (dim * math.log(orig_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low), 0, 1)

        pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
        inv_extra = 1.0 / pos_freqs
        inv_inter = 1.0 / (factor * pos_freqs)
        mask = (1 - ramp) * extrapolation_factor
        return inv_inter * (1 - mask) + inv_extra * mask, mscale

    raise NotImplementedError(f"rope_type {kind!r}")


def cos_sin(config, position_ids: torch.Tensor, cos_sin_dtype: CosSinDtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 tensors [B or 1, 1, T, D/2] holding c32/s32 (fp32 rule) or f(r(c32))/f(r(s32)) (bf16 rule)."""
    inv_freq, scale = rope_inv_freq(config)
    theta = position_ids.to(FP32)[..., None] * inv_freq  # fp32, [B, T, D/2]
    c32 = theta.cos() * scale
    s32 = theta.sin() * scale
    if cos_sin_dtype is CosSinDtype.BF16:
        c32, s32 = f(r(c32)), f(r(s32))
    return c32[:, None], s32[:, None]


# ------------------------------------------------------------------------------------------------- model ----


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _family(config) -> str:
    fam = config.model_type
    if fam not in FAMILIES:
        raise NotImplementedError(f"model_type {fam!r}; the reference covers {FAMILIES}")
    return fam


def _linear(x: torch.Tensor, sd: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    return F.linear(x, sd[f"{name}.weight"], sd.get(f"{name}.bias"))


def _eager_mask(attention_mask: torch.Tensor | None, batch: int, seq: int, dtype: torch.dtype) -> torch.Tensor:
    """Causal (+ padding) mask as masking_utils.eager_mask builds it: bool -> where(allowed, 0, finfo.min)."""
    q = torch.arange(seq)[:, None]
    kv = torch.arange(seq)[None, :]
    allowed = (kv <= q)[None, None].expand(batch, 1, seq, seq)
    if attention_mask is not None:
        allowed = allowed & attention_mask.to(torch.bool)[:, None, None, :]
    return torch.where(allowed, torch.zeros((), dtype=dtype), torch.finfo(dtype).min)


def _attention(x, sd, pre, config, fam, profile: Profile, cos, sin, mask) -> torch.Tensor:
    B, T, _ = x.shape
    D = _head_dim(config)
    n_heads, n_kv = config.num_attention_heads, config.num_key_value_heads
    rule = profile.rope_for(D)

    q = _linear(x, sd, f"{pre}.q_proj").view(B, T, -1, D)
    k = _linear(x, sd, f"{pre}.k_proj").view(B, T, -1, D)
    v = _linear(x, sd, f"{pre}.v_proj").view(B, T, -1, D).transpose(1, 2)

    fused = False
    if fam in ("qwen3", "qwen3_moe"):
        eps = config.rms_norm_eps
        q = qk_norm(q, sd[f"{pre}.q_norm.weight"], eps, profile.qk_norm)
        k = qk_norm(k, sd[f"{pre}.k_norm.weight"], eps, profile.qk_norm)
        fused = profile.qk_norm is QKNormRule.FUSED_INTO_ROPE
    q = rope(q.transpose(1, 2), cos, sin, rule, fp32_input=fused)
    k = rope(k.transpose(1, 2), cos, sin, rule, fp32_input=fused)

    # --- eager attention, mirrored from HF eager_attention_forward (not a rounding-alignment region) ---
    rep = n_heads // n_kv
    if rep > 1:
        k = k[:, :, None].expand(B, n_kv, rep, T, D).reshape(B, n_kv * rep, T, D)
        v = v[:, :, None].expand(B, n_kv, rep, T, D).reshape(B, n_kv * rep, T, D)
    w = torch.matmul(q, k.transpose(2, 3)) * (D**-0.5)
    w = w + mask
    w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    o = torch.matmul(w, v).transpose(1, 2).contiguous().reshape(B, T, -1).contiguous()
    return _linear(o, sd, f"{pre}.o_proj")


def _dense_mlp(x, sd, pre, rule: SwiGLURule) -> torch.Tensor:
    g = _linear(x, sd, f"{pre}.gate_proj")
    u = _linear(x, sd, f"{pre}.up_proj")
    return _linear(swiglu(g, u, rule), sd, f"{pre}.down_proj")


def _sparse_moe(x, sd, pre, config, rule: SwiGLURule) -> torch.Tensor:
    """Qwen3-MoE sparse block. Router and accumulation mirror HF's eager experts loop exactly; only the
    experts' SwiGLU follows the profile (expert_swiglu)."""
    B, T, H = x.shape
    xs = x.reshape(-1, H)
    n_exp, top_k = config.num_experts, config.num_experts_per_tok

    logits = F.linear(xs, sd[f"{pre}.gate.weight"])
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top_w, top_i = torch.topk(probs, top_k, dim=-1)
    if config.norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    top_w = top_w.to(logits.dtype)

    gate_up, down = sd[f"{pre}.experts.gate_up_proj"], sd[f"{pre}.experts.down_proj"]
    inter = gate_up.shape[1] // 2
    out = torch.zeros_like(xs)
    for e in range(n_exp):  # ascending expert id, as HF's expert_hit (nonzero) order
        # (k-slot, token) pairs in row-major [k, N] order, as torch.where(expert_mask[e]) in HF
        slot, tok = torch.nonzero((top_i == e).T, as_tuple=True)
        if tok.numel() == 0:
            continue
        h = F.linear(xs[tok], gate_up[e])
        g, u = h[:, :inter], h[:, inter:]
        y = F.linear(swiglu(g, u, rule), down[e])
        y = y * top_w[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out.reshape(B, T, H)


def _is_sparse_layer(config, i: int) -> bool:
    return (
        config.model_type == "qwen3_moe"
        and i not in (config.mlp_only_layers or [])
        and config.num_experts > 0
        and (i + 1) % config.decoder_sparse_step == 0
    )


@torch.no_grad()
def reference_logits(
    model_or_state_dict,
    config,
    input_ids: torch.Tensor,
    profile: str | Profile,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prefill logits [B, T, vocab] (bf16) of an HF *ForCausalLM under ``profile``, from its bf16 weights.

    ``attention_mask``: optional [B, T] 0/1 padding mask (left padding works); like HF's forward without
    ``position_ids``, positions default to ``arange(T)`` for every row regardless of the mask.
    """
    prof = get_profile(profile)
    fam = _family(config)
    if isinstance(model_or_state_dict, torch.nn.Module):
        sd = model_or_state_dict.state_dict()
    else:
        sd = model_or_state_dict
    if any(t == "sliding_attention" for t in (getattr(config, "layer_types", None) or [])) or (
        fam == "qwen3_moe" and config.sliding_window is not None
    ):
        raise NotImplementedError("sliding-window attention")
    for key in ("model.embed_tokens.weight",):
        if sd[key].dtype != BF16:
            raise ValueError(f"{key} is {sd[key].dtype}; the reference models a bf16 model")

    B, T = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(T)[None]
    cos, sin = cos_sin(config, position_ids, prof.rope_for(_head_dim(config)).cos_sin)
    mask = _eager_mask(attention_mask, B, T, BF16)
    eps = config.rms_norm_eps
    fp32_sum = prof.residual is not ResidualRule.NORMALIZE_ROUNDED_SUM
    # Which residual adds carry the fp32 sum S on instead of R = r(S) (compiled engines elide the rounding):
    keep_fp32 = {
        ResidualRule.NORMALIZE_ROUNDED_SUM: (),
        ResidualRule.NORMALIZE_FP32_SUM: (),
        ResidualRule.ROUND_AT_ATTENTION: ("attention",),  # rounded only at each layer's input
        ResidualRule.NEVER_ROUND: ("attention", "mlp"),
    }[prof.residual]

    R = F.embedding(input_ids, sd["model.embed_tokens.weight"])  # carried residual: bf16, or fp32 where kept
    S = None  # fp32 sum of the last residual add (None before the first add: the norm reads the embedding)

    def norm_input() -> torch.Tensor:
        return S if (fp32_sum and S is not None) else f(R)

    def residual_add(a: torch.Tensor, after: str) -> None:
        nonlocal R, S
        S = f(a) + f(R)  # S = a + h in fp32; HF's bf16 add is r(S)
        R = S if after in keep_fp32 else r(S)

    for i in range(config.num_hidden_layers):
        pre = f"model.layers.{i}"
        x = rms_norm(norm_input(), sd[f"{pre}.input_layernorm.weight"], eps, prof.rms_norm)
        residual_add(_attention(x, sd, f"{pre}.self_attn", config, fam, prof, cos, sin, mask), "attention")
        x = rms_norm(norm_input(), sd[f"{pre}.post_attention_layernorm.weight"], eps, prof.rms_norm)
        if _is_sparse_layer(config, i):
            m = _sparse_moe(x, sd, f"{pre}.mlp", config, prof.expert_swiglu)
        else:
            m = _dense_mlp(x, sd, f"{pre}.mlp", prof.swiglu)
        residual_add(m, "mlp")

    x = rms_norm(norm_input(), sd["model.norm.weight"], eps, prof.rms_norm)
    lm = sd.get("lm_head.weight")
    if lm is None:
        if not config.tie_word_embeddings:
            raise KeyError("lm_head.weight")
        lm = sd["model.embed_tokens.weight"]
    return F.linear(x, lm)
