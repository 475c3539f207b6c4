"""Gradients of roundalign.ops.

(a) torch.autograd.gradcheck in float64, where the ops compute in float64 and every r(.) is a no-op.
(b) bf16 backward, bit for bit:
    - rules that round once: equal to autograd through ``(fp32 formula).to(bf16)`` on ``x.float()`` leaves with the
      bf16 grad_output, the leaf gradients then cast to bf16 (the formula from tests/formulas.py);
    - HF's per-op rules (round_before_weight, normalize_rounded_sum, round_silu, per_op RoPE with bf16 cos/sin):
      equal to stock HF's bf16 autograd, with HF's expression written here or HF's own module/function;
    - mixed regions (an HF piece feeding a once piece) compose the two.
(c) activation memory: bytes saved for backward by the op vs the stock HF expression of the same region.
"""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb, rotate_half

import formulas as ref
from helpers import assert_bitwise_equal, assert_not_bitwise_equal, sprinkle
from roundalign import get_profile, list_profiles, ops
from roundalign.profiles import ResidualRule, RMSNormRule, RopeRounding, SwiGLURule

BF16, FP32, F64 = torch.bfloat16, torch.float32, torch.float64
EPS = 1e-6
RMS_RULES = [r.value for r in RMSNormRule]
RES_RULES = [r.value for r in ResidualRule]
ROPE_ROUNDINGS = [r.value for r in RopeRounding]
SWIGLU_RULES = [r.value for r in SwiGLURule]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(shape, g, dtype=BF16, scale=1.0):
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def leaves(*ts, dtype=None):
    return [t.detach().to(dtype or t.dtype).clone().requires_grad_() for t in ts]


def grads_of(fn, inputs, grad_outputs, leaf_dtype=None):
    """Leaf gradients of ``fn(*leaves)`` for the given grad_outputs; leaves are copies of ``inputs`` in
    ``leaf_dtype`` (default: their own dtype). Gradients are returned in each input's original dtype."""
    ls = leaves(*inputs, dtype=leaf_dtype)
    outs = fn(*ls)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(outs, list(grad_outputs))
    return [leaf.grad.to(t.dtype) for leaf, t in zip(ls, inputs, strict=True)]


def assert_grads_equal(got, want, what):
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert_bitwise_equal(a, b, f"{what} grad of input {i}")


# ------------------------------------------------------------------------------- HF expressions (stock autograd)


def hf_rms_norm(x, w, eps=EPS):
    """Qwen3RMSNorm.forward (transformers 5.24), written out."""
    x32 = x.to(FP32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    x32 = x32 * torch.rsqrt(variance + eps)
    return w * x32.to(BF16)


def hf_rope(q, cos, sin):
    """apply_rotary_pos_emb's `(q * cos) + (rotate_half(q) * sin)`."""
    return (q * cos) + (rotate_half(q) * sin)


def hf_swiglu(gate, up):
    return ACT2FN["silu"](gate) * up


def hf_module_rms_norm(x, w, eps=EPS):
    """The real transformers module, with w as its weight."""
    m = Qwen3RMSNorm(x.shape[-1], eps=eps)
    return torch.func.functional_call(m, {"weight": w}, (x,))


# ---------------------------------------------------------------------------------------------- (a) gradcheck


def f64(*shape, seed=0, scale=1.0):
    return (torch.randn(shape, generator=gen(seed), dtype=F64) * scale).requires_grad_()


@pytest.mark.parametrize("rule", RMS_RULES + ["fused_into_rope"])
def test_gradcheck_rms_norm(rule):
    x, w = f64(3, 5, 12, seed=1), f64(12, seed=2)
    assert torch.autograd.gradcheck(lambda x, w: ops.rms_norm(x, w, EPS, rule), (x, w))


@pytest.mark.parametrize("rule", RES_RULES)
def test_gradcheck_residual_add(rule):
    a, h = f64(4, 10, seed=3), f64(4, 10, seed=4)
    assert torch.autograd.gradcheck(lambda a, h: ops.residual_add(a, h, rule), (a, h))


@pytest.mark.parametrize("residual_rule", RES_RULES)
@pytest.mark.parametrize("norm_rule", RMS_RULES)
def test_gradcheck_add_rms_norm(norm_rule, residual_rule):
    a, h, w = f64(4, 10, seed=5), f64(4, 10, seed=6), f64(10, seed=7)
    fn = lambda a, h, w: ops.add_rms_norm(a, h, w, EPS, norm_rule, residual_rule)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (a, h, w))


@pytest.mark.parametrize("rounding", ROPE_ROUNDINGS)
def test_gradcheck_rope(rounding):
    x = f64(2, 3, 5, 8, seed=8)
    cos, sin = f64(2, 1, 5, 8, seed=9).detach(), f64(2, 1, 5, 8, seed=10).detach()
    assert torch.autograd.gradcheck(lambda x: ops.rope(x, cos, sin, rounding), (x,))


@pytest.mark.parametrize("rounding", ROPE_ROUNDINGS)
def test_gradcheck_fused_qk_norm_rope(rounding):
    q, w = f64(2, 5, 3, 8, seed=11), f64(8, seed=12)
    cos, sin = f64(2, 1, 5, 8, seed=13).detach(), f64(2, 1, 5, 8, seed=14).detach()
    fn = lambda q, w: ops.rope(ops.rms_norm(q, w, EPS, "fused_into_rope").transpose(1, 2), cos, sin, rounding)  # noqa
    assert torch.autograd.gradcheck(fn, (q, w))


@pytest.mark.parametrize("rule", SWIGLU_RULES)
def test_gradcheck_swiglu(rule):
    g, u = f64(4, 9, seed=15, scale=3.0), f64(4, 9, seed=16)
    assert torch.autograd.gradcheck(lambda g, u: ops.swiglu(g, u, rule), (g, u))


# ------------------------------------------------------------------------------ (b) bf16 gradients, bit for bit


def norm_x(shape, g, scale=1.0):
    return sprinkle(randn(shape, g, scale=scale), g, 0.0).contiguous()


def test_grad_rms_norm_round_before_weight_is_stock_hf():
    g = gen(20)
    x, w = norm_x((5, 123, 123), g), randn(123, g)
    gy = randn(x.shape, g)
    got = grads_of(lambda x, w: ops.rms_norm(x, w, EPS, "round_before_weight"), (x, w), (gy,))
    assert_grads_equal(got, grads_of(hf_rms_norm, (x, w), (gy,)), "round_before_weight vs HF expression")
    assert_grads_equal(got, grads_of(hf_module_rms_norm, (x, w), (gy,)), "round_before_weight vs Qwen3RMSNorm")


def test_grad_rms_norm_round_after_weight_is_fp32_formula():
    g = gen(21)
    x, w = norm_x((5, 123, 123), g), randn(123, g)
    gy = randn(x.shape, g)
    got = grads_of(lambda x, w: ops.rms_norm(x, w, EPS, "round_after_weight"), (x, w), (gy,))
    want = grads_of(lambda x, w: ref.rms_norm_round_after_weight(x, w, EPS), (x, w), (gy,), leaf_dtype=FP32)
    assert_grads_equal(got, want, "round_after_weight vs fp32 formula")
    assert_not_bitwise_equal(got[1], grads_of(hf_rms_norm, (x, w), (gy,))[1], "after vs before weight grad")


def test_grad_rms_norm_fused_into_rope_is_fp32_formula():
    g = gen(22)
    x, w = norm_x((3, 7, 96), g), randn(96, g)
    gy = randn(x.shape, g, dtype=FP32)  # the output is fp32, so is its gradient
    got = grads_of(lambda x, w: ops.rms_norm(x, w, EPS, "fused_into_rope"), (x, w), (gy,))
    want = grads_of(lambda x, w: ref.rms_norm_fp32(x, w, EPS), (x, w), (gy,), leaf_dtype=FP32)
    assert_grads_equal(got, want, "fused_into_rope vs fp32 formula")


def value_at_gradient_at(fn, value_at, gradient_at, *args):
    """``fn``'s value at ``value_at`` with autograd's gradient of ``fn`` at ``gradient_at``: the value's bits exactly
    (``g - g.detach()`` is an exact zero), the gradient of the other point."""
    at_grad = fn(gradient_at, *args)
    return fn(value_at, *args).detach() + (at_grad - at_grad.detach())


def add_norm_reference(norm_rule, residual_rule):
    """(a, h, w) -> (y, R) built from the HF expression for HF rules and the fact-sheet formula for the others,
    on bf16 leaves (explicit upcasts in the fp32 parts, bf16 ops in the HF parts). A norm of the fp32 sum ``S``
    takes its value at ``S`` and its gradient at ``R = r(S)``, reaching ``S`` in fp32 (roundalign.ops.rms_norm)."""

    def fn(a, h, w):
        if norm_rule == "round_before_weight":
            norm = hf_rms_norm
        else:
            norm = lambda x, w: ref.rms_norm_round_after_weight(x, w, EPS)  # noqa: E731
        if residual_rule == "normalize_rounded_sum":
            big_r = h + a  # HF: residual + hidden_states, one bf16 add
            return norm(big_r, w), big_r  # HF: w * r(x*nu) with a bf16 weight multiply, or the fp32 formula
        s = a.float() + h.float()  # S
        big_r = s.to(BF16)
        r_on_s = s + (big_r.float() - s).detach()  # R's value (the difference is exact), S's gradient path
        return value_at_gradient_at(norm, s, r_on_s, w), big_r

    return fn


@pytest.mark.parametrize("residual_rule", RES_RULES)
@pytest.mark.parametrize("norm_rule", RMS_RULES)
def test_grad_add_rms_norm(norm_rule, residual_rule):
    """Both outputs carry gradient (the norm output and R, which the next residual add reads)."""
    g = gen(23)
    a, h, w = norm_x((5, 123, 123), g), norm_x((5, 123, 123), g, 8.0), randn(123, g)
    gy, gr = randn(a.shape, g), randn(a.shape, g)
    got = grads_of(lambda a, h, w: ops.add_rms_norm(a, h, w, EPS, norm_rule, residual_rule), (a, h, w), (gy, gr))
    want = grads_of(add_norm_reference(norm_rule, residual_rule), (a, h, w), (gy, gr))
    assert_grads_equal(got, want, f"add_rms_norm {norm_rule}/{residual_rule}")
    if norm_rule == "round_before_weight" and residual_rule == "normalize_rounded_sum":
        hf_module = lambda a, h, w: (hf_module_rms_norm(h + a, w), h + a)  # noqa: E731
        assert_grads_equal(got, grads_of(hf_module, (a, h, w), (gy, gr)), "add_rms_norm vs HF module")
    if residual_rule != "normalize_rounded_sum":  # the norm's output is the formula's at S, bit for bit
        y, _ = ops.add_rms_norm(a, h, w, EPS, norm_rule, residual_rule)
        assert_bitwise_equal(y, ref.add_rms_norm(a, h, w, EPS, norm_rule, residual_rule)[0], "output at S")
        assert_not_bitwise_equal(y, ref.add_rms_norm(a, h, w, EPS, norm_rule, "normalize_rounded_sum")[0], "vs R")
    other = "normalize_fp32_sum" if residual_rule == "normalize_rounded_sum" else "normalize_rounded_sum"
    other_grads = grads_of(add_norm_reference(norm_rule, other), (a, h, w), (gy, gr))
    assert_not_bitwise_equal(got[0], other_grads[0], "gradient depends on the residual rule")


@pytest.mark.parametrize("rule", RES_RULES)
def test_grad_residual_add(rule):
    g = gen(24)
    a, h = norm_x((7, 96), g), norm_x((7, 96), g, 8.0)
    gr = randn(a.shape, g)
    gx = randn(a.shape, g, dtype=FP32 if rule == "normalize_fp32_sum" else BF16)
    fn = lambda a, h: ops.residual_add(a, h, rule)  # noqa: E731
    if rule == "normalize_rounded_sum":  # (R, R): one tensor; both gradients accumulate on it in bf16, as HF's
        got = grads_of(fn, (a, h), (gr, gx))
        want = grads_of(lambda a, h: (h + a, h + a), (a, h), (gr, gx))
    else:
        got = grads_of(fn, (a, h), (gr, gx))
        want = grads_of(ref.residual_fp32, (a, h), (gr, gx), leaf_dtype=FP32)
    assert_grads_equal(got, want, f"residual_add {rule}")


def rope_case(head_dim, g, cos_dtype):
    q = randn((2, 3, 11, head_dim), g, scale=2.0)
    pos = torch.randint(0, 40000, (2, 11), generator=g)
    c32, s32 = ref.cos_sin(pos, head_dim)
    cos, sin = ref.cos_sin_in(c32, s32, cos_dtype)
    return q, cos, sin  # cos/sin (B, T, D) as HF's rotary embedding returns them


@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_grad_rope_per_op_bf16_is_stock_hf(head_dim):
    g = gen(25)
    q, cos, sin = rope_case(head_dim, g, "bf16")
    k = randn(q.shape, g)
    gq, gk = randn(q.shape, g), randn(q.shape, g)
    c, s = cos[:, None], sin[:, None]
    got = grads_of(lambda q, k: (ops.rope(q, c, s, "per_op"), ops.rope(k, c, s, "per_op")), (q, k), (gq, gk))
    want = grads_of(lambda q, k: apply_rotary_pos_emb(q, k, cos, sin), (q, k), (gq, gk))
    assert_grads_equal(got, want, "rope per_op/bf16 vs HF apply_rotary_pos_emb")
    assert_grads_equal(got[:1], grads_of(lambda q: hf_rope(q, c, s), (q,), (gq,)), "rope per_op vs HF expression")


@pytest.mark.parametrize("rounding", ["once", "truncate"])
@pytest.mark.parametrize("cos_dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_grad_rope_once_is_fp32_formula(head_dim, cos_dtype, rounding):
    """One conversion at the output, to nearest or by truncation: straight-through, the fp32 formula's gradient."""
    g = gen(26)
    q, cos, sin = rope_case(head_dim, g, cos_dtype)
    c, s = cos[:, None], sin[:, None]
    gq = randn(q.shape, g)
    got = grads_of(lambda q: ops.rope(q, c, s, rounding), (q,), (gq,))
    want = grads_of(lambda q: ref.rope(q, c, s, "once"), (q,), (gq,), leaf_dtype=FP32)
    assert_grads_equal(got, want, f"rope {rounding}/{cos_dtype} vs fp32 formula")
    hf = grads_of(lambda q: hf_rope(q, c.to(BF16), s.to(BF16)), (q,), (gq,))
    assert_not_bitwise_equal(got[0], hf[0], "once vs HF per-op gradient")


def test_grad_rope_per_op_fp32_cos():
    """per_op with fp32 cos/sin (no named profile uses it): written as HF's expression with each product cast,
    so the backward rounds per op too: r(r(g*c) + r(rotate_half^T(g*s))), accumulated in bf16."""
    g = gen(27)
    q, cos, sin = rope_case(128, g, "fp32")
    c, s = cos[:, None], sin[:, None]
    gq = randn(q.shape, g)
    got = grads_of(lambda q: ops.rope(q, c, s, "per_op"), (q,), (gq,))
    hf_cast = lambda q: (q * c).to(BF16) + (rotate_half(q) * s).to(BF16)  # noqa: E731
    assert_bitwise_equal(hf_cast(q), ref.rope(q, c, s, "per_op"), "the expression is the fact-sheet formula")
    assert_grads_equal(got, grads_of(hf_cast, (q,), (gq,)), "rope per_op/fp32 vs HF-style expression")


@pytest.mark.parametrize("rounding", ROPE_ROUNDINGS)
@pytest.mark.parametrize("cos_dtype", ["bf16", "fp32"])
def test_grad_fused_qk_norm_rope_is_fp32_formula(cos_dtype, rounding):
    """q_norm fused_into_rope: the norm output stays fp32; gradient of the whole chain vs its formula on fp32 leaves."""
    g = gen(28)
    q, w = randn((2, 11, 3, 128), g), randn(128, g)
    pos = torch.randint(0, 40000, (2, 11), generator=g)
    cos, sin = ref.cos_sin_in(*ref.cos_sin(pos, 128), cos_dtype)
    c, s = cos[:, None], sin[:, None]
    gy = randn((2, 3, 11, 128), g)
    chain = lambda q, w: ops.rope(ops.rms_norm(q, w, EPS, "fused_into_rope").transpose(1, 2), c, s, rounding)  # noqa
    got = grads_of(chain, (q, w), (gy,))
    # Truncation, like rounding, is straight-through: its gradient is the once rule's, the fp32 formula's.
    formula = "once" if rounding == "truncate" else rounding
    want = grads_of(
        lambda q, w: ref.qk_norm_then_rope(q, w, EPS, "fused_into_rope", c, s, formula), (q, w), (gy,), leaf_dtype=FP32
    )
    assert_grads_equal(got, want, f"fused q_norm + rope {cos_dtype}/{rounding}")


@pytest.mark.parametrize("expert", [False, True])
def test_grad_swiglu_round_silu_is_stock_hf(expert):
    g = gen(29)
    if expert:  # MoE experts: gate, up = gate_up.chunk(2); the gradient flows back into one tensor
        gate_up = randn((37, 2 * 77), g, scale=3.0)
        gy = randn((37, 77), g)
        got = grads_of(lambda gu: ops.swiglu(*gu.chunk(2, -1), "round_silu"), (gate_up,), (gy,))
        want = grads_of(lambda gu: hf_swiglu(*gu.chunk(2, -1)), (gate_up,), (gy,))
    else:
        gate, up = randn((5, 123, 123), g, scale=3.0), randn((5, 123, 123), g)
        gy = randn(gate.shape, g)
        got = grads_of(lambda a, b: ops.swiglu(a, b, "round_silu"), (gate, up), (gy,))
        want = grads_of(hf_swiglu, (gate, up), (gy,))
    assert_grads_equal(got, want, "swiglu round_silu vs HF act_fn(gate) * up")


@pytest.mark.parametrize("expert", [False, True])
def test_grad_swiglu_once_is_fp32_formula(expert):
    g = gen(30)
    if expert:
        gate_up = randn((37, 2 * 77), g, scale=3.0)
        gy = randn((37, 77), g)
        got = grads_of(lambda gu: ops.swiglu(*gu.chunk(2, -1), "once"), (gate_up,), (gy,))
        want = grads_of(lambda gu: ref.swiglu_once(*gu.chunk(2, -1)), (gate_up,), (gy,), leaf_dtype=FP32)
        hf = grads_of(lambda gu: hf_swiglu(*gu.chunk(2, -1)), (gate_up,), (gy,))
    else:
        gate, up = randn((5, 123, 123), g, scale=3.0), randn((5, 123, 123), g)
        gy = randn(gate.shape, g)
        got = grads_of(lambda a, b: ops.swiglu(a, b, "once"), (gate, up), (gy,))
        want = grads_of(ref.swiglu_once, (gate, up), (gy,), leaf_dtype=FP32)
        hf = grads_of(hf_swiglu, (gate, up), (gy,))
    assert_grads_equal(got, want, "swiglu once vs fp32 formula")
    assert_not_bitwise_equal(got[0], hf[0], "once vs HF gradient")


# ---------------------------------------------------------------------- whole regions of every named profile


NORM_REF = {
    "round_before_weight": hf_rms_norm,
    "round_after_weight": lambda x, w: ref.rms_norm_round_after_weight(x, w, EPS),
    "fused_into_rope": lambda x, w: ref.rms_norm_fp32(x, w, EPS),
}


def rope_ref(rounding):
    def fn(x, cos, sin):
        if rounding == "once":
            return ref.rope(x, cos, sin, "once")
        if rounding == "truncate":  # the truncated values, with once's (straight-through) gradient
            once = ref.rope(x, cos, sin, "once")
            return once + (ref.rope(x, cos, sin, "truncate") - once).detach()
        if x.dtype == BF16 and cos.dtype == BF16:
            return hf_rope(x, cos, sin)
        return (x * cos).to(BF16) + (rotate_half(x) * sin).to(BF16)

    return fn


SWIGLU_REF = {"round_silu": hf_swiglu, "once": ref.swiglu_once}


@pytest.mark.parametrize("name", list_profiles())
def test_grad_profile_decoder_regions(name):
    """Per profile: a Qwen3-like layer's element-wise regions chained (input norm, q/k norm + RoPE for head_dim 64 and
    96, residual add + post-attention norm, dense SwiGLU, expert SwiGLU), gradients vs the composed references."""
    p = get_profile(name)
    g = gen(31)
    b, t, hidden, heads = 2, 9, 96, 3

    def layer(use_ops):
        def fn(x, attn_out, w_in, w_post, qw64, qw96, q64, q96, gate, up, gate_up):
            if use_ops:
                n_in = ops.rms_norm(x, w_in, EPS, p.rms_norm)
                y, big_r = ops.add_rms_norm(attn_out, x, w_post, EPS, p.rms_norm, p.residual)
                mlp = ops.swiglu(gate, up, p.swiglu)
                exp = ops.swiglu(*gate_up.chunk(2, -1), p.expert_swiglu)
            else:
                n_in = NORM_REF[p.rms_norm.value](x, w_in)
                y, big_r = add_norm_reference(p.rms_norm.value, p.residual.value)(attn_out, x, w_post)
                mlp = SWIGLU_REF[p.swiglu.value](gate, up)
                exp = SWIGLU_REF[p.expert_swiglu.value](*gate_up.chunk(2, -1))
            outs = [n_in, y, big_r, mlp, exp]
            for q, qw in ((q64, qw64), (q96, qw96)):
                d = q.shape[-1]
                rule = p.rope_for(d)
                c32, s32 = ref.cos_sin(torch.arange(t).expand(b, t), d)
                cos, sin = ref.cos_sin_in(c32[:, None], s32[:, None], rule.cos_sin.value)
                if use_ops:
                    qn = ops.rms_norm(q, qw, EPS, p.qk_norm).transpose(1, 2)
                    outs.append(ops.rope(qn, cos, sin, rule.rounding))
                else:
                    qn = NORM_REF[p.qk_norm.value](q, qw).transpose(1, 2)
                    outs.append(rope_ref(rule.rounding.value)(qn, cos, sin))
            return tuple(outs)

        return fn

    inputs = (
        randn((b, t, hidden), g, scale=4.0),
        randn((b, t, hidden), g),
        randn(hidden, g),
        randn(hidden, g),
        randn(64, g),
        randn(96, g),
        randn((b, t, heads, 64), g),
        randn((b, t, heads, 96), g),
        randn((b, t, 160), g, scale=3.0),
        randn((b, t, 160), g),
        randn((b * t, 2 * 48), g, scale=3.0),
    )
    with torch.no_grad():
        outs = layer(True)(*inputs)
        want_outs = layer(False)(*inputs)
    for i, (o, w) in enumerate(zip(outs, want_outs, strict=True)):
        assert_bitwise_equal(o, w, f"{name} forward output {i}")
    grad_outputs = [randn(o.shape, gen(100 + i)) for i, o in enumerate(outs)]
    got = grads_of(layer(True), inputs, grad_outputs)
    want = grads_of(layer(False), inputs, grad_outputs)
    assert_grads_equal(got, want, f"profile {name}")


# ----------------------------------------------------------------------------------------- (c) saved bytes


def saved_bytes(fn, *inputs) -> int:
    """Bytes of the distinct storages autograd saves for backward while running ``fn``."""
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(storages.values())


def report(region, rule, ours, stock):
    print(f"\n[saved bytes] {region:<22} {rule:<45} ours {ours:>9}  stock HF {stock:>9}")
    assert ours <= stock, f"{region} {rule}: saves {ours} bytes for backward, stock HF saves {stock}"


def bf16_leaves(*shapes, g, scales=None):
    scales = scales or [1.0] * len(shapes)
    return [randn(s, g, scale=k).requires_grad_() for s, k in zip(shapes, scales, strict=True)]


@pytest.mark.parametrize("rule", RMS_RULES + ["fused_into_rope"])
def test_saved_bytes_rms_norm(rule):
    x, w = bf16_leaves((4, 33, 256), (256,), g=gen(40))
    stock_norm = Qwen3RMSNorm(256, eps=EPS).to(BF16)
    stock = saved_bytes(stock_norm, x)
    report("rms_norm", rule, saved_bytes(lambda x, w: ops.rms_norm(x, w, EPS, rule), x, w), stock)


@pytest.mark.parametrize("residual_rule", RES_RULES)
@pytest.mark.parametrize("norm_rule", RMS_RULES)
def test_saved_bytes_add_rms_norm(norm_rule, residual_rule):
    a, h = bf16_leaves((4, 33, 256), (4, 33, 256), g=gen(41))
    w = randn(256, gen(42)).requires_grad_()
    stock_norm = Qwen3RMSNorm(256, eps=EPS).to(BF16)

    def stock(a, h):  # decoder layer: hidden_states = residual + hidden_states; post_attention_layernorm(...)
        big_r = h + a
        return stock_norm(big_r), big_r

    ours = saved_bytes(lambda a, h, w: ops.add_rms_norm(a, h, w, EPS, norm_rule, residual_rule), a, h, w)
    report("residual add + norm", f"{norm_rule}/{residual_rule}", ours, saved_bytes(stock, a, h))


@pytest.mark.parametrize("rounding", ROPE_ROUNDINGS)
@pytest.mark.parametrize("cos_dtype", ["bf16", "fp32"])
def test_saved_bytes_rope(cos_dtype, rounding):
    """HF's apply_rotary_pos_emb on q and k with the same cos/sin tensors the op gets (HF with an fp32 cache keeps
    fp32 cos/sin too). The bf16-cache HF number is printed alongside."""
    g = gen(43)
    q, k = bf16_leaves((2, 8, 33, 128), (2, 2, 33, 128), g=g)
    c32, s32 = ref.cos_sin(torch.arange(33).expand(2, 33), 128)
    cos, sin = ref.cos_sin_in(c32, s32, cos_dtype)
    stock = saved_bytes(lambda q, k: apply_rotary_pos_emb(q, k, cos, sin), q, k)
    stock16 = saved_bytes(lambda q, k: apply_rotary_pos_emb(q, k, cos.to(BF16), sin.to(BF16)), q, k)
    c, s = cos[:, None], sin[:, None]
    ours = saved_bytes(lambda q, k: (ops.rope(q, c, s, rounding), ops.rope(k, c, s, rounding)), q, k)
    print(f"\n[saved bytes] rope {cos_dtype}/{rounding}: stock HF with a bf16 cache saves {stock16}")
    report("rope", f"{cos_dtype}/{rounding}", ours, stock)


@pytest.mark.parametrize("rounding", ROPE_ROUNDINGS)
@pytest.mark.parametrize("qk_rule", ["round_before_weight", "round_after_weight", "fused_into_rope"])
def test_saved_bytes_qk_norm_rope(qk_rule, rounding):
    """Qwen3 attention region: q_norm and k_norm, then RoPE, vs HF's Qwen3RMSNorm + apply_rotary_pos_emb."""
    g = gen(44)
    q, k = bf16_leaves((2, 33, 8, 128), (2, 33, 2, 128), g=g)
    qw, kw = randn(128, g).requires_grad_(), randn(128, g).requires_grad_()
    c32, s32 = ref.cos_sin(torch.arange(33).expand(2, 33), 128)
    cos, sin = c32.to(BF16), s32.to(BF16)
    q_norm, k_norm = Qwen3RMSNorm(128, eps=EPS).to(BF16), Qwen3RMSNorm(128, eps=EPS).to(BF16)

    def stock(q, k):
        return apply_rotary_pos_emb(q_norm(q).transpose(1, 2), k_norm(k).transpose(1, 2), cos, sin)

    def ours(q, k, qw, kw):
        c, s = cos[:, None], sin[:, None]
        qn = ops.rms_norm(q, qw, EPS, qk_rule).transpose(1, 2)
        kn = ops.rms_norm(k, kw, EPS, qk_rule).transpose(1, 2)
        return ops.rope(qn, c, s, rounding), ops.rope(kn, c, s, rounding)

    report("q/k norm + rope", f"{qk_rule}/bf16/{rounding}", saved_bytes(ours, q, k, qw, kw), saved_bytes(stock, q, k))


@pytest.mark.parametrize("expert", [False, True])
@pytest.mark.parametrize("rule", SWIGLU_RULES)
def test_saved_bytes_swiglu(rule, expert):
    g = gen(45)
    if expert:
        (gate_up,) = bf16_leaves((64, 2 * 256), g=g, scales=[3.0])
        stock = saved_bytes(lambda gu: hf_swiglu(*gu.chunk(2, -1)), gate_up)
        ours = saved_bytes(lambda gu: ops.swiglu(*gu.chunk(2, -1), rule), gate_up)
    else:
        gate, up = bf16_leaves((4, 33, 256), (4, 33, 256), g=g, scales=[3.0, 1.0])
        stock = saved_bytes(hf_swiglu, gate, up)
        ours = saved_bytes(lambda a, b: ops.swiglu(a, b, rule), gate, up)
    report("expert swiglu" if expert else "swiglu", rule, ours, stock)
