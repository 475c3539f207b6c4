"""roundalign.sync.UpdateTracker: each metric against a hand computation or a derived statistical bound.

Masters are built on a known bf16 grid (values in [1, 2), where the bf16 ulp is u = 2^-7, or sign * 2^e * (1 + j/128)
with ulp 2^(e-7)), so the expected rounding of every element is known without calling the code under test. Where
noise enters (stochastic rounding), the bound is derived in a comment from Hoeffding's or Bernstein's inequality
with a stated false-failure probability; the draws are seeded, so each run is deterministic.
"""

from __future__ import annotations

import io
import math

import pytest
import torch

from roundalign.sync import KEYS, Exporter, UpdateTracker

U = 2.0**-7  # bf16 ulp in [1, 2)
DELTA = 1e-9


def bernstein_deviation(variance: float, delta: float = DELTA) -> float:
    """t with P(|S - ES| >= t) <= delta, S a sum of independent terms within 1 of their means (Bernstein)."""
    log_term = math.log(2.0 / delta)
    return log_term / 3.0 + math.sqrt(log_term**2 / 9.0 + 2.0 * log_term * variance)


def on_grid(n: int, seed: int, even: bool = False) -> torch.Tensor:
    """n bf16 values in [1, 1.5) as fp32: 1 + j u (j even when ``even``, so a tie rounds down to them)."""
    g = torch.Generator().manual_seed(seed)
    j = torch.randint(0, 32, (n,), generator=g) * (2 if even else 1)
    return 1.0 + j.float() * U


def run(mode: str, masters: list[dict[str, torch.Tensor]], **tracker_kw) -> list[dict]:
    exporter, tracker = Exporter(mode, seed=11), UpdateTracker(**tracker_kw)
    return [tracker.update(m, exporter.export(m)) for m in masters]


def test_first_call_and_keys():
    out = run("rne", [{"w": on_grid(10, 0)}])[0]
    assert tuple(out) == KEYS
    assert out["sync/visible_fraction"] is None and out["sync/update_transfer"] is None
    assert out["sync/relative_drift"] == 0.0  # on-grid master: served == master
    assert out["sync/lag_steps"] == 0.0 and out["sync/lag_saturated"] == 0.0


def test_rne_absorbs_a_quarter_ulp_update_exactly():
    # bf16 values of many magnitudes and both signs; each moves a quarter of its own ulp away from zero, which RNE
    # absorbs: nothing visible, nothing transferred, drift = ||update|| / ||master||.
    g = torch.Generator().manual_seed(1)
    n = 20000
    exponent = torch.randint(-10, 4, (n,), generator=g).double()
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    j = torch.randint(0, 128, (n,), generator=g).double()
    m0 = sign * 2.0**exponent * (1 + j / 128)  # exactly bf16
    ulp = 2.0 ** (exponent - 7)
    m1 = m0 + sign * ulp / 4  # exact in fp32 (9 significant bits)
    out = run("rne", [{"w": m0.float()}, {"w": m1.float()}])[1]
    assert out["sync/visible_fraction"] == 0.0
    assert out["sync/update_transfer"] == 0.0
    expected = math.sqrt(float((ulp / 4).square().sum())) / math.sqrt(float(m1.square().sum()))
    # float64 sums of n positive terms in another order differ by at most ~2 n 2^-53 relative.
    assert out["sync/relative_drift"] == pytest.approx(expected, rel=4 * n * 2.0**-53)


def test_stochastic_visible_fraction_matches_the_sr_probabilities():
    # m0 = a + p0 u, m1 = m0 + u/4 = a + p1 u with p1 = p0 + 1/4 < 1: both exports pick a or b = a + u, independently,
    # so element i changes with q_i = p1 (1 - p0) + p0 (1 - p1). The count is a sum of independent Bernoullis:
    # Bernstein with variance sum q (1 - q).
    n = 20000
    g = torch.Generator().manual_seed(2)
    a = on_grid(n, 3).double()
    p0 = torch.randint(0, 717, (n,), generator=g).double() / 1024  # [0, 0.7), exact in fp32 after scaling by u
    p1 = p0 + 0.25
    m0, m1 = a + p0 * U, a + p1 * U
    out = run("stochastic", [{"w": m0.float()}, {"w": m1.float()}])[1]
    q = p1 * (1 - p0) + p0 * (1 - p1)
    bound = bernstein_deviation(float((q * (1 - q)).sum()))
    assert abs(out["sync/visible_fraction"] * n - float(q.sum())) <= bound


def test_visible_fraction_counts_bits_over_all_tensors():
    master = {"a": torch.ones(30), "b": torch.ones(70)}
    served0 = {n: t.to(torch.bfloat16) for n, t in master.items()}
    served1 = {"a": served0["a"].clone(), "b": served0["b"].clone()}
    served1["b"][:10] = 1.0078125  # ten elements change (1 + 2^-7)
    served1["a"][:5] = 1.0  # same bits: not a change
    tracker = UpdateTracker()
    tracker.update(master, served0)
    out = tracker.update(master, served1)
    assert out["sync/visible_fraction"] == 10 / 100
    assert out["sync/update_transfer"] is None  # the master did not change


def test_update_transfer_and_drift_hand_example():
    m0 = torch.tensor([1.0, 2.0, -0.5, 4.0])
    m1 = torch.tensor([1.25, 2.0, -0.75, 4.5])
    s0 = m0.to(torch.bfloat16)
    s1 = torch.tensor([1.5, 2.0, -0.5, 4.0], dtype=torch.bfloat16)
    tracker = UpdateTracker()
    tracker.update({"w": m0}, {"w": s0})
    out = tracker.update({"w": m1}, {"w": s1})
    # <ds, dm> = 0.5*0.25 + 0 + 0*(-0.25) + 0*0.5 = 0.125; ||dm||^2 = 0.0625 + 0.0625 + 0.25 = 0.375
    assert out["sync/update_transfer"] == 0.125 / 0.375
    # ||s1 - m1||^2 = 0.0625 + 0 + 0.0625 + 0.25 = 0.375; ||m1||^2 = 1.5625 + 4 + 0.5625 + 20.25 = 26.375
    assert out["sync/relative_drift"] == pytest.approx(math.sqrt(0.375 / 26.375), rel=1e-15)
    assert out["sync/visible_fraction"] == 0.25


@pytest.mark.parametrize("mode", ["stochastic", "error-feedback"])
def test_update_transfer_is_one_on_average(mode):
    # n elements in [1, 1.5) step by dm = u/4 each call (exact), T + 1 calls. The per-step ratios share the
    # denominator ||dm||^2 = n u^2 / 16, and the numerators telescope: sum_t <s_t - s_{t-1}, dm> = <s_T - s_0, dm>.
    # SR: s = m + noise, zero-mean, range u, independent: the 2n noise terms of <noise_T - noise_0, dm> have range
    #   u^2/4 each, so (Hoeffding) |mean ratio - 1| <= 4 sqrt(ln(2/delta) / n) / T.
    # EF: s_t = m_t + r_{t-1} - r_t (m + r is exact here: both are multiples of 2^-23 in [1, 2)), |r| <= u/2, so
    #   s_T - s_0 = m_T - m_0 + r_{T-1} - r_T + r_0 per element, within 1.5 u: |mean ratio - 1| <= 6 / T.
    n, steps = 4096, 64
    base = on_grid(n, 4).double() + torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(5)) * 2.0**-16
    masters = [{"w": (base + t * U / 4).float()} for t in range(steps + 1)]
    outs = run(mode, masters)
    ratios = [o["sync/update_transfer"] for o in outs[1:]]
    bound = 4 * math.sqrt(math.log(2 / DELTA) / n) / steps if mode == "stochastic" else 6 / steps
    assert abs(sum(ratios) / steps - 1.0) <= bound


def test_lag_under_rne_hand_computed():
    # Every element starts on an even bf16 grid point and drifts +u/8 per call. RNE serves base + u * rne(t / 8):
    # t = 0..4 -> base (t = 4 is a tie, to even), 5..11 -> base + u, 12, 13 -> base + 2u. The closest master to
    # base + j u is m_{8j} when available, else the current one: lag = max(0, t - 8 rne(t/8)).
    base = on_grid(64, 6, even=True).double()
    masters = [{"w": (base + t * U / 8).float()} for t in range(14)]
    lags = [o["sync/lag_steps"] for o in run("rne", masters, lag_window=32)]
    assert lags == [0, 1, 2, 3, 4, 0, 0, 0, 0, 1, 2, 3, 0, 0]
    # A window of 3 keeps k <= 2: the lag saturates at 2 while the served copy is older, and says so.
    outs = run("rne", masters[:6], lag_window=3)
    assert [o["sync/lag_steps"] for o in outs] == [0, 1, 2, 2, 2, 0]
    assert [o["sync/lag_saturated"] for o in outs] == [0, 0, 1, 1, 1, 0]


def test_lag_under_stochastic_stays_zero():
    # served_t = m_t + noise (zero mean, range u); m_{t-k} = m_t - k u/8 on every element, so the squared distance
    # f(k) = sum_i (noise_i + k u/8)^2 is convex in k and f(1) > f(0) iff sum noise_i > -n u / 16. Hoeffding:
    # P(sum noise <= -n u/16) <= exp(-2 (n u/16)^2 / (n u^2)) = exp(-n/128) = e^-32 for n = 4096, per call.
    n = 4096
    base = on_grid(n, 7).double()
    masters = [{"w": (base + t * U / 8).float()} for t in range(20)]
    outs = run("stochastic", masters, lag_window=32, sample_size=n)
    assert all(o["sync/lag_steps"] == 0.0 for o in outs)


def test_constant_master_ties_go_to_the_newest():
    master = {"w": on_grid(50, 8) + U / 3}  # off the grid: served != master, but every kept master is the same
    outs = run("rne", [master] * 5, lag_window=4)
    assert [o["sync/lag_steps"] for o in outs] == [0.0] * 5
    assert [o["sync/visible_fraction"] for o in outs[1:]] == [0.0] * 4
    assert all(o["sync/update_transfer"] is None for o in outs)


def test_sample_is_independent_of_dict_order_and_clamped():
    g = torch.Generator().manual_seed(9)
    masters = [{"a": torch.randn(4000, generator=g), "b": torch.randn(60, 100, generator=g)} for _ in range(6)]
    reordered = [dict(reversed(list(m.items()))) for m in masters]
    for size in (100, 10**9):  # a sparse sample (drawn without a full randperm), and one clamped to all elements
        in_order = run("rne", masters, lag_window=4, sample_size=size)
        assert run("rne", reordered, lag_window=4, sample_size=size) == in_order


def test_tracker_state_dict_round_trip_continues_bitwise():
    g = torch.Generator().manual_seed(10)
    masters = [{"w": torch.randn(300, generator=g), "b": torch.randn(7, generator=g)} for _ in range(6)]
    exporter = Exporter("stochastic", seed=3)
    served = [exporter.export(m) for m in masters]
    tracker = UpdateTracker(lag_window=4, sample_size=50, seed=1)
    for m, s in zip(masters[:3], served[:3], strict=True):
        tracker.update(m, s)
    buffer = io.BytesIO()
    torch.save(tracker.state_dict(), buffer)
    in_memory = tracker.state_dict()  # must not alias the tracker's buffers, which the next calls overwrite
    tail = [tracker.update(m, s) for m, s in zip(masters[3:], served[3:], strict=True)]
    buffer.seek(0)
    for state in (torch.load(buffer, weights_only=True), in_memory):
        resumed = UpdateTracker(lag_window=4, sample_size=50, seed=1)
        resumed.load_state_dict(state)
        assert [resumed.update(m, s) for m, s in zip(masters[3:], served[3:], strict=True)] == tail
    with pytest.raises(ValueError, match="lag_window=4"):
        UpdateTracker(lag_window=5, sample_size=50, seed=1).load_state_dict(tracker.state_dict())


def test_tracker_bad_input_errors():
    w = torch.ones(4)
    s = w.to(torch.bfloat16)
    with pytest.raises(ValueError, match="lag_window must be a positive int"):
        UpdateTracker(lag_window=0)
    with pytest.raises(ValueError, match="sample_size must be a positive int"):
        UpdateTracker(sample_size=-1)
    tracker = UpdateTracker()
    with pytest.raises(ValueError, match="same tensor names"):
        tracker.update({"w": w}, {"v": s})
    with pytest.raises(ValueError, match=r"shape \(3,\) but master has \(4,\)"):
        tracker.update({"w": w}, {"w": s[:3]})
    with pytest.raises(TypeError, match="pass the fp32 master"):
        tracker.update({"w": s}, {"w": s})
    tracker.update({"w": w}, {"w": s})
    with pytest.raises(ValueError, match="different tensor names or shapes"):
        tracker.update({"w": torch.ones(5)}, {"w": torch.ones(5, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="served dtypes changed"):
        tracker.update({"w": w}, {"w": w.half()})
