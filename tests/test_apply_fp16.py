"""``roundalign.apply`` on an fp16 model: every patched region rounds to fp16 at the profile's rounding points.

The references are written here from the formulas of docs/engine-rounding.md (sections 1-2) with
``r(.) = .to(torch.float16)``, in the plain style of tests/formulas.py (which holds the bf16 versions): every value is
upcast to fp32 with ``f(.)``, the arithmetic is fp32, and every ``r(.)`` is an explicit cast. They never call
``roundalign.ops``; they are checked with ``torch.equal`` against the patched model's modules on random fp16 inputs
whose magnitudes reach fp16's subnormals (where fp16 loses bits that bf16 keeps) and its overflow threshold.

What an fp16 model exercises that a bf16 one does not: an fp32 intermediate (the residual sum ``S`` carried by
``round_at_attention``/``never_round``, the fp32 q/k norm output under ``fused_into_rope``) must round to the
model's dtype, fp16, not to bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import roundalign
from roundalign.mixed_precision import Carry
from tests import formulas
from tests.helpers import assert_bitwise_equal
from tests.models import build

FP16, FP32 = torch.float16, torch.float32


def r(t: torch.Tensor) -> torch.Tensor:
    """r(.): round fp32 to fp16, round-to-nearest-even."""
    return t.to(FP16)


def f(t: torch.Tensor) -> torch.Tensor:
    return t.to(FP32)


def nu(x32: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrt(mean(x^2) + eps) in fp32 (HF's expression; the fact sheet does not pin the reduction order)."""
    return torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


# ------------------------------------------------------------------------------------------ fp16 references


def rms_norm_round_before_weight(x, w, eps):
    """HF / vLLM CUDA / Liger: r(w * r(x * nu(x)))."""
    x32 = f(x)
    return r(f(w) * f(r(x32 * nu(x32, eps))))


def rms_norm_round_after_weight(x, w, eps):
    """FlashInfer / Inductor / TE: r(x * nu(x) * w)."""
    x32 = f(x)
    return r(x32 * nu(x32, eps) * f(w))


def rms_norm_fp32(x, w, eps):
    """q/k norm fused into RoPE: x * nu(x) * w, fp32, not rounded."""
    x32 = f(x)
    return x32 * nu(x32, eps) * f(w)


RMS_NORM = {
    "round_before_weight": rms_norm_round_before_weight,
    "round_after_weight": rms_norm_round_after_weight,
    "fused_into_rope": rms_norm_fp32,
}


def swiglu_round_silu(g, u):
    """HF / vLLM CUDA / Liger: r(r(silu(g)) * u)."""
    return r(f(r(F.silu(f(g)))) * f(u))


def swiglu_once(g, u):
    """Fused kernels / Inductor / TE: r(silu(g) * u)."""
    return r(F.silu(f(g)) * f(u))


SWIGLU = {"round_silu": swiglu_round_silu, "once": swiglu_once}


def rope(x, cos, sin, rounding):
    """NeoX RoPE on (..., D); once: r(x1*c - x2*s), r(x2*c + x1*s); per_op: r(r(x1*c) - r(x2*s)), ..."""
    half = x.shape[-1] // 2
    x32, c, s = f(x), f(cos), f(sin)
    x1, x2 = x32[..., :half], x32[..., half:]
    c1, c2, s1, s2 = c[..., :half], c[..., half:], s[..., :half], s[..., half:]
    if rounding == "once":
        return torch.cat((r(x1 * c1 - x2 * s1), r(x2 * c2 + x1 * s2)), -1)
    return torch.cat((r(f(r(x1 * c1)) - f(r(x2 * s1))), r(f(r(x2 * c2)) + f(r(x1 * s2)))), -1)


def cos_sin16(positions: torch.Tensor, head_dim: int, base: float):
    """c16 = r(cos(theta)), theta = pos / base^(2i/d) in fp32, the cache in the model dtype."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=FP32) / head_dim))
    theta = positions[..., None].to(FP32) * inv_freq
    emb = torch.cat((theta, theta), dim=-1)
    return r(emb.cos()), r(emb.sin())


# ---------------------------------------------------------------------------------------------------- inputs


def wide_fp16(shape, g: torch.Generator, lo: int = -14, hi: int = 6) -> torch.Tensor:
    """fp16 values with per-element magnitudes 2^lo .. 2^hi, random signs (no inf/NaN)."""
    mag = torch.randn(shape, generator=g).abs() + 0.5
    exp = torch.randint(lo, hi + 1, shape, generator=g).float()
    sign = torch.randint(0, 2, shape, generator=g).float() * 2 - 1
    return (sign * mag * torch.exp2(exp)).to(FP16)


def _model(family: str, profile: str):
    model = build(family, dtype=FP16)
    return roundalign.apply(model, profile, allow_non_bf16=True)


# ---------------------------------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize(
    "profile,norm_rule,qk_rule",
    [
        ("hf", None, None),
        ("vllm-eager", None, None),
        ("sglang", "round_after_weight", "round_after_weight"),
        ("vllm", "round_after_weight", "fused_into_rope"),
    ],
)
def test_patched_rms_norms_round_to_fp16(profile, norm_rule, qk_rule):
    """The decoder, final and q/k norms of a patched fp16 Qwen3 equal the fp16 formula of their rule bitwise.
    ``hf``/``vllm-eager`` leave the norms as HF's (round_before_weight): stock HF in fp16 is checked too."""
    norm_rule, qk_rule = norm_rule or "round_before_weight", qk_rule or "round_before_weight"
    model = _model("qwen3", profile)
    g = torch.Generator().manual_seed(3)
    layer = model.model.layers[1]
    with torch.no_grad():
        layer.input_layernorm.weight.copy_(wide_fp16(layer.input_layernorm.weight.shape, g, -20, 1))
        x = wide_fp16((7, 64), g, -12, 8)
        eps = layer.input_layernorm.variance_epsilon
        got = layer.input_layernorm(x)
        assert got.dtype == FP16
        assert_bitwise_equal(got, RMS_NORM[norm_rule](x, layer.input_layernorm.weight, eps), "input_layernorm")
        # the rule matters under fp16 too, and so does the dtype: bf16 rounding gives other bits
        other = "round_after_weight" if norm_rule == "round_before_weight" else "round_before_weight"
        assert not torch.equal(got, RMS_NORM[other](x, layer.input_layernorm.weight, eps))
        bf16_ref = formulas.RMS_NORM[norm_rule](x, layer.input_layernorm.weight, eps, torch.bfloat16)
        assert not torch.equal(got, bf16_ref.to(FP16))

        q = wide_fp16((2, 5, 4, 16), g, -10, 6)  # (B, T, heads, head_dim)
        got_q = layer.self_attn.q_norm(q)
        assert got_q.dtype == (FP32 if qk_rule == "fused_into_rope" else FP16)
        assert_bitwise_equal(got_q, RMS_NORM[qk_rule](q, layer.self_attn.q_norm.weight, eps), "q_norm")

        if profile != "hf" and profile != "vllm-eager":  # these carry the fp32 sum: the final norm reads S
            s = f(x) + f(wide_fp16((7, 64), g, -12, 8))
            got_final = model.model.norm((r(s), Carry(s)))  # what the last layer hands the final norm
            assert_bitwise_equal(got_final, RMS_NORM[norm_rule](s, model.model.norm.weight, eps), "final norm of S")


# ----------------------------------------------------------------------------------------------------- SwiGLU


@pytest.mark.parametrize("profile,rule", [("vllm", "once"), ("vllm-eager", "round_silu")])
def test_patched_swiglu_rounds_to_fp16(profile, rule):
    """The patched MLP is ``down(swiglu(gate, up))`` with the fp16 formula of its rule, bitwise."""
    model = _model("qwen3", profile)
    mlp = model.model.layers[0].mlp
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        x = wide_fp16((9, 64), g, -6, 4)
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        assert_bitwise_equal(mlp(x), mlp.down_proj(SWIGLU[rule](gate, up)), f"mlp {rule}")
        # wider operands on the element-wise part alone: fp16 subnormal products and overflow to inf
        gate, up = wide_fp16((31, 67), g, -14, 8), wide_fp16((31, 67), g, -14, 8)
        got = roundalign.ops.swiglu(gate, up, rule)
        assert got.dtype == FP16 and torch.isinf(got).any() and (got.abs() < 2.0**-14).logical_and(got != 0).any()
        assert_bitwise_equal(got, SWIGLU[rule](gate, up), f"swiglu {rule}")
        other = "once" if rule == "round_silu" else "round_silu"
        assert not torch.equal(got, SWIGLU[other](gate, up))


def test_patched_moe_experts_swiglu_rounds_to_fp16():
    """Qwen3-MoE experts under vllm (expert_swiglu=round_silu) in fp16."""
    model = _model("qwen3_moe", "vllm")
    experts = model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(5)
    gate_up = wide_fp16((11, 96), g, -8, 5)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_bitwise_equal(experts._apply_gate(gate_up), swiglu_round_silu(gate, up), "experts")


# ------------------------------------------------------------------------- residual stream and q/k norm -> RoPE


@pytest.mark.parametrize("profile", ["vllm", "sglang", "aligned", "hf"])
def test_residual_stream_stays_fp16(profile):
    """Every layer's R is fp16, also where the incoming residual is the fp32 sum S (vllm's round_at_attention):
    R = r(S) rounds to the sublayer output's dtype, the model's. HF's output_hidden_states are all fp16."""
    model = _model("qwen3", profile)
    outs = []
    hooks = [layer.register_forward_hook(lambda m, i, o: outs.append(o)) for layer in model.model.layers]
    try:
        with torch.no_grad():
            hs = model(torch.arange(1, 20)[None], output_hidden_states=True).hidden_states
    finally:
        for h in hooks:
            h.remove()
    assert all(h.dtype == FP16 for h in hs)
    for o in outs:
        if isinstance(o, tuple):  # (R, Carry(S))
            big_r, (s,) = o
            assert big_r.dtype == FP16 and s.dtype == (FP16 if profile == "hf" else FP32)
            assert torch.equal(big_r, r(s))
        else:
            assert o.dtype == FP16


def test_residual_add_rounds_the_fp32_sum_to_fp16():
    g = torch.Generator().manual_seed(6)
    a = wide_fp16((5, 40), g, -14, 10)
    s_in = f(wide_fp16((5, 40), g, -14, 10)) * 1.0001  # an fp32 carried residual, not fp16-representable
    for rule in ("normalize_fp32_sum", "round_at_attention", "never_round"):
        big_r, s = roundalign.ops.residual_add(a, s_in, rule)
        assert_bitwise_equal(s, s_in + f(a), rule)
        assert_bitwise_equal(big_r, r(s_in + f(a)), rule)  # fp16, not bf16


_RECORDED: list = []


def _recording_sdpa(module, query, key, value, attention_mask, **kwargs):
    _RECORDED.append((query, key))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@pytest.mark.parametrize(
    "profile,qk_rule,rounding",
    [
        ("vllm", "fused_into_rope", "once"),
        ("sglang", "round_after_weight", "per_op"),
        ("hf", "round_before_weight", "per_op"),
    ],
)
def test_qk_norm_then_rope_rounds_to_fp16(profile, qk_rule, rounding):
    """Qwen3 attention: q/k projections -> q/k norm -> RoPE, recorded where they enter the attention kernel, equal
    the fp16 chain from the formulas. Under fused_into_rope the norm's fp32 output reaches RoPE unrounded and RoPE
    rounds once, to fp16. (sglang on head_dim 16 uses its per_op, cast-cache rule: head_dim is not 64/128/...)"""
    model = _model("qwen3", profile)
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.copy_(wide_fp16(norm.weight.shape, g, -3, 2))
    h = wide_fp16((1, 12, 64), g, -4, 2)
    pos = torch.arange(12)[None]
    cos, sin = model.model.rotary_emb(h, pos)
    base = model.config.rope_parameters["rope_theta"]
    c16, s16 = cos_sin16(pos, 16, base)
    assert cos.dtype == FP16 and torch.equal(cos, c16) and torch.equal(sin, s16)  # c16 is the model dtype's

    # A name of its own in HF's global registry (idempotent): no other model or test selects it.
    ALL_ATTENTION_FUNCTIONS.register("roundalign_test_record", _recording_sdpa)
    saved = model.config._attn_implementation
    model.config._attn_implementation = "roundalign_test_record"
    _RECORDED.clear()
    try:
        with torch.no_grad():
            attn(h, (cos, sin), attention_mask=None)
    finally:
        model.config._attn_implementation = saved
    ((query, key),) = _RECORDED
    eps = attn.q_norm.variance_epsilon
    with torch.no_grad():
        q = attn.q_proj(h).view(1, 12, -1, 16)
        k = attn.k_proj(h).view(1, 12, -1, 16)
        c, s = c16[:, None], s16[:, None]  # (B, 1, T, D)
        want_q = rope(RMS_NORM[qk_rule](q, attn.q_norm.weight, eps).transpose(1, 2), c, s, rounding)
        want_k = rope(RMS_NORM[qk_rule](k, attn.k_norm.weight, eps).transpose(1, 2), c, s, rounding)
    assert query.dtype == key.dtype == FP16
    assert_bitwise_equal(query, want_q, f"{profile} query")
    assert_bitwise_equal(key, want_k, f"{profile} key")
    if qk_rule == "fused_into_rope":  # the fused chain is not the rounded one: the test can tell them apart
        rounded = rope(rms_norm_round_after_weight(q, attn.q_norm.weight, eps).transpose(1, 2), c, s, "once")
        assert not torch.equal(query, rounded)


def test_rope_op_default_follows_the_c16_cache():
    """ops.rope on the fp32 norm output without out_dtype rounds to the cos/sin cache's 16-bit dtype (fp16 here),
    as the patched attention does explicitly; with an fp32 cache there is no model dtype and it stays bf16."""
    g = torch.Generator().manual_seed(8)
    x32 = f(wide_fp16((3, 2, 5, 16), g, -4, 3)) * 1.001
    c16, s16 = cos_sin16(torch.arange(5), 16, 10000.0)
    got = roundalign.ops.rope(x32, c16, s16, "once")
    assert_bitwise_equal(got, rope(x32, c16, s16, "once"), "rope default out dtype")
    assert roundalign.ops.rope(x32, f(c16), f(s16), "once").dtype == torch.bfloat16
