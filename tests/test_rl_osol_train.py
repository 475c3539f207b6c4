"""OSOL inside ``roundalign train`` (rl/osol_step.py, rl/loop.py): the footprint, the weights it swaps, the run.

The formulas themselves are tested against an independent reference in tests/test_rl_osol.py; here the question is
whether the run feeds them the right numbers: the footprint is the trainer's log-prob on the current weights minus
the same trainer's on the previous ones (recomputed here by a second model instance), the trainer is back on the
current weights bit for bit afterwards, the focus never repeats, per-domain rewards are logged, and a resumed run
continues every OSOL metric bit for bit.
"""

from __future__ import annotations

import json
import types

import pytest
import torch

import roundalign
from roundalign.cli import main
from roundalign.errors import UserError
from roundalign.models import path as model_path
from roundalign.rl.config import TrainConfig
from roundalign.rl.logbook import read_metrics
from roundalign.rl.loop import train
from roundalign.rl.osol import base_advantages, corrected_advantages, focus_domain
from roundalign.rl.osol_step import OsolStep
from roundalign.rl.policy import Policy
from roundalign.trainer import completion_logits, completion_logprobs, load_model

pytest.importorskip("reasoning_gym")

SMALL = dict(
    domains="arithmetic,counting",
    adv_estimator="osol",
    prompts_per_step=2,
    group_size=4,
    max_tokens=8,
    eval_problems=4,
    eval_every=2,
    lr=1e-3,
)


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # bitwise comparisons between runs need one thread count
    yield
    torch.set_num_threads(before)


def _independent_logprobs(weights: dict, config: TrainConfig, outs, rows) -> list[torch.Tensor]:
    """The trainer's log-probs of ``rows`` on ``weights``, from a second model instance under the same profile."""
    model = load_model(model_path("tiny-qwen3"), torch.bfloat16)
    model.config.use_cache = False
    roundalign.apply(model, config.resolved_trainer_profile)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
        out = []
        for i in rows:
            logits = completion_logits(model, outs[i].prompt_token_ids, outs[i].token_ids).float() / config.temperature
            out.append(completion_logprobs(logits, outs[i].token_ids))
    return out


def test_footprint_is_the_trainer_on_current_minus_previous_weights_and_the_weights_come_back():
    config = TrainConfig(**SMALL).validate()
    policy = Policy(model_path("tiny-qwen3"), config)
    before = {n: p.detach().clone() for n, p in policy._compute.items()}
    g = torch.Generator().manual_seed(0)
    after = {n: (w.float() + 0.02 * torch.randn(w.shape, generator=g)).to(w.dtype) for n, w in before.items()}
    osol = OsolStep(config, n_domains=2)
    policy.set_compute_weights(before)
    osol.remember(policy, before)
    policy.set_compute_weights(after)
    osol.remember(policy, after)

    vocab = policy.model.config.vocab_size
    lengths = [5, 3, 6, 4, 2, 7, 3, 5]
    outs = [
        types.SimpleNamespace(
            prompt_token_ids=torch.randint(1, vocab, (4,), generator=g).tolist(),
            token_ids=torch.randint(1, vocab, (n,), generator=g).tolist(),
        )
        for n in lengths
    ]
    domains = [0, 0, 0, 0, 1, 1, 1, 1]
    old = [policy.logprobs(o.prompt_token_ids, o.token_ids)[0] for o in outs]
    width = max(lengths)
    old_pad = torch.zeros(len(outs), width)
    mask = torch.zeros(len(outs), width, dtype=torch.bool)
    for i, lp in enumerate(old):
        old_pad[i, : len(lp)], mask[i, : len(lp)] = lp, True
    grpo = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.8, -0.8, 0.2, -0.2])
    step = 2
    adv, metrics = osol.advantages(step, policy, outs, domains, grpo, old_pad, mask, old_pad.clone())

    focus = focus_domain(2, config.seed, step, config.osol_schedule)
    rows = [i for i, d in enumerate(domains) if d == focus]
    now = _independent_logprobs(after, config, outs, rows)
    then = _independent_logprobs(before, config, outs, rows)
    u = torch.zeros(len(outs), width)
    for i, a, b in zip(rows, now, then, strict=True):
        assert torch.equal(a, old_pad[i, : len(a)])  # the recompute is the trainer on the current weights
        u[i, : len(a)] = a - b
    base = base_advantages(grpo, domains, focus, config.osol_focus_weight, config.osol_other_weight)
    expected = corrected_advantages(
        base[:, None].expand(mask.shape).clone(), mask, torch.tensor([d == focus for d in domains]), u,
        tau=config.osol_tau, clip=config.osol_clip, p_lo=config.osol_p_lo, p_hi=config.osol_p_hi,
    )  # fmt: skip
    assert torch.equal(adv, expected.advantages)
    assert metrics["osol/focus_domain"] == focus
    assert metrics["osol/candidates"] == expected.candidates > 0
    assert metrics["osol/kappa"] == expected.kappa > 0
    # the sampler given here is the trainer itself (d = 0): no footprint is within the mismatch
    assert metrics["osol/footprint_below_mismatch"] == 0.0 and metrics["osol/rank_change_frac"] == 0.0
    for n, p in policy._compute.items():  # back on the current weights, bit for bit
        assert torch.equal(p.detach(), after[n]), n


def test_first_step_has_no_footprint_and_no_residual():
    config = TrainConfig(**SMALL).validate()
    policy = Policy(model_path("tiny-qwen3"), config)
    osol = OsolStep(config, n_domains=2)
    osol.remember(policy, None)  # the first sync: nothing before it
    outs = [types.SimpleNamespace(prompt_token_ids=[1, 2], token_ids=[3, 4]) for _ in range(4)]
    old_pad = torch.stack([policy.logprobs([1, 2], [3, 4])[0]] * 4)
    mask = torch.ones(4, 2, dtype=torch.bool)
    grpo = torch.tensor([1.0, -1.0, 2.0, -2.0])
    adv, metrics = osol.advantages(1, policy, outs, [0, 0, 1, 1], grpo, old_pad, mask, old_pad)
    focus = focus_domain(2, config.seed, 1)
    weights = [config.osol_focus_weight if d == focus else config.osol_other_weight for d in (0, 0, 1, 1)]
    assert torch.equal(adv, (grpo * torch.tensor(weights))[:, None].expand(4, 2))
    assert metrics["osol/kappa"] is None and metrics["osol/candidates"] is None
    assert metrics["osol/footprint_below_mismatch"] is None


def test_osol_run_logs_its_metrics_rotates_the_focus_and_resumes_bitwise(tmp_path):
    base = dict(save_every=2, **SMALL) | {"model": "tiny-llama-chars", "max_tokens": 12}  # the model for these tasks
    straight = train(TrainConfig(steps=4, **base).validate(), tmp_path / "straight", progress=False, tensorboard=False)
    rows = read_metrics(straight / "metrics.jsonl")
    assert set(rows[0]) >= {"eval/accuracy", "eval/arithmetic/reward", "eval/counting/reward"}
    assert rows[0]["eval/accuracy"] == (rows[0]["eval/arithmetic/reward"] + rows[0]["eval/counting/reward"]) / 2
    focus = [r["osol/focus_domain"] for r in rows[1:]]
    assert focus == [focus_domain(2, 0, k) for k in range(1, 5)]
    assert all(a != b for a, b in zip(focus, focus[1:], strict=False))
    assert rows[1]["osol/kappa"] is None  # step 1: no previous update
    for r in rows[1:]:
        assert 0 <= r["reward/arithmetic/mean"] <= 1 and 0 <= r["reward/counting/mean"] <= 1
        phases = ("rollout", "recompute", "update", "sync", "osol")
        assert abs(sum(r[f"timing_s/{p}"] for p in phases) - r["timing_s/step"]) < 1e-6 * r["timing_s/step"]
    for r in rows[2:]:
        assert r["osol/candidates"] >= 0 and r["osol/focus_tokens"] > 0
        # the ratio is undefined only where the last update left every focus token's log-prob as it was
        unmoved = r["osol/candidates"] == 0 and r["osol/footprint_mean"] == 0
        assert (r["osol/backtracking"] is None) == unmoved
    assert any(r["osol/candidates"] and r["osol/kappa"] and r["osol/backtracking"] is not None for r in rows[2:])

    part = train(TrainConfig(steps=2, **base).validate(), tmp_path / "part", progress=False, tensorboard=False)
    assert main(["train", "--resume", str(part), "--steps", "4", "--quiet", "--no-tensorboard"]) == 0
    resumed = read_metrics(part / "metrics.jsonl")

    def strip(r):
        return {k: v for k, v in r.items() if not k.startswith("timing_s/")}

    assert [strip(r) for r in rows] == [strip(r) for r in resumed]  # the footprint after a resume too
    assert json.loads((part / "config.json").read_text())["adv_estimator"] == "osol"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(adv_estimator="osol"), "give --domains with at least two"),
        (dict(adv_estimator="osol", domains="counting"), "give --domains with at least two"),
        (dict(osol_tau=0.1), "--osol-tau set OSOL's advantage: add --adv-estimator osol"),
        (dict(domains="arithmetic,counting,algorithmic", prompts_per_step=2), "--prompts-per-step 2 is below the 3"),
        (dict(domains="arithmetic,nosuch"), "unknown domain 'nosuch'"),
        (dict(domains="words=spell_backward+nosuch_dataset"), "unknown reasoning-gym dataset(s) ['nosuch_dataset']"),
        (dict(domains="words="), "domain 'words' is empty"),
        (dict(adv_estimator="osol", domains="arithmetic,counting", osol_p_lo=0.5, osol_p_hi=0.2), "p_lo <= p_hi"),
        (dict(adv_estimator="nope"), "unknown --adv-estimator 'nope'"),
    ],
)
def test_bad_settings_are_refused_before_any_work(settings, message):
    with pytest.raises(UserError) as err:
        TrainConfig(**settings).validate()
    assert message in str(err.value)


def test_backtracking_is_measured_every_n_steps_only():
    config = TrainConfig(**SMALL, osol_backtracking_every=2).validate()
    osol = OsolStep(config, n_domains=2)
    osol._focus_rows = [0]  # a step with a footprint
    calls = []
    policy = types.SimpleNamespace(logprobs=lambda *a: calls.append(a))
    assert osol.backtracking(3, policy, None) == {"osol/backtracking": None, "osol/backtrack_token_frac": None}
    assert calls == []  # no forward on a step it skips
    off = OsolStep(TrainConfig(**SMALL, osol_backtracking_every=0).validate(), n_domains=2)
    off._focus_rows = [0]
    assert off.backtracking(2, policy, None)["osol/backtracking"] is None and calls == []
    with pytest.raises(UserError, match="--osol-backtracking-every must be an int >= 0"):
        TrainConfig(**SMALL, osol_backtracking_every=-1).validate()


def test_multi_domain_held_out_items_are_the_models_and_the_same_for_every_seed():
    """Every run seed is scored on the items tiny-llama-chars was pre-trained without (its script's
    make_items(domain, 64, seed=1_000_003)), and no training batch holds one of them."""
    from roundalign.rl.data import MultiDomainTask
    from roundalign.tasks import gym

    spec = "arithmetic,probability"
    a, b = MultiDomainTask(spec, seed=0, eval_problems=64), MultiDomainTask(spec, seed=7, eval_problems=64)
    assert [it.prompt for it in a.eval_set] == [it.prompt for it in b.eval_set]
    for d in gym.parse_domains(spec):
        pretrain_held_out = {it.prompt for it in gym.make_items(d, 64, seed=1_000_003)}
        assert {it.prompt for it in a.eval_sets[d.name]} == pretrain_held_out
    held = {it.prompt for it in a.eval_set}
    for step in range(1, 4):
        batch = b.train_batch(step, 8)
        assert [b.domain(it) for it in batch] == [0, 1] * 4 and not held & {it.prompt for it in batch}
