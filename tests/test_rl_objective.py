"""GRPO / REINFORCE objective: .venv/bin/python -m pytest -q tests/test_rl_objective.py

References are plain Python loops over floats (float64, math.exp, statistics) written from the formulas in
roundalign/rl/objective.py's docstring. Error bounds, with u = 2^-24 (fp32 unit roundoff):

- group advantages: the fp32 mean of n rewards is off by at most about n u max|r|, each centred reward then by that
  plus u|d|, the std by about (n + 2) u relative, and "+ eps" and the division add u each, so
  |A - A_ref| <= 2 u (n max|r| / s + (n + 3) |A|) (the factor 2 covers second-order terms). Centred rewards whose
  mean is exact in fp32 (dyadic rewards) are compared exactly.
- losses: inputs have dyadic log-ratios, so logp - old_logp is exact; each term then carries the fp32 exp (1 ulp,
  2u), the clip bound's fp32 rounding (u) and two products (2u), and the fp32 sum of n terms adds at most n u times
  the sum of |terms|: |L - L_ref| <= (n + 5) u sum|w l| / N.
- gradients: the same chain without the sum, -A r w / N to within 8 u relative; clipped tokens and padding get
  exactly 0, and identities (one inner epoch, micro-batches) are exact, bit for bit.
"""

import math
import statistics

import pytest
import torch

from roundalign.rl.objective import LOSS_TYPES, PolicyLoss, group_advantages, policy_loss

U = 2.0**-24
BIG = 3.0e38


# -----------------------------------------------------------------------------
# group advantages


@pytest.mark.parametrize("group_size", [2, 3, 4, 8])
def test_group_advantages_match_mean_and_unbiased_std_per_group(group_size):
    g = torch.Generator().manual_seed(group_size)
    rewards = torch.rand(24, generator=g) * 3.0 - 1.0
    got = group_advantages(rewards, group_size)
    assert got.dtype == torch.float32 and got.shape == (24,)
    r = rewards.tolist()
    for start in range(0, 24, group_size):
        grp = r[start : start + group_size]
        m, s = statistics.mean(grp), statistics.stdev(grp)
        for i, x in enumerate(grp):
            ref = (x - m) / (s + 1e-6)
            bound = 2 * U * (group_size * max(abs(v) for v in grp) / s + (group_size + 3) * abs(ref))
            assert abs(float(got[start + i]) - ref) <= bound


def test_group_advantages_without_scaling_are_exactly_centred_rewards():
    rewards = [1.0, 0.0, 0.5, 0.25, 3.0, 3.0, 2.0, -1.0]  # dyadic: group means are exact in fp32
    got = group_advantages(torch.tensor(rewards), 4, scale=False)
    expected = []
    for start in (0, 4):
        grp = rewards[start : start + 4]
        expected += [x - sum(grp) / 4 for x in grp]
    assert torch.equal(got, torch.tensor(expected))


def test_tied_group_gets_zero_advantage_not_nan():
    got = group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0]), 3)
    assert torch.equal(got[:3], torch.zeros(3))
    assert torch.isfinite(got).all()


@pytest.mark.parametrize(
    "rewards,group_size,error,match",
    [
        (torch.ones(6), 4, ValueError, r"6 rewards do not split into groups of 4"),
        (torch.ones(6), 1, ValueError, r"group_size must be >= 2"),
        (torch.ones(6), 0, ValueError, r"group_size must be >= 2"),
        (torch.ones(6), True, TypeError, r"group_size must be an int"),
        (torch.ones(2, 3), 3, ValueError, r"shape \(B,\)"),
        (torch.ones(6, dtype=torch.int64), 3, TypeError, r"float32.*rewards.float\(\)"),
        (torch.tensor([1.0, float("nan")]), 2, ValueError, r"NaN or inf"),
        ([1.0, 0.0], 2, TypeError, r"torch.Tensor"),
    ],
)
def test_group_advantages_bad_input(rewards, group_size, error, match):
    with pytest.raises(error, match=match):
        group_advantages(rewards, group_size)


# -----------------------------------------------------------------------------
# policy loss: value, gradient, statistics

# Per completion: advantage and exact log-ratios logp - old_logp. With eps 0.2 (high 0.28 when set): tokens in
# every PPO-clip case (A > 0 above the band: clipped binds; A > 0 below: unclipped; A < 0 below: clipped binds;
# A < 0 above: unclipped; inside: both equal).
ADV = [1.5, -0.75, 0.5]
LOG_RATIOS = [[0.5, -0.5, 0.0625, 0.1875], [-0.5, 0.5, -0.0625], [0.125, 0.0]]
WEIGHTS = [[1.0, 0.5, 2.0, 0.25], [0.0, 1.5, 0.75], [1.0, 0.125]]
WIDTH = 5


def make_batch(pad: float = BIG, requires_grad: bool = True):
    b = len(ADV)
    logp = torch.full((b, WIDTH), pad)
    old = torch.full((b, WIDTH), -pad)
    w = torch.full((b, WIDTH), pad)
    mask = torch.zeros(b, WIDTH, dtype=torch.bool)
    for i, row in enumerate(LOG_RATIOS):
        for t, x in enumerate(row):
            old[i, t] = -1.0 - 0.5 * t
            logp[i, t] = old[i, t] + x
            w[i, t] = WEIGHTS[i][t]
            mask[i, t] = True
    return logp.requires_grad_(requires_grad), old, torch.tensor(ADV), mask, w


def reference(loss_type, eps_low=0.2, eps_high=None, weights=False, n=None):
    """(loss, per-token gradient rows, clipped count, terms' |sum|) from the formulas, in float64."""
    hi = eps_low if eps_high is None else eps_high
    n_valid = sum(len(r) for r in LOG_RATIOS)
    n = n_valid if n is None else n
    total, abs_total, clipped, grads = 0.0, 0.0, 0, []
    for i, row in enumerate(LOG_RATIOS):
        a, grow = ADV[i], []
        for t, x in enumerate(row):
            logp = -1.0 - 0.5 * t + x
            w = WEIGHTS[i][t] if weights else 1.0
            r = math.exp(x)
            if loss_type == "grpo":
                c = min(max(r, 1 - eps_low), 1 + hi)
                binds = -c * a > -r * a
                term = max(-r * a, -c * a)
                grow.append(0.0 if binds else -a * r * w / n)
                clipped += binds
            else:
                term = -a * logp
                grow.append(-a * w / n)
            total += w * term
            abs_total += abs(w * term)
        grads.append(grow)
    return total / n, grads, clipped, abs_total / n


CASES = [
    dict(loss_type="grpo"),
    dict(loss_type="grpo", clip_eps_high=0.28),
    dict(loss_type="grpo", weights=True),
    dict(loss_type="grpo", weights=True, normalizer=40),
    dict(loss_type="reinforce"),
    dict(loss_type="reinforce", weights=True, normalizer=40),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_loss_gradient_and_stats_against_the_formula(case):
    loss_type = case["loss_type"]
    logp, old, adv, mask, w = make_batch()
    out = policy_loss(
        logp,
        old,
        adv,
        mask,
        loss_type=loss_type,
        clip_eps_high=case.get("clip_eps_high"),
        is_weights=w if case.get("weights") else None,
        normalizer=case.get("normalizer"),
    )
    assert isinstance(out, PolicyLoss) and out.loss.dim() == 0 and out.loss.dtype == torch.float32
    ref, ref_grads, clipped, abs_sum = reference(
        loss_type, eps_high=case.get("clip_eps_high"), weights=case.get("weights", False), n=case.get("normalizer")
    )
    n_valid = int(mask.sum())
    assert abs(float(out.loss.detach()) - ref) <= (n_valid + 5) * U * abs_sum
    out.loss.backward()
    for i, grow in enumerate(ref_grads):
        for t in range(WIDTH):
            got = float(logp.grad[i, t])
            if t >= len(grow) or grow[t] == 0.0:
                assert got == 0.0  # padding, clipped tokens, zero weights: exactly no gradient
            else:
                assert abs(got - grow[t]) <= 8 * U * abs(grow[t])
    assert out.stats["actor/pg_loss"] == float(out.loss.detach())
    assert out.stats["actor/pg_clipfrac"] == clipped / n_valid
    xs = [x for row in LOG_RATIOS for x in row]
    assert out.stats["actor/ppo_kl"] == pytest.approx(-sum(xs) / n_valid, rel=1e-15, abs=0)
    assert out.stats["actor/ratio_mean"] == pytest.approx(sum(math.exp(x) for x in xs) / n_valid, rel=4 * U, abs=0)


def test_the_example_exercises_both_clip_sides():
    _, grads, clipped, _ = reference("grpo")
    assert clipped == 3  # e^0.5 and e^0.1875 with A > 0 above the band, e^-0.5 with A < 0 below it
    assert reference("grpo", eps_high=0.28)[2] == 2  # e^0.1875 = 1.206 > 1.2 but < 1.28: no longer clipped
    assert sum(g != 0.0 for row in grads for g in row) == 6


def test_padding_never_matters():
    results = []
    for pad in (0.0, BIG):
        logp, old, adv, mask, w = make_batch(pad)
        if pad:
            with torch.no_grad():
                logp[0, 4] = float("nan")
        for loss_type in LOSS_TYPES:
            logp.grad = None
            out = policy_loss(logp, old, adv, mask, loss_type=loss_type, is_weights=w)
            out.loss.backward()
            results.append((out.loss.detach(), logp.grad.clone(), out.stats))
    for (l0, g0, s0), (l1, g1, s1) in zip(results[:2], results[2:], strict=True):
        assert torch.equal(l0, l1) and torch.equal(g0, g1) and s0 == s1


def test_per_token_advantages_equal_broadcast_ones():
    logp, old, adv, mask, w = make_batch()
    a = policy_loss(logp, old, adv, mask, is_weights=w).loss
    per_token = torch.where(mask, adv[:, None].expand(-1, WIDTH), BIG)
    b = policy_loss(logp, old, per_token, mask, is_weights=w).loss
    assert torch.equal(a, b)


def test_first_inner_epoch_grpo_gradient_is_reinforce_gradient():
    # inner_epochs=1: the trainer's log-probs equal the old ones, r_t = 1 exactly, nothing is clipped.
    _, old, adv, mask, w = make_batch()
    grads = {}
    for loss_type in LOSS_TYPES:
        logp = old.clone().requires_grad_(True)
        out = policy_loss(logp, old, adv, mask, loss_type=loss_type, clip_eps_high=0.28, is_weights=w)
        out.loss.backward()
        grads[loss_type] = logp.grad
        if loss_type == "grpo":
            assert out.stats["actor/ratio_mean"] == 1.0 and out.stats["actor/pg_clipfrac"] == 0.0
            assert out.stats["actor/ppo_kl"] == 0.0
    assert torch.equal(grads["grpo"], grads["reinforce"])
    assert grads["grpo"].abs().sum() > 0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batches_with_the_batch_normalizer_sum_to_the_batch(loss_type):
    logp, old, adv, mask, w = make_batch()
    n = int(mask.sum())
    full = policy_loss(logp, old, adv, mask, loss_type=loss_type, is_weights=w)
    full.loss.backward()
    g_full = logp.grad.clone()
    logp.grad = None
    total = 0.0
    for i in range(len(ADV)):
        part = policy_loss(
            logp[i : i + 1],
            old[i : i + 1],
            adv[i : i + 1],
            mask[i : i + 1],
            loss_type=loss_type,
            is_weights=w[i : i + 1],
            normalizer=n,
        )
        part.loss.backward()
        total += float(part.loss.detach())
    assert torch.equal(logp.grad, g_full)  # each token's gradient is the same op sequence either way
    _, _, _, abs_sum = reference(loss_type, weights=True)
    assert abs(total - float(full.loss.detach())) <= 2 * (n + 5) * U * abs_sum


def test_is_weights_are_detached():
    logp, old, adv, mask, w = make_batch()
    w = torch.where(mask, w, 0.0).requires_grad_(True)
    policy_loss(logp, old, adv, mask, is_weights=w).loss.backward()
    assert w.grad is None and logp.grad is not None


def test_log_ratio_safety_clamp_keeps_the_loss_finite():
    # A < 0 and a log-ratio of 30: the unclipped term binds; verl clamps the log-ratio to 20 (loss -A e^20 / N) and
    # the clamp stops the gradient.
    logp = torch.tensor([[30.0 - 1.0]], requires_grad=True)
    old = torch.tensor([[-1.0]])
    out = policy_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 1, dtype=torch.bool))
    assert abs(float(out.loss.detach()) - math.exp(20.0)) <= 4 * U * math.exp(20.0)
    out.loss.backward()
    assert float(logp.grad[0, 0]) == 0.0


# -----------------------------------------------------------------------------
# bad input


def test_bad_input_is_a_clear_error():
    logp, old, adv, mask, w = make_batch()
    cases = [
        (dict(loss_type="ppo"), ValueError, r"unknown loss_type 'ppo'; choose one of grpo, reinforce"),
        (dict(clip_eps=0.0), ValueError, r"clip_eps must be a finite positive"),
        (dict(clip_eps=1.0), ValueError, r"clip_eps must be below 1"),
        (dict(clip_eps=float("nan")), ValueError, r"clip_eps must be a finite positive"),
        (dict(clip_eps_high=-0.1), ValueError, r"clip_eps_high must be a finite positive"),
        (dict(normalizer=0), ValueError, r"normalizer must be a finite positive"),
        (dict(normalizer=True), TypeError, r"normalizer must be a number"),
        (dict(normalizer=torch.ones(2)), ValueError, r"normalizer must be a scalar"),
        (dict(is_weights=-torch.ones_like(w)), ValueError, r"is_weights must be >= 0"),
        (dict(is_weights=w[:, :3]), ValueError, r"is_weights has shape"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            policy_loss(logp, old, adv, mask, **kwargs)
    with pytest.raises(TypeError, match=r"mask must be a \(B, T\) bool tensor"):
        policy_loss(logp, old, adv, mask.float())
    with pytest.raises(TypeError, match=r"logp must be float32.*logp.float\(\)"):
        policy_loss(logp.double(), old, adv, mask)
    with pytest.raises(ValueError, match=r"old_logp has shape"):
        policy_loss(logp, old[:, :2], adv, mask)
    with pytest.raises(ValueError, match=r"advantages has shape"):
        policy_loss(logp, old, adv[:2], mask)
    bad = old.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"old_logp is not finite at 1 completion tokens"):
        policy_loss(logp, bad, adv, mask)
    empty = mask.clone()
    empty[2] = False
    with pytest.raises(ValueError, match=r"rows \[2\] of mask have no completion token"):
        policy_loss(logp, old, adv, empty)
