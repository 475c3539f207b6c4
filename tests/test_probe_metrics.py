"""Probe mismatch metrics and bf16 ulp agreement: .venv/bin/python -m pytest -q tests/test_probe_metrics.py

Expected values are worked out by hand or with Python's math/statistics on plain floats, written from the
definitions in docs/probe-report.md, never by calling the code under test. Float64 results that go through
different summation orders are compared with rel=1e-12 (a few float64 ulps); exactness claims (identical inputs
give exactly 0 and 1, bitwise fractions, ulp distances) are compared exactly.
"""

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from roundalign.numerics.bf16 import bf16_ulp_distance, bf16_ulps_of_larger
from roundalign.numerics.metrics import (
    METRIC_KEYS,
    SAFETY_BOUND,
    layer_agreement,
    log_ratios,
    mismatch_metrics,
)

REL = 1e-12


def approx(x, rel=REL):
    return pytest.approx(x, rel=rel, abs=0)  # relative only: pytest's default abs=1e-12 would hide tiny values


def _t(*values):
    return torch.tensor(values, dtype=torch.float32)


# -----------------------------------------------------------------------------
# hand-computed


def test_hand_computed_two_sequences_of_different_lengths():
    # Sequence 0 has two tokens, sequence 1 one: token means and sequence means differ, as in verl.
    train = [_t(-1.0, -2.0), _t(-0.5)]
    rollout = [_t(-1.5, -2.0), _t(-0.25)]
    t, r = [-1.0, -2.0, -0.5], [-1.5, -2.0, -0.25]
    rho = [a - b for a, b in zip(t, r, strict=True)]  # [0.5, 0.0, -0.25]
    seq_rho = [rho[0] + rho[1], rho[2]]  # [0.5, -0.25]
    mean_t, mean_r = [-1.5, -0.5], [-1.75, -0.25]
    lpd = [b - a for a, b in zip(mean_t, mean_r, strict=True)]  # [-0.25, 0.25]
    pt, pr = [math.exp(x) for x in t], [math.exp(x) for x in r]
    pdiff = [abs(a - b) for a, b in zip(pt, pr, strict=True)]
    ratio = [math.exp(x) for x in rho]
    expected = {
        "rollout_corr/kl": (-0.5 + 0.0 + 0.25) / 3,
        "rollout_corr/k3_kl": sum(math.exp(x) - x - 1 for x in rho) / 3,
        "rollout_corr/chi2_token": sum(math.exp(x) ** 2 for x in rho) / 3 - 1,
        "rollout_corr/chi2_seq": sum(math.exp(2 * x) for x in seq_rho) / 2 - 1,
        "rollout_corr/training_ppl": sum(math.exp(-x) for x in mean_t) / 2,
        "rollout_corr/rollout_ppl": sum(math.exp(-x) for x in mean_r) / 2,
        "rollout_corr/training_log_ppl": -sum(mean_t) / 2,  # = 1.0
        "rollout_corr/rollout_log_ppl": -sum(mean_r) / 2,  # = 1.0
        "rollout_corr/log_ppl_diff": sum(lpd) / 2,  # = 0, while the token-mean kl is not: different weighting
        "rollout_corr/log_ppl_abs_diff": sum(abs(x) for x in lpd) / 2,
        "rollout_corr/log_ppl_diff_max": max(lpd),
        "rollout_corr/log_ppl_diff_min": min(lpd),
        "rollout_corr/ppl_ratio": sum(math.exp(x) for x in lpd) / 2,
        "training/rollout_probs_diff_mean": sum(pdiff) / 3,
        "training/rollout_probs_diff_max": max(pdiff),
        "training/rollout_probs_diff_std": statistics.stdev(pdiff),  # Bessel-corrected, as torch.std in verl
        "training/rollout_actor_probs_pearson_corr": statistics.correlation(pt, pr),
        "sampling/sampling_logp_difference/mean": 0.25,
        "sampling/sampling_logp_difference/max": 0.5,
        "mismatch/is_token_raw_min": math.exp(-0.25),
        "mismatch/is_token_raw_mean": sum(ratio) / 3,
        "mismatch/is_token_raw_max": math.exp(0.5),
        "mismatch/is_token_raw_frac_outside": 0.0,
        "mismatch/is_seq_raw_min": math.exp(min(seq_rho)),
        "mismatch/is_seq_raw_mean": sum(math.exp(x) for x in seq_rho) / 2,
        "mismatch/is_seq_raw_max": math.exp(max(seq_rho)),
        "mismatch/is_seq_raw_frac_outside": 0.0,
        "mismatch/log_ratio_rms": math.sqrt((0.25 + 0.0 + 0.0625) / 3),
        "mismatch/log_ratio_mean": 0.25 / 3,
        "mismatch/log_ratio_max_abs": 0.5,
        "mismatch/bitwise_equal_frac": 1 / 3,
        "mismatch/error_corr_rho": None,
        "mismatch/error_rms_train": None,
        "mismatch/error_rms_rollout": None,
        "mismatch/tokens": 3,
        "mismatch/sequences": 2,
    }
    assert list(expected) == list(METRIC_KEYS)
    got = mismatch_metrics(train, rollout)
    assert list(got) == list(METRIC_KEYS)
    for key, want in expected.items():
        if want is None or isinstance(want, int):
            assert got[key] == want, key
        else:
            assert got[key] == approx(want), key
    assert got["rollout_corr/kl"] != got["rollout_corr/log_ppl_diff"]


def test_safety_bound_applies_to_chi2_and_sequence_ratio_only():
    # rho = 30 nats: verl clamps to 20 before exponentiating in chi2; k3 and the token ratio are raw.
    got = mismatch_metrics([_t(-1.0)], [_t(-31.0)])
    assert SAFETY_BOUND == 20.0
    assert got["rollout_corr/chi2_token"] == approx(math.exp(40.0) - 1)
    assert got["rollout_corr/chi2_seq"] == approx(math.exp(40.0) - 1)
    assert got["rollout_corr/k3_kl"] == approx(math.exp(30.0) - 31.0)
    assert got["mismatch/is_token_raw_max"] == approx(math.exp(30.0))
    assert got["mismatch/is_seq_raw_max"] == approx(math.exp(20.0))
    assert got["mismatch/is_token_raw_frac_outside"] == 1.0
    assert got["mismatch/is_seq_raw_frac_outside"] == 1.0
    assert got["training/rollout_probs_diff_std"] is None  # one token: Bessel's std is undefined


def test_k3_and_chi2_keep_their_value_for_tiny_log_ratios():
    # An aligned trainer differs by fp32 ulps. There exp(rho) - rho - 1 cancels to rounding noise (it gives
    # -1.1e-16 at rho = 1e-8); the true values are rho^2/2 (k3) and 2 rho + 2 rho^2 (chi2), from the Taylor series.
    rho = [1e-8, 7e-9]  # exact float64 differences: train 0, rollout -rho
    got = mismatch_metrics([torch.zeros(2, dtype=torch.float64)], [-torch.tensor(rho, dtype=torch.float64)])
    k3 = sum(x * x / 2 + x**3 / 6 for x in rho) / 2  # 3.7e-17; the naive formula gives 5.6e-17
    chi2 = sum(2 * x + 2 * x * x for x in rho) / 2
    assert got["rollout_corr/k3_kl"] == approx(k3, rel=1e-6)
    assert got["rollout_corr/chi2_token"] == approx(chi2, rel=1e-6)


def test_band_edges_and_sum_form_of_sequence_ratio():
    ln2 = math.log(2.0)
    # Three tokens of rho = +0.3 each: every token inside [0.5, 2], the sequence ratio exp(0.9) = 2.46 outside.
    got = mismatch_metrics([_t(-1.0, -1.0, -1.0)], [_t(-1.3, -1.3, -1.3)])
    rho = float(torch.tensor(-1.0) - torch.tensor(-1.3))  # the fp32 difference, as the sides are fp32
    assert got["mismatch/is_token_raw_frac_outside"] == 0.0
    assert got["mismatch/is_seq_raw_max"] == approx(math.exp(3 * rho))
    assert got["mismatch/is_seq_raw_frac_outside"] == 1.0
    # Tokens at rho = -ln 4, 0, +ln 4 (two outside the band) and one just inside at -ln(2)/2.
    t = torch.tensor([-2 * ln2, 0.0, 0.0, -ln2 / 2], dtype=torch.float64)
    r = torch.tensor([0.0, 0.0, -2 * ln2, 0.0], dtype=torch.float64)
    got = mismatch_metrics([t], [r])
    assert got["mismatch/is_token_raw_frac_outside"] == 0.5


def test_error_correlation_against_fp32_reference():
    g = torch.Generator().manual_seed(0)
    ref = [-torch.rand(n, generator=g, dtype=torch.float64) * 4 for n in (5, 9)]
    e = [torch.randn(n, generator=g, dtype=torch.float64) * 1e-3 for n in (5, 9)]
    f = [torch.randn(n, generator=g, dtype=torch.float64) * 1e-3 for n in (5, 9)]
    train = [a + b for a, b in zip(ref, e, strict=True)]
    rollout = [a + 0.5 * b + c for a, b, c in zip(ref, e, f, strict=True)]
    got = mismatch_metrics(train, rollout, ref)
    # Independent: statistics on the float differences the definition names.
    et = [x - y for a, b in zip(train, ref, strict=True) for x, y in zip(a.tolist(), b.tolist(), strict=True)]
    er = [x - y for a, b in zip(rollout, ref, strict=True) for x, y in zip(a.tolist(), b.tolist(), strict=True)]
    assert got["mismatch/error_corr_rho"] == approx(statistics.correlation(et, er))
    assert got["mismatch/error_rms_train"] == approx(math.sqrt(sum(x * x for x in et) / len(et)))
    assert got["mismatch/error_rms_rollout"] == approx(math.sqrt(sum(x * x for x in er) / len(er)))

    # Opposite rounding: rho = -1; one side equal to fp32: no variance, rho undefined (None, never NaN).
    mirror = [2 * a - b for a, b in zip(ref, train, strict=True)]
    assert mismatch_metrics(train, mirror, ref)["mismatch/error_corr_rho"] == approx(-1.0)
    same = mismatch_metrics(ref, rollout, ref)
    assert same["mismatch/error_corr_rho"] is None and same["mismatch/error_rms_train"] == 0.0


def test_bitwise_equal_compares_fp32_values():
    a = _t(-1.0, -2.0, -3.0, 0.0)
    b = torch.nextafter(a, torch.full_like(a, -10.0))  # every value one fp32 ulp lower
    b[3] = -0.0  # -0.0 == 0.0 as values
    assert mismatch_metrics([a], [b])["mismatch/bitwise_equal_frac"] == 0.25
    # fp32 values compared as fp32: a float64 side holding the same fp32 values counts as equal.
    assert mismatch_metrics([a], [a.double()])["mismatch/bitwise_equal_frac"] == 1.0


def test_log_ratios_pool_sequences_in_order():
    train, rollout = [_t(-1.0, -2.5), _t(-0.125)], [_t(-1.5, -2.0), _t(-0.5)]
    expected = torch.tensor([0.5, -0.5, 0.375], dtype=torch.float64)
    assert torch.equal(log_ratios(train, rollout), expected)


def test_overflow_is_none_never_nan():
    got = mismatch_metrics([_t(0.0)], [_t(-800.0)])  # exp(800) overflows float64
    assert got["rollout_corr/k3_kl"] is None and got["mismatch/is_token_raw_max"] is None
    assert got["rollout_corr/chi2_token"] == approx(math.exp(40.0) - 1)
    for key, value in got.items():
        assert value is None or math.isfinite(value), key


@pytest.mark.parametrize(
    "train, rollout, error, match",
    [
        ([], [], ValueError, "non-empty list"),
        ([_t(-1.0)], [_t(-1.0), _t(-2.0)], ValueError, "has 2 sequences"),
        ([_t(-1.0, -2.0)], [_t(-1.0)], ValueError, "sequence 0: rollout has 1 tokens"),
        ([_t()], [_t()], ValueError, r"train\[0\] is empty"),
        ([_t(-1.0, float("nan"))], [_t(-1.0, -1.0)], ValueError, r"train\[0\]\[1\] is nan"),
        ([_t(-1.0)], [_t(float("-inf"))], ValueError, "must be finite"),
        ([torch.zeros(2, 2)], [torch.zeros(2, 2)], TypeError, "1-D"),
        ([torch.tensor([1, 2])], [torch.tensor([1, 2])], TypeError, "floating-point"),
        (_t(-1.0), [_t(-1.0)], TypeError, "list of"),
    ],
)
def test_bad_input_is_an_error(train, rollout, error, match):
    with pytest.raises(error, match=match):
        mismatch_metrics(train, rollout)


def test_fp32_reference_must_match():
    with pytest.raises(ValueError, match="sequence 0: fp32 has 1 tokens"):
        mismatch_metrics([_t(-1.0, -2.0)], [_t(-1.0, -2.0)], [_t(-1.0)])


# -----------------------------------------------------------------------------
# properties

EXACTLY_ZERO_WHEN_IDENTICAL = (
    "rollout_corr/kl",
    "rollout_corr/k3_kl",
    "rollout_corr/chi2_token",
    "rollout_corr/chi2_seq",
    "rollout_corr/log_ppl_diff",
    "rollout_corr/log_ppl_abs_diff",
    "training/rollout_probs_diff_max",
    "sampling/sampling_logp_difference/max",
    "mismatch/log_ratio_rms",
    "mismatch/is_token_raw_frac_outside",
    "mismatch/is_seq_raw_frac_outside",
    "mismatch/error_rms_train",
)
EXACTLY_ONE_WHEN_IDENTICAL = (
    "rollout_corr/ppl_ratio",
    "mismatch/is_token_raw_min",
    "mismatch/is_token_raw_mean",
    "mismatch/is_token_raw_max",
    "mismatch/is_seq_raw_min",
    "mismatch/is_seq_raw_mean",
    "mismatch/is_seq_raw_max",
    "mismatch/bitwise_equal_frac",
)
logprob = st.floats(min_value=-30.0, max_value=0.0, width=32)
sequences = st.lists(st.lists(logprob, min_size=1, max_size=12), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(sequences)
def test_identical_sides_are_exactly_aligned(seqs):
    side = [torch.tensor(s, dtype=torch.float32) for s in seqs]
    got = mismatch_metrics(side, [x.clone() for x in side], side)
    for key in EXACTLY_ZERO_WHEN_IDENTICAL:
        assert got[key] == 0.0, key
    for key in EXACTLY_ONE_WHEN_IDENTICAL:
        assert got[key] == 1.0, key
    assert got["rollout_corr/training_ppl"] == got["rollout_corr/rollout_ppl"]
    assert got["mismatch/error_corr_rho"] is None  # both error vectors are all zero


@settings(max_examples=60, deadline=None)
@given(sequences, st.data())
def test_k3_is_never_negative_and_nothing_is_nan(seqs, data):
    train = [torch.tensor(s, dtype=torch.float32) for s in seqs]
    # Rollout log-probs close to the trainer's (the regime where exp(rho) - rho - 1 cancels) or far from them.
    scale = data.draw(st.sampled_from([1e-7, 1e-3, 1.0]))
    rollout = [
        (t.double() + scale * torch.tensor(data.draw(st.lists(st.floats(-1, 1), min_size=len(t), max_size=len(t)))))
        .clamp(max=0.0)
        .float()
        for t in train
    ]
    got = mismatch_metrics(train, rollout)
    assert got["rollout_corr/k3_kl"] >= 0.0
    assert got["rollout_corr/chi2_token"] >= -1.0 and got["rollout_corr/chi2_seq"] >= -1.0
    assert all(v is None or math.isfinite(v) for v in got.values())


# -----------------------------------------------------------------------------
# bf16 ulp distance: reference = rank of each value among all bf16 numbers sorted by value


def _bf16_rank_table() -> dict[int, int]:
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    values = bits.view(torch.bfloat16).float()
    keep = ~torch.isnan(values)
    distinct = sorted(set(values[keep].tolist()))  # +0.0 and -0.0 are one value here
    rank = {v: i for i, v in enumerate(distinct)}
    return {int(b): rank[v] for b, v in zip(bits[keep].tolist(), values[keep].tolist(), strict=True)}


RANK = _bf16_rank_table()
bf16_bits = st.sampled_from(sorted(RANK))


def _from_bits(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int16).view(torch.bfloat16)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(bf16_bits, bf16_bits), min_size=1, max_size=16))
def test_ulp_distance_is_rank_difference_and_symmetric(pairs):
    a, b = _from_bits([p for p, _ in pairs]), _from_bits([q for _, q in pairs])
    expected = torch.tensor([abs(RANK[p] - RANK[q]) for p, q in pairs], dtype=torch.int64)
    assert torch.equal(bf16_ulp_distance(a, b), expected)
    assert torch.equal(bf16_ulp_distance(b, a), expected)
    assert bf16_ulp_distance(a, b).dtype == torch.int64


def test_adjacent_bf16_values_are_one_ulp_apart_everywhere():
    everything = _from_bits(sorted(RANK))
    finite = everything[torch.isfinite(everything)]
    for direction in (float("inf"), float("-inf")):
        neighbour = torch.nextafter(finite, torch.full_like(finite, direction))
        assert torch.equal(bf16_ulp_distance(finite, neighbour), torch.ones(finite.shape, dtype=torch.int64))
    assert bf16_ulp_distance(_from_bits([0]), _from_bits([-(2**15)])).item() == 0  # +0 vs -0


def test_ulp_distance_rejects_nan_and_other_dtypes():
    nan = torch.tensor([float("nan")], dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="NaN"):
        bf16_ulp_distance(nan, torch.zeros(1, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="bf16"):
        bf16_ulp_distance(torch.zeros(1), torch.zeros(1))
    with pytest.raises(ValueError, match="shapes differ"):
        bf16_ulp_distance(torch.zeros(2, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16))


def test_layer_agreement_hand_computed():
    g = torch.Generator().manual_seed(3)
    h0 = torch.randn(4, 8, generator=g).to(torch.bfloat16)
    h1 = torch.randn(4, 8, generator=g).to(torch.bfloat16).abs() + 1  # positive, away from 0
    up = torch.full_like(h1, float("inf"))
    moved = h1.clone()
    moved[0, 0] = torch.nextafter(torch.nextafter(torch.nextafter(h1[0, 0], up[0, 0]), up[0, 0]), up[0, 0])
    h1[1, 1], moved[1, 1] = 0.0, -0.0  # equal values, different bits
    rows = layer_agreement([h0, moved], [h0.clone(), h1])
    assert rows[0] == {"layer": 0, "equal_frac": 1.0, "differ": 0, "max_ulp": 0, "mean_abs_diff": 0.0}
    assert rows[1]["layer"] == 1
    assert rows[1]["equal_frac"] == 30 / 32
    assert rows[1]["differ"] == 1  # +0 against -0: other bits, the same value
    assert rows[1]["max_ulp"] == 3
    assert rows[1]["mean_abs_diff"] == approx(abs(float(moved[0, 0]) - float(h1[0, 0])) / 32)


def test_ulps_of_larger_do_not_count_across_zero():
    """A sign flip near zero is its size in ulps of the value (256 for 2^-16 against -2^-16), not the ~28,000 bf16
    numbers between them that bf16_ulp_distance counts; across a binade boundary the upper binade's ulp is the
    unit."""
    x = torch.tensor([2.0**-16], dtype=torch.bfloat16)
    assert bf16_ulp_distance(x, -x).item() == 2 * (127 - 16) * 2**7
    assert bf16_ulps_of_larger(x, -x).item() == 256  # |2x| = 2 * 2^7 ulps of x's binade
    one = torch.tensor([1.0], dtype=torch.bfloat16)
    below = torch.tensor([1.0 - 2.0**-8], dtype=torch.bfloat16)  # the bf16 number just below 1
    above = torch.tensor([1.0 + 2.0**-7], dtype=torch.bfloat16)
    assert bf16_ulps_of_larger(one, above).item() == 1
    assert bf16_ulps_of_larger(below, one).item() == 0.5
    assert bf16_ulps_of_larger(one, one).item() == 0
    tiny = torch.tensor([2.0**-133, 0.0], dtype=torch.bfloat16)  # the smallest subnormal against zero: 1 ulp
    assert bf16_ulps_of_larger(tiny[:1], tiny[1:]).tolist() == [1.0]
    inf = torch.tensor([float("inf")], dtype=torch.bfloat16)
    assert bf16_ulps_of_larger(inf, one).item() == float("inf") and bf16_ulps_of_larger(inf, inf).item() == 0


def test_layer_agreement_errors():
    a = torch.zeros(2, 3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="layer 0"):
        layer_agreement([a], [torch.zeros(3, 2, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="2 layers"):
        layer_agreement([a, a], [a])
    with pytest.raises(ValueError, match="no hidden states"):
        layer_agreement([], [])
    with pytest.raises(TypeError, match="bf16"):
        layer_agreement([a.float()], [a.float()])
