"""IS corrections between engine and trainer log-probs: .venv/bin/python -m pytest -q tests/test_rl_correction.py

Expected values come from the formulas in roundalign/numerics/correction.py's docstring, evaluated with plain loops
and math.exp in float64, never by calling the code under test. Inputs are dyadic (-1.5, -0.25, ...) so the fp32
log-ratio old - rollout is exact; what remains is the fp32 exp, within 1 ulp of e^x (torch's CPU exp is a 1-ulp
kernel), so unclamped ratios are checked to 1 fp32 ulp against e^x rounded to fp32. Clamped weights (the bound
itself) and mask weights (0 or 1) are exact and compared with torch.equal. Metrics are float64 reductions of those
fp32 ratios: means, extremes, std and ESS of a handful of well-separated values, each within 2^-23 relative of the
float64 reference, so they are compared at relative 2^-20 (8 ulps); fractions are exact.
"""

import math
import struct

import pytest
import torch

from roundalign.numerics.correction import IS_MODES, METRIC_KEYS, SAFETY_BOUND, ISCorrection, is_weights

BIG = 3.0e38  # finite garbage for padding: old - rollout overflows to inf if padding ever enters the arithmetic
REL = 2.0**-20


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def ulps(a: float, b: float) -> int:
    """Distance in fp32 ulps between two positive fp32 values."""
    ia, ib = (struct.unpack("i", struct.pack("f", v))[0] for v in (a, b))
    return abs(ia - ib)


def batch(log_ratios: list[list[float]], width: int, pad_old: float = BIG, pad_rollout: float = -BIG):
    """(old, rollout, mask) with old - rollout = the given (exact, dyadic) log-ratios and garbage in padding."""
    b = len(log_ratios)
    old = torch.full((b, width), pad_old)
    rollout = torch.full((b, width), pad_rollout)
    mask = torch.zeros(b, width, dtype=torch.bool)
    for i, row in enumerate(log_ratios):
        for t, x in enumerate(row):
            rollout[i, t] = -2.0 - 0.25 * t
            old[i, t] = rollout[i, t] + x
            assert float(old[i, t]) - float(rollout[i, t]) == x  # the fp32 log-ratio is exact
            mask[i, t] = True
    return old, rollout, mask


ROWS = [[0.5, -0.25, 1.0, 0.0], [-1.0, 0.25]]  # two completions of 4 and 2 tokens


def seq_stats(rows):
    seq = [math.exp(max(-SAFETY_BOUND, min(SAFETY_BOUND, sum(r)))) for r in rows]
    geo = [math.exp(max(-SAFETY_BOUND, min(SAFETY_BOUND, sum(r) / len(r)))) for r in rows]
    return seq, geo


# -----------------------------------------------------------------------------
# weights, per mode


def test_none_is_one_on_tokens_zero_on_padding():
    old, rollout, mask = batch(ROWS, 5)
    w, _ = is_weights(old, rollout, mask, ISCorrection.parse("none"))
    assert torch.equal(w, mask.float())


@pytest.mark.parametrize("threshold,low,high", [(None, None, 2.0), ("0.5_2.0", 0.5, 2.0)])
def test_token_tis_is_the_clamped_ratio_per_token(threshold, low, high):
    old, rollout, mask = batch(ROWS, 5)
    w, _ = is_weights(old, rollout, mask, ISCorrection.parse("token-tis", threshold))
    for i, row in enumerate(ROWS):
        for t in range(5):
            got = float(w[i, t])
            if t >= len(row):
                assert got == 0.0
                continue
            rho = math.exp(row[t])
            if rho > high:
                assert got == high  # clamped: the bound itself, exactly
            elif low is not None and rho < low:
                assert got == low
            else:
                assert ulps(got, f32(rho)) <= 1
    # e^1 > 2 is cut to 2; e^-1 < 0.5 is raised to 0.5 only with the two-sided threshold.
    assert float(w[0, 2]) == 2.0
    if low is None:
        assert ulps(float(w[1, 0]), f32(math.exp(-1.0))) <= 1
    else:
        assert float(w[1, 0]) == 0.5


def test_seq_tis_weights_every_token_of_a_sequence_with_its_clamped_product():
    rows = [[0.5, -0.25, 0.125], [0.5, 0.5, 0.25], [-1.0]]  # products e^0.375, e^1.25 (> 2), e^-1
    old, rollout, mask = batch(rows, 4)
    w, _ = is_weights(old, rollout, mask, ISCorrection.parse("seq-tis"))
    seq, _ = seq_stats(rows)
    for i, row in enumerate(rows):
        expected = min(seq[i], 2.0)
        for t in range(4):
            got = float(w[i, t])
            if t >= len(row):
                assert got == 0.0
            elif expected == 2.0:
                assert got == 2.0
            else:
                assert ulps(got, f32(expected)) <= 1
                assert got == float(w[i, 0])  # one weight per sequence


def _mask_reference(mode, rows, low, high):
    seq, geo = seq_stats(rows)
    out = []
    for i, row in enumerate(rows):
        if mode == "token-mask":
            out.append([1.0 if low <= math.exp(x) <= high else 0.0 for x in row])
        else:
            stat = seq[i] if mode == "seq-mask" else geo[i]
            out.append([1.0 if low <= stat <= high else 0.0] * len(row))
    return out


@pytest.mark.parametrize(
    "mode,rows",
    [
        ("token-mask", [[0.5, -0.75, 1.0, 0.0], [-0.5, 0.25]]),  # e^-0.75 < 0.5 and e^1 > 2 are masked
        ("seq-mask", [[0.5, 0.25], [0.5, 0.5], [-0.5, -0.5], [0.0]]),  # e^0.75 kept, e^1 > 2 and e^-1 < 0.5 masked
        ("geo-mask", [[2**-12, -(2**-12), 2**-11], [2**-7, 0.0], [-(2**-8)], [0.0, 0.0, 0.0]]),
    ],
)
def test_masks_keep_exactly_the_tokens_or_sequences_inside_the_band(mode, rows):
    c = ISCorrection.parse(mode)
    old, rollout, mask = batch(rows, 4)
    w, _ = is_weights(old, rollout, mask, c)
    ref = _mask_reference(mode, rows, c.low, c.high)
    expected = torch.zeros(len(rows), 4)
    for i, r in enumerate(ref):
        expected[i, : len(r)] = torch.tensor(r)
    assert torch.equal(w, expected)
    assert 0.0 < expected.sum() < mask.sum()  # the example keeps some and masks some


@pytest.mark.parametrize("mode", ["token-tis", "seq-tis", "token-mask", "seq-mask", "geo-mask"])
def test_bounds_are_inclusive(mode):
    # rho = 1 exactly (log-ratio 0, or +-0.5 summing to 0); a ratio one step below 1 is outside [1, 2].
    rows = [[0.0], [0.5, -0.5], [-(2.0**-20)]]
    old, rollout, mask = batch(rows, 2)
    for threshold in ("1.0_2.0", "0.5_1.0"):
        w, _ = is_weights(old, rollout, mask, ISCorrection.parse(mode, threshold))
        assert float(w[0, 0]) == 1.0  # on the bound: kept (mask) or left as is (truncate)
        if mode != "token-mask" and mode != "token-tis":
            assert float(w[1, 0]) == float(w[1, 1]) == 1.0
    w, _ = is_weights(old, rollout, mask, ISCorrection.parse(mode, "1.0_2.0"))
    below = math.exp(-(2.0**-20))
    if mode in ("token-tis", "seq-tis"):
        assert float(w[2, 0]) == 1.0  # raised to the lower bound
    else:
        assert float(w[2, 0]) == 0.0 and f32(below) < 1.0  # just below the bound: masked


def test_bounds_are_rounded_to_fp32_before_comparing():
    # 1 + 1e-10 rounds to 1.0 in fp32, so a ratio of exactly 1 is on the bound (what torch does for verl and TRL).
    old, rollout, mask = batch([[0.0]], 1)
    w, _ = is_weights(old, rollout, mask, ISCorrection("token-mask", 1.0 + 1e-10, 2.0))
    assert float(w[0, 0]) == 1.0


def test_safety_clamp_on_tokens_and_on_the_sequence_sum():
    # Token log-ratios beyond +-20 give e^+-20; the sequence statistic sums the unclamped token log-ratios and then
    # clamps the sum (verl's order): 25 - 10 = 15 -> e^15, not e^(20 - 10).
    rows = [[25.0, -10.0], [30.0, 30.0], [-25.0]]
    old, rollout, mask = batch(rows, 2, pad_old=0.0, pad_rollout=0.0)
    w, m = is_weights(old, rollout, mask, ISCorrection.parse("token-tis", "1e10"))
    assert ulps(float(w[0, 0]), f32(math.exp(20.0))) <= 1
    assert ulps(float(w[2, 0]), f32(math.exp(-20.0))) <= 1
    assert m["rollout_corr/raw_is_seq_max"] == pytest.approx(math.exp(20.0), rel=REL, abs=0)  # 60 clamped to 20
    w, m = is_weights(old, rollout, mask, ISCorrection.parse("seq-tis", "1e10"))
    assert ulps(float(w[0, 0]), f32(math.exp(15.0))) <= 1
    assert ulps(float(w[1, 1]), f32(math.exp(20.0))) <= 1
    assert ulps(float(w[2, 0]), f32(math.exp(-20.0))) <= 1
    assert m["rollout_corr/raw_is_geo_max"] == pytest.approx(math.exp(20.0), rel=REL, abs=0)  # mean 30 -> 20
    assert all(math.isfinite(v) for v in m.values())


# -----------------------------------------------------------------------------
# metrics


def _std(xs):
    mu = sum(xs) / len(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / len(xs))


def _approx(x):
    return pytest.approx(x, rel=REL, abs=0)


@pytest.mark.parametrize("mode,threshold", [("token-tis", None), ("token-mask", "0.7_1.5"), ("seq-tis", "0.5_2.0")])
def test_metrics_against_hand_computation(mode, threshold):
    c = ISCorrection.parse(mode, threshold)
    old, rollout, mask = batch(ROWS, 5)
    _, m = is_weights(old, rollout, mask, c)
    assert list(m) == list(METRIC_KEYS)
    rho = [math.exp(x) for row in ROWS for x in row]
    seq, geo = seq_stats(ROWS)
    if mode == "token-tis":
        w = [min(r, c.high) for r in rho]
    elif mode == "token-mask":
        w = [1.0 if c.low <= r <= c.high else 0.0 for r in rho]
    else:
        w = [min(max(s, c.low), c.high) for s, row in zip(seq, ROWS, strict=True) for _ in row]
    seq_w = [min(max(s, c.low), c.high) for s in seq] if mode == "seq-tis" else w
    mean_w = sum(w) / len(w)
    ess = 1.0 / (sum((x / mean_w) ** 2 for x in w) / len(w))
    zero = [x == 0.0 for x in w]
    per_seq_zero = [any(zero[:4]), any(zero[4:])]
    expected = {
        "rollout_corr/raw_is_mean": _approx(sum(rho) / len(rho)),
        "rollout_corr/raw_is_std": _approx(_std(rho)),
        "rollout_corr/raw_is_min": _approx(min(rho)),
        "rollout_corr/raw_is_max": _approx(max(rho)),
        "rollout_corr/raw_is_seq_mean": _approx(sum(seq) / 2),
        "rollout_corr/raw_is_seq_min": _approx(min(seq)),
        "rollout_corr/raw_is_seq_max": _approx(max(seq)),
        "rollout_corr/raw_is_geo_min": _approx(min(geo)),
        "rollout_corr/raw_is_geo_max": _approx(max(geo)),
        "rollout_corr/rollout_is_ratio_fraction_high": sum(r > c.high for r in rho) / len(rho),
        "rollout_corr/rollout_is_ratio_fraction_low": 0.0 if c.low is None else sum(r < c.low for r in rho) / len(rho),
        "rollout_corr/rollout_is_mean": _approx(mean_w),
        "rollout_corr/rollout_is_std": _approx(_std(w)),
        "rollout_corr/rollout_is_min": _approx(min(w)),
        "rollout_corr/rollout_is_max": _approx(max(w)),
        "rollout_corr/rollout_is_eff_sample_size": _approx(ess),
        "rollout_corr/rollout_rs_masked_fraction": sum(zero) / len(zero),
        "rollout_corr/rollout_rs_seq_masked_fraction": sum(per_seq_zero) / 2,
        "sampling/importance_sampling_ratio/min": _approx(min(seq_w)),
        "sampling/importance_sampling_ratio/mean": _approx(sum(seq_w) / len(seq_w)),
        "sampling/importance_sampling_ratio/max": _approx(max(seq_w)),
    }
    assert m == expected
    if mode == "token-tis":
        assert m["rollout_corr/rollout_is_ratio_fraction_high"] == 1 / 6  # e^1 of six tokens
    if mode == "token-mask":
        assert m["rollout_corr/rollout_rs_masked_fraction"] == 3 / 6  # e^1, e^-1, e^0.5 are outside [0.7, 1.5]


def test_trl_names_count_sequences_in_sequence_modes():
    # Two sequences of 3 and 1 tokens: token means weight the long one 3:1, TRL's per-sequence mean 1:1.
    rows = [[0.25, 0.0, 0.0], [-0.5]]
    old, rollout, mask = batch(rows, 3)
    _, m = is_weights(old, rollout, mask, ISCorrection.parse("seq-tis"))
    a, b = math.exp(0.25), math.exp(-0.5)
    assert m["sampling/importance_sampling_ratio/mean"] == _approx((a + b) / 2)
    assert m["rollout_corr/rollout_is_mean"] == _approx((3 * a + b) / 4)


def test_partly_masked_sequence_counts_as_masked_as_in_verl():
    rows = [[0.0, 2.0], [2.0, -2.0], [0.0]]  # one token masked / both masked / none
    old, rollout, mask = batch(rows, 2)
    _, m = is_weights(old, rollout, mask, ISCorrection.parse("token-mask"))
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 3 / 5
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == 2 / 3  # verl: sequences with any masked token


def test_everything_masked_gives_zero_ess_and_full_masked_fractions():
    old, rollout, mask = batch([[0.5], [-0.5, 0.25]], 2)
    w, m = is_weights(old, rollout, mask, ISCorrection.parse("geo-mask"))
    assert torch.equal(w, torch.zeros_like(w))
    assert m["rollout_corr/rollout_is_eff_sample_size"] == 0.0
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 1.0
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == 1.0


@pytest.mark.parametrize("mode", IS_MODES)
def test_same_keys_every_mode_and_padding_never_matters(mode):
    c = ISCorrection.parse(mode)
    clean = batch(ROWS, 6, pad_old=0.0, pad_rollout=0.0)
    dirty = batch(ROWS, 6, pad_old=BIG, pad_rollout=-BIG)
    dirty[0][0, 5] = float("nan")
    old = dirty[0].clone().requires_grad_(True)
    w_clean, m_clean = is_weights(*clean, c)
    w_dirty, m_dirty = is_weights(old, dirty[1], dirty[2], c)
    assert torch.equal(w_clean, w_dirty) and m_clean == m_dirty
    assert list(m_clean) == list(METRIC_KEYS)
    assert all(isinstance(v, float) and math.isfinite(v) for v in m_clean.values())
    assert w_dirty.dtype == torch.float32 and not w_dirty.requires_grad


# -----------------------------------------------------------------------------
# thresholds


@pytest.mark.parametrize(
    "mode,low,high",
    [
        ("none", None, None),
        ("token-tis", None, 2.0),
        ("seq-tis", None, 2.0),
        ("token-mask", 0.5, 2.0),
        ("seq-mask", 0.5, 2.0),
        ("geo-mask", 0.999, 1.001),
    ],
)
def test_default_thresholds(mode, low, high):
    c = ISCorrection.parse(mode)
    assert (c.mode, c.low, c.high) == (mode, low, high)


@pytest.mark.parametrize(
    "mode,threshold,low,high",
    [
        ("token-tis", "2", None, 2.0),
        ("token-tis", 2.0, None, 2.0),
        ("token-tis", 3, None, 3.0),
        ("seq-tis", " 0.5_2.0 ", 0.5, 2.0),
        ("token-mask", "2", 0.5, 2.0),
        ("seq-mask", 4.0, 0.25, 4.0),
        ("seq-mask", "0.5_2.0", 0.5, 2.0),
        ("geo-mask", "0.99_1.001", 0.99, 1.001),
    ],
)
def test_threshold_parsing(mode, threshold, low, high):
    c = ISCorrection.parse(mode, threshold)
    assert (c.low, c.high) == (low, high)


@pytest.mark.parametrize(
    "mode,threshold,error,match",
    [
        ("token-tis", "abc", ValueError, r"'token-tis'.*cannot read threshold 'abc'.*\"L_U\""),
        ("token-tis", "", ValueError, r"cannot read threshold"),
        ("token-mask", "0.5_", ValueError, r"'token-mask'.*cannot read"),
        ("token-mask", "_2", ValueError, r"cannot read"),
        ("seq-mask", "0.5_1_2", ValueError, r"cannot read"),
        ("seq-mask", "2.0_0.5", ValueError, r"'seq-mask'.*lower bound 2.0 must be below upper bound 0.5"),
        ("seq-tis", "1_1", ValueError, r"lower bound 1.0 must be below"),
        ("token-tis", "-1", ValueError, r"finite positive"),
        ("token-tis", "0_2", ValueError, r"finite positive"),
        ("geo-mask", "nan", ValueError, r"finite positive"),
        ("geo-mask", "inf", ValueError, r"finite positive"),
        ("token-mask", "0.5", ValueError, r"lower bound 2.0 must be below upper bound 0.5"),  # L = 1/U > U
        ("token-tis", True, TypeError, r"string or a float"),
        ("token-tis", [2.0], TypeError, r"string or a float"),
        ("none", "2.0", ValueError, r"'none' takes no threshold"),
        ("none", 2.0, ValueError, r"'none' takes no threshold"),
        ("token_truncate", None, ValueError, r"unknown IS correction mode 'token_truncate'.*token-tis"),
    ],
)
def test_bad_thresholds_say_what_is_wrong(mode, threshold, error, match):
    with pytest.raises(error, match=match):
        ISCorrection.parse(mode, threshold)


def test_direct_construction_is_validated():
    with pytest.raises(ValueError, match="needs a lower bound"):
        ISCorrection("seq-mask", None, 2.0)
    with pytest.raises(ValueError, match="needs an upper bound"):
        ISCorrection("token-tis", 0.5, None)
    with pytest.raises(ValueError, match="takes no bounds"):
        ISCorrection("none", None, 2.0)


@pytest.mark.parametrize(
    "mode,threshold,text",
    [
        ("none", None, "none: w_t = 1 (no correction)"),
        ("token-tis", None, "token-tis: w_t = min(rho_t, 2.0)"),
        ("token-tis", "0.5_2", "token-tis: w_t = clamp(rho_t, 0.5, 2.0)"),
        ("seq-tis", None, "seq-tis: w = min(prod_t rho_t, 2.0) per sequence"),
        ("token-mask", None, "token-mask: w_t = 1[0.5 <= rho_t <= 2.0]"),
        ("seq-mask", None, "seq-mask: w = 1[0.5 <= prod_t rho_t <= 2.0] per sequence"),
        ("geo-mask", None, "geo-mask: w = 1[0.999 <= (prod_t rho_t)^(1/T) <= 1.001] per sequence"),
    ],
)
def test_describe(mode, threshold, text):
    assert ISCorrection.parse(mode, threshold).describe() == text


# -----------------------------------------------------------------------------
# bad input


def test_bad_inputs_are_clear_errors():
    old, rollout, mask = batch(ROWS, 4)
    c = ISCorrection.parse("token-tis")
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        is_weights(old, rollout, mask.float(), c)
    with pytest.raises(TypeError, match=r"old_logp must be float32.*old_logp.float\(\)"):
        is_weights(old.double(), rollout, mask, c)
    with pytest.raises(ValueError, match="rollout_logp has shape"):
        is_weights(old, rollout[:, :3], mask, c)
    empty = mask.clone()
    empty[1] = False
    with pytest.raises(ValueError, match=r"rows \[1\] of mask have no completion token"):
        is_weights(old, rollout, empty, c)
    bad = rollout.clone()
    bad[0, 0] = float("-inf")
    with pytest.raises(ValueError, match="rollout_logp is not finite at 1 completion tokens"):
        is_weights(old, bad, mask, c)
    with pytest.raises(TypeError, match="ISCorrection.parse"):
        is_weights(old, rollout, mask, "token-tis")
