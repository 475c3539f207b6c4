"""OSOL's advantage correction (roundalign.rl.osol) against an independent reference written from the specification.

Expected values come from tests/osol_reference.py: plain Python loops over float64, never the module's helpers.
Inputs are float32 tensors; the reference reads the float32 values they hold (``.tolist()``, exact). The module's
advantages are float32 and may sum in another order than the float64 reference, so they are compared with
``assert_close(rtol=1e-6, atol=1e-7)``; kappa and the residual share are float64 statistics of float32 values and are
compared at relative 1e-9 (exactly, where the specification says 0.0). Counts and fractions of counts are exact.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_rl_osol.py
"""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from roundalign.rl import osol
from tests import osol_reference as ref

NAN = float("nan")
HUGE = 3.0e38


# ---------------------------------------------------------------------------------------------------------- helpers


def _tensors(base, mask, focus, u):
    return (
        torch.tensor(base, dtype=torch.float32),
        torch.tensor(mask, dtype=torch.bool),
        torch.tensor(focus, dtype=torch.bool),
        torch.tensor(u, dtype=torch.float32),
    )


def _approx(expected: float):
    return pytest.approx(expected, rel=1e-9, abs=0.0)


def check(base, mask, focus, u, *, seed=None, **kw):
    """Run the module on a hand-made batch, compare every OsolResult field with the reference; return both."""
    tb, tm, tf, tu = _tensors(base, mask, focus, u)
    kwargs = dict(kw)
    perm = None
    if kw.get("residual") == "random":
        n_e = int((tm & tf[:, None]).sum())
        perm = torch.randperm(n_e, generator=torch.Generator().manual_seed(seed)).tolist()
        kwargs["generator"] = torch.Generator().manual_seed(seed)
    got = osol.corrected_advantages(tb, tm, tf, tu, **kwargs)
    ref_kw = {k: v for k, v in kw.items() if k != "clip"}
    if "clip" in kw:
        ref_kw["clip_at"] = kw["clip"]
    exp = ref.corrected_advantages(
        tb.tolist(), tm.tolist(), tf.tolist(), tu.tolist(), perm=perm, **ref_kw
    )  # float32 values as floats

    assert got.advantages.dtype == torch.float32 and got.advantages.shape == tb.shape
    assert got.q.dtype == torch.float32 and got.q.shape == tb.shape
    torch.testing.assert_close(got.q, torch.tensor(exp["q"], dtype=torch.float32), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(
        got.advantages, torch.tensor(exp["advantages"], dtype=torch.float32), rtol=1e-6, atol=1e-7
    )
    assert torch.isfinite(got.advantages).all()
    assert (got.advantages[~tm] == 0).all(), "padding must hold 0"
    assert (got.q[~(tm & tf[:, None])] == 0).all(), "q is 0 off the focus tokens"
    assert isinstance(got.kappa, float) and got.kappa == _approx(exp["kappa"])
    assert isinstance(got.candidates, int) and got.candidates == exp["candidates"]
    assert isinstance(got.focus_tokens, int) and got.focus_tokens == exp["focus_tokens"]
    assert isinstance(got.residual_share, float) and got.residual_share == _approx(exp["residual_share"])
    return got, exp


# A batch of 4 sequences of width 5: rows 0 and 2 are the focus domain, row 3 is padded from t = 3.
BASE = [
    [0.8, 0.8, 0.8, 0.8, 0.0],
    [-0.5, -0.5, -0.5, -0.5, -0.5],
    [-1.2, -1.2, -1.2, 0.0, 0.0],
    [1.5, 1.5, 1.5, 0.0, 0.0],
]
MASK = [
    [True, True, True, True, False],
    [True, True, True, True, True],
    [True, True, True, False, False],
    [True, True, True, False, False],
]
FOCUS = [True, False, True, False]


# ------------------------------------------------------------------------------------------------------ focus_domain


SEEDS = (0, 1, 2024)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize("seed", SEEDS)
def test_focus_random_matches_reference(n, seed):
    seq = ref.focus_sequence(n, seed, 500, "random")
    assert all(a != b for a, b in zip(seq, seq[1:], strict=False)), "never the same domain twice in a row"
    assert set(seq) == set(range(n)), "every domain reached"
    got = [osol.focus_domain(n, seed, k) for k in range(1, 501)]
    assert got == seq
    assert [osol.focus_domain(n, seed, k, "random") for k in (1, 2, 500)] == [seq[0], seq[1], seq[499]]
    assert all(isinstance(f, int) for f in got)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize("seed", SEEDS)
def test_focus_cycle_matches_reference(n, seed):
    seq = ref.focus_sequence(n, seed, 500, "cycle")
    o = ref.h(seed, 0) % n
    assert seq == [(o + k) % n for k in range(500)], "visits the domains in order"
    assert all(a != b for a, b in zip(seq, seq[1:], strict=False))
    assert set(seq) == set(range(n))
    assert [osol.focus_domain(n, seed, k, "cycle") for k in range(1, 501)] == seq


def test_focus_hash_is_the_specified_one():
    digest = hashlib.sha256(b"roundalign.osol/focus/7/3").digest()
    assert ref.h(7, 3) == int.from_bytes(digest[:8], "little")
    assert osol.focus_domain(5, 7, 1) == ref.h(7, 1) % 5


def test_focus_bad_arguments():
    for n in (0, 1, -3):
        with pytest.raises(ValueError):
            osol.focus_domain(n, 0, 1)
    for step in (0, -1):
        with pytest.raises(ValueError):
            osol.focus_domain(3, 0, step)
    with pytest.raises(ValueError):
        osol.focus_domain(3, 0, 1, "round-robin")


# --------------------------------------------------------------------------------------------------- rebound_profile


PROFILE_CASES = {
    "no_candidates": [0.0, 0.3, 1.0],
    "empty": [],
    "one": [0.2, -0.4, 0.0],
    "two": [-0.1, 0.5, -0.5],
    "ordered": [-0.7, -0.5, 0.1, -0.2, -0.05],
    "ties": [-0.5, -0.2, -0.2, 0.1, -0.7],
    "all_tied": [-0.25, -0.25, -0.25, -0.25],
    "ties_at_ends": [-0.9, -0.9, -0.3, -0.1, -0.1, -0.1, 0.0, 2.0],
    "all_negative": [-3.0, -1.0, -2.0, -0.5, -4.0],
    "tiny": [-1e-30, -2e-30, 1e-30],
}


@pytest.mark.parametrize("name", list(PROFILE_CASES))
@pytest.mark.parametrize("p", [(0.1, 1.0), (0.25, 0.75), (0.0, 1.0), (0.5, 0.5)])
def test_rebound_profile_matches_reference(name, p):
    u = torch.tensor(PROFILE_CASES[name], dtype=torch.float32)
    got = osol.rebound_profile(u, *p) if p != (0.1, 1.0) else osol.rebound_profile(u)
    exp = ref.rebound_profile(u.tolist(), *p)
    assert got.dtype == torch.float32 and got.shape == u.shape
    torch.testing.assert_close(got, torch.tensor(exp, dtype=torch.float32), rtol=1e-6, atol=1e-7)
    assert (got[u >= 0] == 0).all()
    assert (got >= -1).all() and (got <= 0).all()


def test_rebound_profile_by_hand():
    got = osol.rebound_profile(torch.tensor([-0.5, -0.2, -0.2, 0.1, -0.7]))
    # ranks: -0.7 -> 0, -0.5 -> 1, the two -0.2 -> (2 + 3) / 2; q = -(1 - 0.9 r / 3)
    torch.testing.assert_close(got, torch.tensor([-0.7, -0.25, -0.25, 0.0, -1.0]), rtol=1e-6, atol=1e-7)
    got = osol.rebound_profile(torch.tensor([0.0, -0.3, 4.0]))
    assert got.tolist() == [0.0, -1.0, 0.0]  # one candidate -> -p_hi, exactly
    got = osol.rebound_profile(torch.tensor([-2.0, -1.0]), 0.25, 0.75)
    assert got.tolist() == [-0.75, -0.25]


@pytest.mark.parametrize("p", [(-0.1, 1.0), (0.5, 0.4), (0.1, 1.5), (1.2, 1.3), (-0.5, -0.1)])
def test_rebound_profile_bad_bounds(p):
    with pytest.raises(ValueError):
        osol.rebound_profile(torch.tensor([-0.5, -0.1, 0.2]), *p)


@pytest.mark.parametrize("bad", [NAN, float("inf"), float("-inf")])
def test_rebound_profile_non_finite(bad):
    with pytest.raises(ValueError):
        osol.rebound_profile(torch.tensor([-0.5, bad, 0.2]))


# ---------------------------------------------------------------------------------------------- corrected_advantages


U_MIXED = [
    [-0.5, -0.2, 0.3, -0.8, 0.0],
    [0.1, -0.2, 0.3, -0.4, 0.5],
    [0.6, -0.05, -0.2, 0.0, 0.0],
    [-1.0, -2.0, 0.7, 0.0, 0.0],
]


def test_mixed_batch():
    got, exp = check(BASE, MASK, FOCUS, U_MIXED)
    assert exp["focus_tokens"] == 7 and exp["candidates"] == 5 and exp["kappa"] > 0
    # ties across rows: -0.2 at (0, 1) and (2, 2) share one rank
    assert got.q[0, 1] == got.q[2, 2]


@pytest.mark.parametrize("tau", [0.0, 0.03, 0.5])
def test_mixed_batch_tau(tau):
    got, exp = check(BASE, MASK, FOCUS, U_MIXED, tau=tau)
    if tau == 0.0:
        assert got.kappa == 0.0 and got.residual_share == 0.0


def test_dyadic_parameters():
    """p_lo, p_hi dyadic and n - 1 = 4: every q is exact in any precision."""
    u = [
        [-0.5, -0.25, 0.5, -0.75, -0.25],
        [0.0, 0.0, 0.0, 0.0, 0.0],
        [0.5, -1.0, -0.25, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0, 0.0],
    ]
    got, exp = check(BASE, MASK, FOCUS, u, p_lo=0.25, p_hi=1.0, tau=0.125)
    assert exp["candidates"] == 5
    # ranks 0, 1, 2 and the tied pair (3 + 4) / 2: q = -(1 - 0.75 r / 4)
    assert sorted(got.q[got.q != 0].tolist()) == [-1.0, -0.8125, -0.625, -0.34375, -0.34375]


def test_no_negative_drift():
    u = [[0.0, 0.2, 0.3, 1.0, 0.0], [-1.0] * 5, [0.6, 0.0, 0.2, 0.0, 0.0], [-1.0, -2.0, 0.7, 0.0, 0.0]]
    got, exp = check(BASE, MASK, FOCUS, u)
    assert got.kappa == 0.0 and got.candidates == 0 and got.residual_share == 0.0
    assert (got.q == 0).all()
    tb, tm = torch.tensor(BASE), torch.tensor(MASK)
    assert torch.equal(got.advantages, torch.where(tm, tb.clamp(-3, 3), torch.zeros(())))


def test_exactly_one_negative_token():
    u = [[0.0, 0.2, -0.3, 1.0, 0.0], [-1.0] * 5, [0.6, 0.0, 0.2, 0.0, 0.0], [-1.0, -2.0, 0.7, 0.0, 0.0]]
    got, exp = check(BASE, MASK, FOCUS, u)
    assert got.candidates == 1 and got.q[0, 2].item() == -1.0 and got.kappa > 0


def test_ties_among_negative():
    u = [[-0.2, -0.2, -0.6, -0.2, 0.0], [0.0] * 5, [-0.6, 0.1, -0.9, 0.0, 0.0], [0.0] * 5]
    got, exp = check(BASE, MASK, FOCUS, u)
    assert got.candidates == 6
    assert got.q[0, 0] == got.q[0, 1] == got.q[0, 3] and got.q[0, 2] == got.q[2, 0]


def test_all_tokens_negative():
    u = [[-0.1, -0.2, -0.3, -0.4, -9.0], [-1.0] * 5, [-0.5, -0.6, -0.7, -9.0, -9.0], [-1.0] * 5]
    got, exp = check(BASE, MASK, FOCUS, u)
    assert got.candidates == got.focus_tokens == 7
    assert got.q.min().item() == -1.0 and torch.isclose(got.q[got.q != 0].max(), torch.tensor(-0.1))


def test_focus_domain_with_one_sample():
    base = [[0.3, -0.7, 1.1, 0.2], [1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, 0.0, 0.0]]
    mask = [[True, True, True, True], [True, True, True, False], [True, True, False, False]]
    u = [[-0.4, 0.1, -0.9, -0.1], [0.0, 0.0, 0.0, 0.0], [-0.5, 0.0, 0.0, 0.0]]
    got, exp = check(base, mask, [True, False, False], u)
    assert got.focus_tokens == 4 and got.candidates == 3 and got.kappa > 0


def test_single_focus_token():
    """|E| = 1: both stds are 0 -> kappa 0."""
    base = [[0.5, 0.0], [1.0, 2.0]]
    mask = [[True, False], [True, True]]
    got, exp = check(base, mask, [True, False], [[-0.3, NAN], [0.0, 0.0]])
    assert got.kappa == 0.0 and got.focus_tokens == 1 and got.candidates == 1 and got.q[0, 0].item() == -1.0


def test_zero_variance_group():
    base = [[0.0, 0.0, 0.0, 0.0, 0.0], [-0.5] * 5, [0.0, 0.0, 0.0, 0.0, 0.0], [1.5, 1.5, 1.5, 0.0, 0.0]]
    got, exp = check(base, MASK, FOCUS, U_MIXED)
    assert got.kappa == 0.0 and got.residual_share == 0.0 and got.candidates == 5
    assert (got.advantages[0] == 0).all() and (got.advantages[2] == 0).all()


def test_constant_nonzero_base_on_focus():
    base = [[0.75] * 5, [-0.5] * 5, [0.75] * 5, [1.5] * 5]
    got, exp = check(base, MASK, FOCUS, U_MIXED)
    assert got.kappa == 0.0


def test_empty_focus():
    got, exp = check(BASE, MASK, [False, False, False, False], U_MIXED)
    assert got.focus_tokens == 0 and got.candidates == 0 and got.kappa == 0.0 and got.residual_share == 0.0
    got, exp = check(BASE, [[False] * 5, [True] * 5, [False] * 5, [True] * 5], FOCUS, U_MIXED)
    assert got.focus_tokens == 0 and got.kappa == 0.0


def test_clip():
    base = [[2.9, -2.95, 4.0, 0.1, -3.5], [3.5, -3.5, 2.0, -4.0, 0.0], [2.99, 0.5, -0.5, -2.99, 0.0]]
    mask = [[True] * 5, [True] * 5, [True] * 4 + [False]]
    u = [[-0.5, -0.2, -0.3, -0.8, -0.1], [-1.0] * 5, [-0.6, -0.05, 0.4, -0.2, 0.0]]
    got, exp = check(base, mask, [True, False, True], u, tau=5.0)
    a = got.advantages
    assert a.max().item() == 3.0 and a.min().item() == -3.0
    assert a[0, 1].item() == -3.0 and a[0, 4].item() == -3.0
    assert a[1].tolist() == [3.0, -3.0, 2.0, -3.0, 0.0]
    got, exp = check(base, mask, [True, False, True], u)  # small kappa: the focus tokens at 4.0 and -3.5 still clip
    assert 0 < got.kappa < 0.5
    assert got.advantages[0, 2].item() == 3.0 and got.advantages[0, 4].item() == -3.0
    got, exp = check(base, mask, [True, False, True], u, tau=5.0, clip=1.5)
    assert got.advantages.abs().max().item() == 1.5


def test_padding_garbage_does_not_leak():
    base = [[0.8, 0.8, 0.8, 0.8, NAN], [-0.5] * 5, [-1.2, -1.2, -1.2, HUGE, -HUGE], [1.5, 1.5, 1.5, NAN, HUGE]]
    u = [
        [-0.5, -0.2, 0.3, -0.8, NAN],
        [0.1, -0.2, 0.3, -0.4, 0.5],
        [0.6, -0.05, -0.2, -HUGE, NAN],
        [-1.0, -2.0, 0.7, float("inf"), NAN],
    ]
    got, exp = check(base, MASK, FOCUS, u)
    clean, _ = check(BASE, MASK, FOCUS, U_MIXED)
    assert torch.equal(got.advantages, clean.advantages) and got.kappa == clean.kappa
    assert torch.equal(got.q, clean.q)


def test_u_is_read_only_at_focus_tokens():
    """u on valid tokens of other domains is not read (here NaN and -inf)."""
    u = [row[:] for row in U_MIXED]
    u[1] = [NAN, float("-inf"), -HUGE, NAN, 0.0]
    u[3] = [NAN, NAN, NAN, NAN, NAN]
    got, exp = check(BASE, MASK, FOCUS, u)
    clean, _ = check(BASE, MASK, FOCUS, U_MIXED)
    assert torch.equal(got.advantages, clean.advantages)


def test_residual_none():
    got, exp = check(BASE, MASK, FOCUS, U_MIXED, residual="none")
    assert got.kappa == 0.0 and got.residual_share == 0.0 and (got.q == 0).all()
    tb, tm = torch.tensor(BASE), torch.tensor(MASK)
    assert torch.equal(got.advantages, torch.where(tm, tb.clamp(-3, 3), torch.zeros(())))


@pytest.mark.parametrize("seed", [0, 1, 1234])
def test_residual_random(seed):
    got, exp = check(BASE, MASK, FOCUS, U_MIXED, residual="random", seed=seed)
    drift, _ = check(BASE, MASK, FOCUS, U_MIXED)
    e = torch.tensor(MASK) & torch.tensor(FOCUS)[:, None]
    assert sorted(got.q[e].tolist()) == sorted(drift.q[e].tolist()), "same multiset of q values"
    assert got.kappa == pytest.approx(drift.kappa, rel=1e-12)
    assert got.candidates == drift.candidates and got.focus_tokens == drift.focus_tokens


def test_residual_random_without_generator():
    tb, tm, tf, tu = _tensors(BASE, MASK, FOCUS, U_MIXED)
    got = osol.corrected_advantages(tb, tm, tf, tu, residual="random")
    drift = osol.corrected_advantages(tb, tm, tf, tu)
    e = tm & tf[:, None]
    assert sorted(got.q[e].tolist()) == sorted(drift.q[e].tolist())
    assert got.kappa == pytest.approx(drift.kappa, rel=1e-12)


@pytest.mark.parametrize(
    "u",
    [U_MIXED, [[-0.1, -0.2, -0.3, -0.4, 0.0], [0.0] * 5, [-0.5, -0.6, -0.7, 0.0, 0.0], [0.0] * 5]],
    ids=["mixed", "all_negative"],
)
@pytest.mark.parametrize("tau", [0.03, 1.0, 10.0])
def test_penalty_only(u, tau):
    base = [[2.9, -0.3, 0.8, -2.9, 0.0], [1.0] * 5, [4.0, -4.0, 0.2, 0.0, 0.0], [1.5, 1.5, 1.5, 0.0, 0.0]]
    got, exp = check(base, MASK, FOCUS, u, tau=tau)
    e = torch.tensor(MASK) & torch.tensor(FOCUS)[:, None]
    clipped = torch.tensor(base).clamp(-3, 3)
    assert (got.advantages[e] <= clipped[e]).all(), "never raised"
    assert (got.q <= 0).all() and got.kappa >= 0


def test_bad_inputs():
    tb, tm, tf, tu = _tensors(BASE, MASK, FOCUS, U_MIXED)
    bad = [
        (tb[:, :4], tm, tf, tu),  # base and mask widths differ
        (tb, tm[:3], tf, tu),  # rows differ
        (tb, tm, tf[:3], tu),  # focus length != B
        (tb, tm, tf, tu[:, :4]),  # u shape
        (tb, tm, tf[:, None], tu),  # focus 2-D
        (tb[0], tm[0], tf, tu[0]),  # 1-D base
    ]
    for args in bad:
        with pytest.raises((ValueError, TypeError)):
            osol.corrected_advantages(*args)
    for mask in (tm.float(), tm.long()):
        with pytest.raises((ValueError, TypeError)):
            osol.corrected_advantages(tb, mask, tf, tu)
    with pytest.raises(ValueError):
        osol.corrected_advantages(tb, tm, tf, tu, residual="shuffle")
    with pytest.raises(ValueError):
        osol.corrected_advantages(tb, tm, tf, tu, tau=-0.01)
    for c in (0.0, -1.0):
        with pytest.raises(ValueError):
            osol.corrected_advantages(tb, tm, tf, tu, clip=c)


# --------------------------------------------------------------------------------------------------- base_advantages


def test_base_advantages():
    grpo = [0.5, -1.25, 2.0, 0.3, -0.7]
    domains = [0, 2, 0, 1, 2]
    for focus, wf, wo in [(0, 1.0, 0.5), (2, 2.0, 0.0), (1, 0.3, 1.7), (3, 1.0, 0.25)]:
        g = torch.tensor(grpo, dtype=torch.float32)
        got = osol.base_advantages(g, domains, focus, wf, wo)
        exp = ref.base_advantages(g.tolist(), domains, focus, wf, wo)
        assert got.dtype == torch.float32 and got.shape == (5,)
        torch.testing.assert_close(got, torch.tensor(exp, dtype=torch.float32), rtol=1e-6, atol=1e-7)


def test_base_advantages_bad():
    g = torch.tensor([0.5, -1.0, 2.0])
    with pytest.raises(ValueError):
        osol.base_advantages(g, [0, 1, 0], 0, -1.0, 1.0)
    with pytest.raises(ValueError):
        osol.base_advantages(g, [0, 1, 0], 0, 1.0, -0.5)
    with pytest.raises(ValueError):
        osol.base_advantages(g, [0, 1], 0, 1.0, 1.0)
    with pytest.raises(ValueError):
        osol.base_advantages(g, [0, 1, 0, 1], 0, 1.0, 1.0)


# ---------------------------------------------------------------------------------------------- footprint_vs_mismatch


def _fvm(u, d, **kw):
    tu, td = torch.tensor(u, dtype=torch.float32), torch.tensor(d, dtype=torch.float32)
    got = osol.footprint_vs_mismatch(tu, td, **kw)
    exp = ref.footprint_vs_mismatch(tu.tolist(), td.tolist(), **kw)
    assert got["below_mismatch"] == pytest.approx(exp["below_mismatch"], rel=1e-12, abs=0)
    assert got["rank_change"] == pytest.approx(exp["rank_change"], rel=1e-12, abs=0)
    return got, exp


@pytest.mark.parametrize("u", [[-0.5, -0.1, 0.2], [0.3, 0.0], [-1.0, -1.0, -0.2, 0.4, -3.0], []])
def test_fvm_no_mismatch(u):
    got, exp = _fvm(u, [0.0] * len(u))
    assert got["below_mismatch"] == 0.0 and got["rank_change"] == 0.0


def test_fvm_by_hand():
    got, _ = _fvm([-0.5, -0.1, 0.2], [0.0, 0.2, 0.0])  # u - d = [-0.5, -0.3, 0.2]: same candidates and ranks
    assert got["below_mismatch"] == 0.5 and got["rank_change"] == 0.0
    got, _ = _fvm([-0.5, -0.1, 0.2], [0.0, -0.2, 0.0])  # u - d = [-0.5, 0.1, 0.2]: candidate 1 flips sign
    assert got["below_mismatch"] == 0.5 and got["rank_change"] == pytest.approx(1 / 3, rel=1e-12)
    got, _ = _fvm([-0.5, -0.1, 0.2, -0.3], [-0.45, 0.0, 0.0, 0.0])  # [-0.05, -0.1, 0.2, -0.3]: ranks reverse
    assert got["below_mismatch"] == 0.0 and got["rank_change"] == 0.75
    got, _ = _fvm([-0.25, -0.5, 0.5, -1.0], [0.5, 0.0, 0.0, 0.0])  # [-0.75, -0.5, 0.5, -1.0]: 0 and 1 swap ranks
    assert got["below_mismatch"] == pytest.approx(1 / 3, rel=1e-12) and got["rank_change"] == 0.5
    got, _ = _fvm([-0.25, 0.1], [0.25, 0.0])  # |u| == |d| counts as below; u - d = [-0.5, 0.1]: still the one -> -1
    assert got["below_mismatch"] == 1.0 and got["rank_change"] == 0.0
    got, _ = _fvm([0.5, 0.25], [0.75, 0.5])  # no candidates; u - d = [-0.25, -0.25]: two new ones (tied)
    assert got["below_mismatch"] == 0.0 and got["rank_change"] == 1.0


def test_fvm_bounds():
    _fvm([-0.5, -0.1, 0.2, -0.3], [-0.45, 0.0, 0.0, 0.0], p_lo=0.25, p_hi=0.75)
    _fvm([-0.5, -0.1, 0.2, -0.3], [-0.45, 0.0, 0.0, 0.0], p_lo=0.5, p_hi=0.5)


# ------------------------------------------------------------------------------------------------------ backtracking


def test_backtracking():
    u = torch.tensor([0.5, -0.25, 0.0, 1.5, -2.0])
    got = osol.backtracking(u, -u)
    assert got["ratio"] == pytest.approx(1.0, rel=1e-12) and got["token_frac"] == 0.8  # u != 0 on 4 of 5
    nz = torch.tensor([0.5, -0.25, 1.5])
    assert osol.backtracking(nz, -nz)["token_frac"] == 1.0
    got = osol.backtracking(u, u)
    assert got["ratio"] == pytest.approx(-1.0, rel=1e-12) and got["token_frac"] == 0.0
    got = osol.backtracking(u, torch.zeros(5))
    assert got["ratio"] == 0.0 and got["token_frac"] == 0.0
    got = osol.backtracking(torch.zeros(3), torch.tensor([1.0, -1.0, 0.5]))
    assert got["ratio"] is None and got["token_frac"] == 0.0
    got = osol.backtracking(torch.zeros(0), torch.zeros(0))
    assert got["ratio"] is None and got["token_frac"] == 0.0


@pytest.mark.parametrize(
    "u,v",
    [
        ([0.5, -0.25, 0.75, 1.0], [-0.25, 0.5, -0.5, 0.125]),
        ([0.3, -0.7, 0.11, 2.2, -0.05], [0.1, 0.2, -0.3, -1.1, 0.0]),
        ([1.0, 2.0, 3.0], [-0.5, -1.0, -1.5]),
    ],
)
def test_backtracking_matches_reference(u, v):
    tu, tv = torch.tensor(u, dtype=torch.float32), torch.tensor(v, dtype=torch.float32)
    got = osol.backtracking(tu, tv)
    exp = ref.backtracking(tu.tolist(), tv.tolist())
    assert got["ratio"] == pytest.approx(exp["ratio"], rel=1e-6)
    assert got["token_frac"] == exp["token_frac"]
    assert math.isfinite(got["ratio"])
