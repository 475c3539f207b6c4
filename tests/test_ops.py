"""Forward numerics of roundalign.ops: every rule, bit for bit against tests/formulas.py.

Every exactness check is ``assert_bitwise_equal`` (same dtype and shape, same NaN positions, identical bit patterns
elsewhere, so -0.0 != +0.0) against the independent reference in ``tests/formulas.py``, which is written from the
rounding formulas of docs/engine-rounding.md (s1-2) and never calls roundalign.ops.

Inputs are odd shapes with adversarial values: exact bf16 ties (checked to really occur in the fp32 value each op
rounds), subnormals, +-inf, NaN, magnitudes near 1e38 where x^2 overflows fp32, all-zero RMSNorm rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import formulas as ref
from helpers import (
    all_bf16,
    assert_bitwise_equal,
    assert_not_bitwise_equal,
    bf16_from_bits,
    bits,
    count_fp32_ties,
    special_bf16,
    sprinkle,
    tie_prone_bf16,
    ulp_diff,
)
from roundalign import get_profile, list_profiles, ops
from roundalign.profiles import QKNormRule, ResidualRule, RMSNormRule, RopeRounding, SwiGLURule

BF16, FP32 = torch.bfloat16, torch.float32
EPS = 1e-6
PROFILES = list_profiles()
NORM_SHAPES = [(5, 123, 123), (3, 7, 96)]
HEAD_DIMS = [64, 96, 128]
RMS_RULES = [r.value for r in RMSNormRule]
QK_RULES = [r.value for r in QKNormRule]
RES_RULES = [r.value for r in ResidualRule]
ROPE_ROUNDINGS = [r.value for r in RopeRounding]
SWIGLU_RULES = [r.value for r in SwiGLURule]
OTHER = {
    "round_before_weight": "round_after_weight",
    "round_after_weight": "round_before_weight",
    "normalize_rounded_sum": "normalize_fp32_sum",
    "normalize_fp32_sum": "normalize_rounded_sum",
    "round_at_attention": "normalize_rounded_sum",
    "never_round": "normalize_rounded_sum",
    "per_op": "once",
    "once": "per_op",
    "truncate": "once",
}
OTHER_SWIGLU = {"round_silu": "once", "once": "round_silu"}


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn_bf16(shape, g, scale=1.0):
    return (torch.randn(shape, generator=g) * scale).to(BF16)


def norm_input(shape, g, scale=1.0):
    """bf16 rows for RMSNorm: random rows with per-row magnitudes from 1e-30 to 1e30, special values sprinkled in,
    and a block of adversarial rows at the front."""
    d = shape[-1]
    x = torch.randn(shape, generator=g)
    row_scale = 10.0 ** torch.randint(-30, 31, (*shape[:-1], 1), generator=g).float()
    x = sprinkle((x * row_scale * scale).to(BF16), g, fraction=0.01)
    rows = x.view(-1, d)
    specials = special_bf16()
    rows[0] = 0.0  # all-zero row: nu = rsqrt(eps)
    rows[1] = -0.0
    rows[2] = bf16_from_bits(torch.randint(1, 0x80, (d,), generator=g))  # positive subnormals only: mean(x^2) = 0
    rows[3] = randn_bf16(d, g)
    rows[3, 5] = float("inf")  # mean = inf -> nu = 0 -> inf * 0 = NaN, finite * 0 = 0
    rows[4] = randn_bf16(d, g)
    rows[4, 7] = float("nan")
    rows[5] = randn_bf16(d, g, 1e38)  # x^2 overflows fp32
    rows[6] = specials[torch.randint(len(specials), (d,), generator=g)]
    rows[7] = torch.full((d,), 3.3895e38).to(BF16)  # bf16 max finite
    rows[8] = randn_bf16(d, g, 1e-3)  # small enough that eps matters
    return x


# ---------------------------------------------------------------------------------------------------- r() itself


def rne_bits_reference(f32: torch.Tensor) -> torch.Tensor:
    """Round fp32 -> bf16 nearest-even in integer arithmetic (finite and inf inputs): add 0x7FFF plus the lowest
    kept bit, then drop the low 16 bits. Carries into the exponent give the next binade, or inf past bf16 max."""
    b = bits(f32).to(torch.int64) & 0xFFFFFFFF
    lsb = (b >> 16) & 1
    return ((b + 0x7FFF + lsb) >> 16) & 0xFFFF


def test_r_rounds_to_nearest_even_on_every_tie():
    """r(.) (fp32 -> bf16 cast) is RNE: exact halfway points go to the even neighbour, everything else to the nearest.

    For all 65536 upper halves and low halves 0, 1, 0x7FFF, 0x8000 (the tie), 0x8001, 0xFFFF."""
    upper = torch.arange(0x10000, dtype=torch.int64)
    lows = torch.tensor([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    b32 = (upper[:, None] << 16 | lows[None, :]).reshape(-1)
    f32 = torch.where(b32 >= 1 << 31, b32 - (1 << 32), b32).to(torch.int32).view(FP32)
    got = ref.r(f32)
    nan = torch.isnan(f32)
    assert torch.isnan(got[nan]).all()
    want = bf16_from_bits(rne_bits_reference(f32[~nan]))
    assert_bitwise_equal(got[~nan], want, "fp32 -> bf16 cast vs integer RNE")
    # Concrete ties: 1 + 2^-8 lies between 1 (even) and 1 + 2^-7 (odd): goes down; 1 + 3*2^-8 goes up to 1 + 2^-6.
    assert ref.r(torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)])).tolist() == [1.0, 1 + 2**-6, -1.0]
    # fp32 max is past bf16 max + half an ulp: inf. Subnormals are not flushed.
    assert ref.r(torch.tensor([3.4028234663852886e38])).item() == float("inf")
    assert ref.r(torch.tensor([2.0**-133])).item() == 2.0**-133


# ------------------------------------------------------------------------------------------------------- checkers


def check_rms_norm(x, w, eps, rule):
    got = ops.rms_norm(x, w, eps, rule)
    assert_bitwise_equal(got, ref.RMS_NORM[str(rule)](x, w, eps), f"rms_norm {rule}")
    return got


def check_add_rms_norm(a, h, w, eps, norm_rule, residual_rule):
    y, big_r = ops.add_rms_norm(a, h, w, eps, norm_rule, residual_rule)
    want_y, want_r = ref.add_rms_norm(a, h, w, eps, str(norm_rule), str(residual_rule))
    assert_bitwise_equal(y, want_y, f"add_rms_norm norm output {norm_rule}/{residual_rule}")
    assert_bitwise_equal(big_r, want_r, f"add_rms_norm residual R {norm_rule}/{residual_rule}")
    r_op, x_op = ops.residual_add(a, h, residual_rule)
    r_ref, x_ref = ref.RESIDUAL[str(residual_rule)](a, h)
    assert_bitwise_equal(r_op, r_ref, f"residual_add R {residual_rule}")
    assert_bitwise_equal(x_op, x_ref, f"residual_add norm input {residual_rule}")
    return y, big_r


def check_rope(x, cos, sin, rounding):
    got = ops.rope(x, cos, sin, rounding)
    assert_bitwise_equal(got, ref.rope(x, cos, sin, str(rounding)), f"rope {cos.dtype}/{rounding}")
    return got


def check_swiglu(gate, up, rule):
    got = ops.swiglu(gate, up, rule)
    assert_bitwise_equal(got, ref.SWIGLU[str(rule)](gate, up), f"swiglu {rule}")
    return got


def rope_inputs(head_dim, g, batch=2, heads=3, seq=11, max_pos=40000):
    """q in (B, H, T, D) and fp32 c32, s32 in (B, 1, T, D) from random positions (HF's cos.unsqueeze(1))."""
    x = sprinkle(randn_bf16((batch, heads, seq, head_dim), g, 2.0), g, 0.02)
    pos = torch.randint(0, max_pos, (batch, seq), generator=g)
    c32, s32 = ref.cos_sin(pos, head_dim)
    return x, c32[:, None], s32[:, None]


def swiglu_inputs(shape, g):
    gate = sprinkle(randn_bf16(shape, g, 4.0), g, 0.02)
    up = sprinkle(randn_bf16(shape, g), g, 0.02)
    return gate, up


# -------------------------------------------------------------------------------------- named profiles x regions


@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("name", PROFILES)
def test_profile_rms_norm(name, shape):
    p = get_profile(name)
    g = gen(1)
    check_rms_norm(norm_input(shape, g), randn_bf16(shape[-1], g), EPS, p.rms_norm)


@pytest.mark.parametrize("name", PROFILES)
def test_profile_residual_add_rms_norm(name):
    p = get_profile(name)
    g = gen(2)
    shape = (3, 7, 96)
    a, h = norm_input(shape, g), norm_input(shape, g, scale=8.0)
    check_add_rms_norm(a, h, randn_bf16(96, g), EPS, p.rms_norm, p.residual)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("name", PROFILES)
def test_profile_rope(name, head_dim):
    rule = get_profile(name).rope_for(head_dim)
    x, c32, s32 = rope_inputs(head_dim, gen(3))
    cos, sin = ref.cos_sin_in(c32, s32, rule.cos_sin.value)
    check_rope(x, cos, sin, rule.rounding)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("name", PROFILES)
def test_profile_qk_norm_then_rope(name, head_dim):
    """Qwen3's q_norm over head_dim of q (B, T, H, D), then RoPE on (B, H, T, D), as the attention does."""
    p = get_profile(name)
    rule = p.rope_for(head_dim)
    g = gen(4)
    q = norm_input((2, 13, 3, head_dim), g)
    w = randn_bf16(head_dim, g)
    pos = torch.randint(0, 40000, (2, 13), generator=g)
    cos, sin = ref.cos_sin_in(*ref.cos_sin(pos, head_dim), rule.cos_sin.value)
    cos, sin = cos[:, None], sin[:, None]
    normed = ops.rms_norm(q, w, EPS, p.qk_norm)
    got = ops.rope(normed.transpose(1, 2), cos, sin, rule.rounding)
    want = ref.qk_norm_then_rope(q, w, EPS, p.qk_norm.value, cos, sin, rule.rounding.value)
    assert_bitwise_equal(got, want, f"{name} q_norm {p.qk_norm} + rope {rule}")


@pytest.mark.parametrize("region", ["swiglu", "expert_swiglu"])
@pytest.mark.parametrize("name", PROFILES)
def test_profile_swiglu(name, region):
    rule = getattr(get_profile(name), region)
    g = gen(5)
    if region == "expert_swiglu":
        # MoE experts split one gate_up projection: gate and up are non-contiguous halves of one tensor.
        gate_up = sprinkle(randn_bf16((37, 2 * 77), g, 3.0), g, 0.02)
        gate, up = gate_up.chunk(2, dim=-1)
    else:
        gate, up = swiglu_inputs((3, 7, 101), g)
    check_swiglu(gate, up, rule)


def test_sglang_rope_follows_head_dim():
    """SGLang's rule resolves per head_dim, and the two resolved rules really give different numbers."""
    p = get_profile("sglang")
    x, c32, s32 = rope_inputs(128, gen(6))
    fast = p.rope_for(128)
    assert (fast.cos_sin.value, fast.rounding.value) == ("fp32", "once")
    slow = p.rope_for(96)
    assert (slow.cos_sin.value, slow.rounding.value) == ("bf16", "per_op")
    got = check_rope(x, *ref.cos_sin_in(c32, s32, "fp32"), fast.rounding)
    assert_not_bitwise_equal(got, ref.rope(x, *ref.cos_sin_in(c32, s32, "bf16"), "per_op"), "sglang hd128 vs per_op")


# ----------------------------------------------------------------------------------- every rule, not only named


@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("rule", RMS_RULES + ["fused_into_rope"])
def test_rms_norm_rule(rule, shape):
    g = gen(10)
    x, w = norm_input(shape, g), randn_bf16(shape[-1], g)
    got = check_rms_norm(x, w, EPS, rule)
    assert got.dtype == (FP32 if rule == "fused_into_rope" else BF16)
    if rule in OTHER:  # the rule matters: the other rule's formula gives different bits on these inputs
        assert_not_bitwise_equal(got, ref.RMS_NORM[OTHER[rule]](x, w, EPS), f"rms_norm {rule} vs {OTHER[rule]}")


@pytest.mark.parametrize("residual_rule", RES_RULES)
@pytest.mark.parametrize("norm_rule", RMS_RULES)
def test_add_rms_norm_rule(norm_rule, residual_rule):
    g = gen(11)
    shape = (5, 123, 123)
    a, h = norm_input(shape, g), norm_input(shape, g, scale=16.0)
    w = randn_bf16(123, g)
    y, big_r = check_add_rms_norm(a, h, w, EPS, norm_rule, residual_rule)
    assert big_r.dtype == BF16 and y.dtype == BF16
    # normalizing S or r(S) matters: the other residual rule gives different norm outputs (same R)
    other_y, other_r = ref.add_rms_norm(a, h, w, EPS, norm_rule, OTHER[residual_rule])
    assert_bitwise_equal(big_r, other_r, "R is r(a + h) under both residual rules")
    assert_not_bitwise_equal(y, other_y, f"residual {residual_rule} vs {OTHER[residual_rule]}")


@pytest.mark.parametrize("rounding", ROPE_ROUNDINGS)
@pytest.mark.parametrize("cos_sin", ["bf16", "fp32"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_rope_rule(head_dim, cos_sin, rounding):
    x, c32, s32 = rope_inputs(head_dim, gen(12))
    cos, sin = ref.cos_sin_in(c32, s32, cos_sin)
    got = check_rope(x, cos, sin, rounding)
    assert got.dtype == BF16
    assert_not_bitwise_equal(got, ref.rope(x, cos, sin, OTHER[rounding]), f"rope {rounding} vs {OTHER[rounding]}")
    other_dtype = ref.cos_sin_in(c32, s32, "fp32" if cos_sin == "bf16" else "bf16")
    assert_not_bitwise_equal(got, ref.rope(x, *other_dtype, rounding), f"rope cos/sin {cos_sin} vs the other dtype")


def test_rope_layout_bthd():
    """The op only needs cos/sin broadcastable to x: (B, T, H, D) with cos (B, T, 1, D) gives the same bits as
    (B, H, T, D) with cos (B, 1, T, D), transposed."""
    x, c32, s32 = rope_inputs(96, gen(13))
    for rounding in ROPE_ROUNDINGS:
        for cs in ("bf16", "fp32"):
            cos, sin = ref.cos_sin_in(c32, s32, cs)
            a = ops.rope(x, cos, sin, rounding)
            b = ops.rope(x.transpose(1, 2), cos.transpose(1, 2), sin.transpose(1, 2), rounding)
            assert_bitwise_equal(b.transpose(1, 2), a, f"layout {cs}/{rounding}")
            check_rope(x.transpose(1, 2), cos.transpose(1, 2), sin.transpose(1, 2), rounding)


@pytest.mark.parametrize("rounding", ROPE_ROUNDINGS)
@pytest.mark.parametrize("cos_sin", ["bf16", "fp32"])
@pytest.mark.parametrize("qk_rule", QK_RULES)
def test_qk_norm_then_rope_rule(qk_rule, cos_sin, rounding):
    """q_norm under every rule, including fused_into_rope (fp32 norm output, RoPE rounds once or per op)."""
    g = gen(14)
    head_dim = 128
    q = norm_input((2, 9, 5, head_dim), g)
    w = randn_bf16(head_dim, g)
    pos = torch.randint(0, 40000, (2, 9), generator=g)
    cos, sin = ref.cos_sin_in(*ref.cos_sin(pos, head_dim), cos_sin)
    cos, sin = cos[:, None], sin[:, None]
    normed = ops.rms_norm(q, w, EPS, qk_rule)
    assert normed.dtype == (FP32 if qk_rule == "fused_into_rope" else BF16)
    got = ops.rope(normed.transpose(1, 2), cos, sin, rounding)
    want = ref.qk_norm_then_rope(q, w, EPS, qk_rule, cos, sin, rounding)
    assert_bitwise_equal(got, want, f"q_norm {qk_rule} + rope {cos_sin}/{rounding}")
    if qk_rule == "fused_into_rope":  # skipping the norm's rounding changes the result
        rounded = ref.qk_norm_then_rope(q, w, EPS, "round_after_weight", cos, sin, rounding)
        assert_not_bitwise_equal(got, rounded, "fused_into_rope vs round_after_weight")


@pytest.mark.parametrize("rule", SWIGLU_RULES)
def test_swiglu_rule(rule):
    g = gen(15)
    gate, up = swiglu_inputs((5, 123, 123), g)
    got = check_swiglu(gate, up, rule)
    assert got.dtype == BF16
    assert_not_bitwise_equal(got, ref.SWIGLU[OTHER_SWIGLU[rule]](gate, up), f"swiglu {rule} vs other")


# ------------------------------------------------------------------------------------------------------ exact ties


def exact_nu_rows(n_rows, d, g):
    """Rows whose mean square is exact and, with the returned eps, makes mean(x^2) + eps a power of 4, so nu is a
    power of two and x*nu is exact: the only roundings left are the ones the rules put there.

    Every row is a signed permutation of one base row with short significands (squares and their sum exact)."""
    base = tie_prone_bf16((d,), g, exp_range=(0, 2)).abs()
    base = bf16_from_bits(bits(base).to(torch.int32) & ~0x1F)  # keep 2 significand bits: squares are short
    ms = float(base.float().pow(2).mean())
    p = 4.0 ** (int(torch.tensor(ms).log2().item() // 2) + 1)
    eps = p - ms
    rows = []
    for _ in range(n_rows):
        perm = base[torch.randperm(d, generator=g)]
        sign = torch.where(torch.rand(d, generator=g) < 0.5, -1.0, 1.0).to(BF16)
        rows.append(perm * sign)
    x = torch.stack(rows)
    nu = ref.nu(x.float(), eps)
    assert torch.equal(nu, torch.full_like(nu, p**-0.5)), "test construction: nu should be an exact power of two"
    return x, eps


@pytest.mark.parametrize("rule", RMS_RULES)
def test_rms_norm_ties(rule):
    g = gen(20)
    d = 128
    x, eps = exact_nu_rows(33, d, g)
    w = tie_prone_bf16((d,), g)
    x32 = x.float()
    pre = x32 * ref.nu(x32, eps) * w.float()  # exact here, so both rules round this same value once
    assert count_fp32_ties(pre) > 50, "inputs should put many outputs exactly on a bf16 tie"
    check_rms_norm(x, w, eps, rule)
    # and on generic rows with tie-prone weights, round_before_weight's second rounding sits on ties:
    x2 = randn_bf16((17, 123), g)
    w2 = tie_prone_bf16((123,), g)
    inner = ref.r(x2.float() * ref.nu(x2.float(), EPS)).float() * w2.float()
    assert count_fp32_ties(inner) > 100
    check_rms_norm(x2, w2, EPS, rule)


@pytest.mark.parametrize("residual_rule", RES_RULES)
@pytest.mark.parametrize("norm_rule", RMS_RULES)
def test_residual_ties(norm_rule, residual_rule):
    g = gen(21)
    h = tie_prone_bf16((9, 96), g, exp_range=(0, 3))
    a = tie_prone_bf16((9, 96), g, exp_range=(-12, -5))
    assert count_fp32_ties(a.float() + h.float()) > 20, "sums should land exactly on bf16 ties"
    check_add_rms_norm(a, h, tie_prone_bf16((96,), g), EPS, norm_rule, residual_rule)


@pytest.mark.parametrize("rounding", ROPE_ROUNDINGS)
def test_rope_ties(rounding):
    """Short-significand x and cos/sin (not real angles: the op takes any cos/sin) put products and sums on ties."""
    g = gen(22)
    x = tie_prone_bf16((2, 3, 8, 64), g, exp_range=(0, 2))
    cos = tie_prone_bf16((2, 1, 8, 64), g, exp_range=(-2, 0))
    sin = tie_prone_bf16((2, 1, 8, 64), g, exp_range=(-2, 0))
    half = 32
    assert count_fp32_ties(ref.rope_fp32_pre_round(x, cos, sin)) > 20
    assert count_fp32_ties(x.float()[..., :half] * cos.float()[..., :half]) > 20
    check_rope(x, cos, sin, rounding)
    check_rope(x, cos.float(), sin.float(), rounding)


@pytest.mark.parametrize("rule", SWIGLU_RULES)
def test_swiglu_ties(rule):
    """Gates >= 32 have silu(g) == g exactly in fp32, so silu(g)*u is an exact product of two short bf16 values."""
    g = gen(23)
    gate = tie_prone_bf16((31, 67), g, exp_range=(5, 6)).abs()
    up = tie_prone_bf16((31, 67), g)
    assert torch.equal(F.silu(gate.float()), gate.float())
    assert count_fp32_ties(gate.float() * up.float()) > 50
    check_swiglu(gate, up, rule)


# ------------------------------------------------------------------------------------------- special values


def test_rms_norm_special_rows_and_eps():
    """Zero rows give zeros (signed by w) because eps is inside the rsqrt; with eps = 0 they give NaN (0 * inf).
    Subnormal rows: mean(x^2) underflows to 0 and nu = rsqrt(eps). A row with inf gives NaN there, 0 elsewhere."""
    d = 123
    w = torch.linspace(-2, 2, d).to(BF16)
    x = torch.zeros(4, d, dtype=BF16)
    x[1] = bf16_from_bits(torch.full((d,), 0x0001))  # smallest subnormal
    x[2, 3] = float("inf")
    x[3] = 1e38
    for rule in RMS_RULES + ["fused_into_rope"]:
        y = check_rms_norm(x, w, EPS, rule)
        assert torch.equal(y[0], torch.zeros(d, dtype=y.dtype))
        assert torch.equal(torch.signbit(y[0]), torch.signbit(w))  # +0 * negative w = -0
        assert torch.isnan(y[2, 3]) and torch.equal(y[2, :3], torch.zeros(3, dtype=y.dtype))
        assert not torch.isnan(y[3]).any()  # x^2 = inf -> nu = 0 -> zeros, no NaN
        assert torch.isnan(check_rms_norm(x, w, 0.0, rule)[0]).all()
    # eps is added to the mean square inside the rsqrt: rows of small values depend on it
    small = randn_bf16((3, d), gen(24), 1e-3)
    for rule in RMS_RULES:
        a = check_rms_norm(small, w, 1e-6, rule)
        b = check_rms_norm(small, w, 1e-5, rule)
        assert_not_bitwise_equal(a, b, "eps 1e-6 vs 1e-5")
        outside = ref.r(small.float() / (small.float().pow(2).mean(-1, keepdim=True).sqrt() + 1e-6) * w.float())
        assert_not_bitwise_equal(a, outside, "eps inside the rsqrt vs outside")


def test_specials_every_op():
    """Every pair of special values through every op (the cross product puts each special against each other)."""
    sp = special_bf16()
    a = sp[:, None].expand(len(sp), len(sp)).contiguous()
    b = sp[None, :].expand(len(sp), len(sp)).contiguous()
    for rule in SWIGLU_RULES:
        check_swiglu(a, b, rule)
    for rr in RES_RULES:
        for nr in RMS_RULES:
            check_add_rms_norm(a, b, sp, EPS, nr, rr)
    for rule in RMS_RULES + ["fused_into_rope"]:
        check_rms_norm(a, sp, EPS, rule)
    x = torch.cat([a, b], dim=-1)  # head_dim 40: x1 = a, x2 = b
    cs = torch.cat([b, b], dim=-1)
    for rounding in ROPE_ROUNDINGS:
        check_rope(x, cs, cs.flip(0), rounding)
        check_rope(x, cs.float(), cs.flip(0).float(), rounding)
    # overflow in the fp32 sum: 3e38 + 3e38 = inf in fp32, in both residual rules
    big = torch.full((2, 8), 3e38).to(BF16)
    r_round, _ = ops.residual_add(big, big, "normalize_rounded_sum")
    r_fp32, s = ops.residual_add(big, big, "normalize_fp32_sum")
    assert torch.isinf(r_round).all() and torch.isinf(r_fp32).all() and torch.isinf(s).all()


# ----------------------------------------------------------------------------------------------- the SiLU formula


def test_silu_formula_choice():
    """sigma(g) is HF's F.silu in fp32. The literal g*sigmoid(g) differs from it by one fp32 ulp for some bf16 gates;
    this pins (1) that the difference never changes r(sigma(g)), so round_silu does not depend on the choice, and
    (2) that it can change r(sigma(g)*u), and the op's "once" rule follows F.silu there."""
    g = all_bf16()
    g = g[torch.isfinite(g)]
    g32 = g.float()
    a, b = F.silu(g32), g32 * torch.sigmoid(g32)
    differ = a != b
    assert 0 < int(differ.sum()) < 2000 and int(ulp_diff(a[differ], b[differ]).max()) == 1
    assert_bitwise_equal(ref.r(a), ref.r(b), "r(F.silu) vs r(g*sigmoid(g)) over all bf16 gates")
    assert_bitwise_equal(F.silu(g), ref.r(a), "HF's bf16 F.silu vs r(fp32 F.silu) over all bf16 gates")

    # find (g, u) pairs where the one-ulp difference moves r(sigma(g) * u)
    u = all_bf16()
    u = u[torch.isfinite(u)][::16].float()
    gs, us = [], []
    for i in differ.nonzero().flatten().tolist():
        flip = ref.r(a[i] * u) != ref.r(b[i] * u)
        if flip.any():
            j = int(flip.nonzero()[0])
            gs.append(g[i])
            us.append(u[j].to(BF16))
    assert len(gs) > 5
    gate, up = torch.stack(gs), torch.stack(us)
    got = check_swiglu(gate, up, "once")  # equal to F.silu-based reference...
    literal = ref.r(gate.float() * torch.sigmoid(gate.float()) * up.float())
    assert_not_bitwise_equal(got, literal, "op once vs literal g*sigmoid(g)")  # ...and not to the literal formula


# -------------------------------------------------------------------------------------------------- hypothesis


MODES = ["normal", "wide", "bits", "ties"]


def make(shape, mode, g):
    if mode == "normal":
        return sprinkle(randn_bf16(shape, g), g, 0.02)
    if mode == "wide":
        return (torch.randn(shape, generator=g) * 10.0 ** torch.randint(-38, 38, shape, generator=g)).to(BF16)
    if mode == "bits":  # any 16-bit pattern: NaNs, infs, subnormals, huge values
        return bf16_from_bits(torch.randint(0, 0x10000, shape, generator=g))
    return tie_prone_bf16(shape, g)


_hyp = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
shapes = st.lists(st.integers(1, 9), min_size=0, max_size=2).map(tuple)


@_hyp
@given(
    lead=shapes,
    d=st.integers(1, 200),
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 2**31),
    eps=st.sampled_from([1e-6, 1e-5, 0.0, 1e-12]),
)
def test_hypothesis_rms_norm(lead, d, mode, seed, eps):
    g = gen(seed)
    x, w = make((*lead, d), mode, g), make((d,), mode, g)
    for rule in RMS_RULES + ["fused_into_rope"]:
        check_rms_norm(x, w, eps, rule)


@_hyp
@given(lead=shapes, d=st.integers(1, 200), mode=st.sampled_from(MODES), seed=st.integers(0, 2**31))
def test_hypothesis_add_rms_norm(lead, d, mode, seed):
    g = gen(seed)
    a, h, w = make((*lead, d), mode, g), make((*lead, d), mode, g), make((d,), mode, g)
    for rr in RES_RULES:
        for nr in RMS_RULES:
            check_add_rms_norm(a, h, w, EPS, nr, rr)


@_hyp
@given(
    b=st.integers(1, 3),
    h=st.integers(1, 4),
    t=st.integers(1, 9),
    half=st.integers(1, 80),
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 2**31),
    real_angles=st.booleans(),
)
def test_hypothesis_rope(b, h, t, half, mode, seed, real_angles):
    g = gen(seed)
    d = 2 * half
    x = make((b, h, t, d), mode, g)
    if real_angles:
        c32, s32 = ref.cos_sin(torch.randint(0, 2**17, (b, t), generator=g), d)
        c32, s32 = c32[:, None], s32[:, None]
    else:
        c32, s32 = make((b, 1, t, d), mode, g).float(), make((b, 1, t, d), mode, g).float()
    for cs in ("bf16", "fp32"):
        cos, sin = ref.cos_sin_in(c32, s32, cs)
        for rounding in ROPE_ROUNDINGS:
            check_rope(x, cos, sin, rounding)
    w = make((d,), mode, g)
    for rounding in ROPE_ROUNDINGS:  # fp32 x from a fused q norm
        xn = ops.rms_norm(x, w, EPS, "fused_into_rope")
        assert_bitwise_equal(
            ops.rope(xn, c32, s32, rounding),
            ref.rope(ref.rms_norm_fp32(x, w, EPS), c32, s32, rounding),
            "fused q norm -> rope",
        )


@_hyp
@given(
    shape=st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple),
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 2**31),
)
def test_hypothesis_swiglu(shape, mode, seed):
    g = gen(seed)
    gate, up = make(shape, mode, g), make(shape, mode, g)
    for rule in SWIGLU_RULES:
        check_swiglu(gate, up, rule)


# ------------------------------------------------------------------------------------------- dtypes and errors


def test_out_dtype():
    g = gen(30)
    x, w = randn_bf16((4, 96), g), randn_bf16(96, g)
    # default: r() rounds to the weight's dtype; fused_into_rope stays fp32
    assert ops.rms_norm(x, w, EPS, "round_after_weight").dtype == BF16
    assert ops.rms_norm(x, w, EPS, "fused_into_rope").dtype == FP32
    # explicit fp32: no rounding at all for round_after_weight
    assert_bitwise_equal(
        ops.rms_norm(x, w, EPS, "round_after_weight", out_dtype=FP32), ref.rms_norm_fp32(x, w, EPS), "out_dtype=fp32"
    )
    # fp16 model: r() rounds to fp16
    x16, w16 = x.to(torch.float16), w.to(torch.float16)
    for rule in RMS_RULES:
        got = ops.rms_norm(x16, w16, EPS, rule)
        assert_bitwise_equal(got, ref.RMS_NORM[rule](x16, w16, EPS, torch.float16), f"fp16 {rule}")
    # fp32 weight (e.g. fp32 master weights): HF's w32 * r(x*nu) stays fp32 (fact sheet s3); the fused rule rounds
    w32 = w.float()
    assert_bitwise_equal(
        ops.rms_norm(x, w32, EPS, "round_before_weight"),
        w32 * ref.r(x.float() * ref.nu(x.float(), EPS)).float(),
        "fp32 weight, before",
    )
    assert_bitwise_equal(
        ops.rms_norm(x, w32, EPS, "round_after_weight"),
        ref.rms_norm_round_after_weight(x, w32, EPS),
        "fp32 weight, after",
    )
    # fp32 input (the fp32 sum S) is rounded to bf16
    s = x.float() * 1.001
    assert_bitwise_equal(
        ops.rms_norm(s, w, EPS, "round_before_weight"), ref.rms_norm_round_before_weight(s, w, EPS), "fp32 x"
    )
    # residual: R in h's dtype, S fp32
    r_, s_ = ops.residual_add(x, x, "normalize_fp32_sum")
    assert (r_.dtype, s_.dtype) == (BF16, FP32)
    r_, s_ = ops.residual_add(x, x, "normalize_rounded_sum")
    assert (r_.dtype, s_.dtype) == (BF16, BF16) and s_ is r_
    # rope: bf16 x -> bf16; fp32 x -> bf16 by default, fp32 when asked (then "once" does not round at all)
    q, c32, s32 = rope_inputs(64, g)
    assert ops.rope(q, c32, s32, "once").dtype == BF16
    xn = ops.rms_norm(q, randn_bf16(64, g), EPS, "fused_into_rope")
    assert ops.rope(xn, c32, s32, "once").dtype == BF16
    want = ref.rope_fp32_pre_round(xn, c32, s32)
    assert_bitwise_equal(ops.rope(xn, c32, s32, "once", out_dtype=FP32), want, "rope out_dtype=fp32")
    for rounding in ROPE_ROUNDINGS:  # out_dtype picks what an fp32 x rounds to
        assert_bitwise_equal(
            ops.rope(xn, c32, s32, rounding, out_dtype=torch.float16),
            ref.rope(xn, c32, s32, rounding, torch.float16),
            f"rope {rounding} out_dtype=fp16",
        )
    # swiglu: gate's dtype
    gate, up = randn_bf16((3, 8), g), randn_bf16((3, 8), g)
    assert ops.swiglu(gate, up, "once").dtype == BF16
    assert ops.swiglu(gate.half(), up.half(), "once").dtype == torch.float16


def test_float64_turns_rounding_off():
    """float64 inputs keep float64 everywhere: every rule of a region computes the same unrounded value."""
    g = gen(31)
    x, w = torch.randn(3, 40, generator=g, dtype=torch.float64), torch.randn(40, generator=g, dtype=torch.float64)
    outs = [ops.rms_norm(x, w, EPS, rule) for rule in RMS_RULES + ["fused_into_rope"]]
    assert all(o.dtype == torch.float64 for o in outs)
    for o in outs[1:]:
        assert_bitwise_equal(o, outs[0], "rms_norm f64 rules")
    cos = torch.randn(3, 40, generator=g, dtype=torch.float64)
    sin = torch.randn(3, 40, generator=g, dtype=torch.float64)
    assert_bitwise_equal(ops.rope(x, cos, sin, "per_op"), ops.rope(x, cos, sin, "once"), "rope f64")
    assert_bitwise_equal(ops.rope(x, cos, sin, "truncate"), ops.rope(x, cos, sin, "once"), "rope f64 truncate")
    assert_bitwise_equal(ops.swiglu(x, x, "round_silu"), ops.swiglu(x, x, "once"), "swiglu f64")
    assert ops.swiglu(x, x, "once").dtype == torch.float64


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda x: ops.rms_norm(x, x[0], EPS, "round_sometimes"),
            r"'round_sometimes'.*round_before_weight.*"
            r"round_after_weight.*fused_into_rope",
        ),
        (
            lambda x: ops.add_rms_norm(x, x, x[0], EPS, "round_after_weight", "normalize_nothing"),
            r"'normalize_nothing'.*'normalize_rounded_sum'.*'normalize_fp32_sum'",
        ),
        (lambda x: ops.residual_add(x, x, "fp64"), r"unknown residual rule 'fp64'"),
        (
            lambda x: ops.rms_norm(x.float(), x[0], EPS, "round_after_weight", rounded=x[:2]),
            r"rounded has shape \(2, 6\) but x has \(4, 6\); pass the residual R = r\(S\)",
        ),
        (lambda x: ops.rope(x, x, x, "twice"), r"unknown rope rounding rule 'twice'.*'per_op'.*'once'"),
        (lambda x: ops.rope(x[..., :5], x[..., :5], x[..., :5], "once"), r"even head_dim, got 5"),
        (lambda x: ops.swiglu(x, x, "gelu"), r"unknown swiglu rule 'gelu'.*'round_silu'.*'once'"),
        (lambda x: ops.swiglu(x, x[:, :3], "once"), r"one shape, got \(4, 6\) and \(4, 3\)"),
        (lambda x: ops.swiglu(x, x[:1], "once"), r"one shape, got \(4, 6\) and \(1, 6\)"),
    ],
)
def test_errors(call, match):
    x = torch.ones(4, 6, dtype=BF16)
    with pytest.raises(ValueError, match=match):
        call(x)


# ------------------------------------------------------------------------------------------------ torch.compile


COMPILE_COMBOS = {
    "hf_rules": dict(
        norm="round_before_weight",
        qk=("round_before_weight", "fused_into_rope"),
        residual="normalize_rounded_sum",
        rope="per_op",
        swiglu="round_silu",
    ),
    "once_rules": dict(
        norm="round_after_weight",
        qk=("round_after_weight", "fused_into_rope"),
        residual="normalize_fp32_sum",
        rope="once",
        swiglu="once",
    ),
}


def _regions(c, x, w, a, h, q, qw, cos16, sin16, cos32, sin32, gate, up):
    outs = [ops.rms_norm(x, w, EPS, c["norm"]), *ops.add_rms_norm(a, h, w, EPS, c["norm"], c["residual"])]
    for qk in c["qk"]:
        qn = ops.rms_norm(q, qw, EPS, qk).transpose(1, 2)
        outs += [ops.rope(qn, cos16, sin16, c["rope"]), ops.rope(qn, cos32, sin32, c["rope"])]
    outs.append(ops.swiglu(gate, up, c["swiglu"]))
    return tuple(outs)


@pytest.mark.slow
@pytest.mark.parametrize("combo", list(COMPILE_COMBOS))
def test_compiled_equals_eager(combo):
    """Under torch.compile (default Inductor, fullgraph) every rule gives eager's bits, forward and backward: the ops
    are opaque custom ops, so Inductor cannot drop their casts."""
    torch._dynamo.reset()
    c = COMPILE_COMBOS[combo]
    g = gen(40)
    x, w = norm_input((3, 7, 96), g), randn_bf16(96, g)
    a, h = norm_input((3, 7, 96), g), norm_input((3, 7, 96), g, 4.0)
    q, qw = norm_input((2, 11, 3, 64), g), randn_bf16(64, g)
    pos = torch.randint(0, 40000, (2, 11), generator=g)
    c32, s32 = ref.cos_sin(pos, 64)
    c32, s32 = c32[:, None], s32[:, None]
    gate, up = swiglu_inputs((3, 7, 96), g)
    leaves = [x, w, a, h, q, qw, gate, up]
    inputs = lambda ls: (*ls[:6], c32.to(BF16), s32.to(BF16), c32, s32, *ls[6:])  # noqa: E731

    def run(fn):
        ls = [t.detach().clone().requires_grad_() for t in leaves]
        outs = fn(c, *inputs(ls))
        grads_out = [randn_bf16(o.shape, gen(41 + i)).to(o.dtype) for i, o in enumerate(outs)]
        torch.autograd.backward(outs, grads_out)
        return outs, [t.grad for t in ls]

    eager_out, eager_grad = run(_regions)
    comp_out, comp_grad = run(torch.compile(_regions, fullgraph=True))
    for i, (o1, o2) in enumerate(zip(comp_out, eager_out, strict=True)):
        assert_bitwise_equal(o1, o2, f"{combo} output {i} compiled vs eager")
    for i, (g1, g2) in enumerate(zip(comp_grad, eager_grad, strict=True)):
        assert_bitwise_equal(g1, g2, f"{combo} grad {i} compiled vs eager")


@pytest.mark.slow
def test_compiling_the_plain_formula_loses_the_rounding():
    """The reason the ops are opaque, and proof the comparison above can fail: Inductor compiles the plain formula
    r(w * r(x*nu)) into a kernel that drops the inner cast, so compiled != eager on the same inputs."""
    torch._dynamo.reset()
    g = gen(42)
    x, w = randn_bf16((64, 256), g), randn_bf16(256, g)
    fn = lambda x, w: ref.rms_norm_round_before_weight(x, w, EPS)  # noqa: E731
    assert_not_bitwise_equal(torch.compile(fn)(x, w), fn(x, w), "compiled plain formula vs eager")
    op = lambda x, w: ops.rms_norm(x, w, EPS, "round_before_weight")  # noqa: E731
    assert_bitwise_equal(torch.compile(op)(x, w), fn(x, w), "compiled op vs eager formula")
