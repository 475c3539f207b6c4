"""``roundalign train`` end to end on the shipped model: the smoke run, bitwise resume, divergence, bad options.

Runs are tiny (2 problems x 4 completions a step) so that the file stays fast on two cores; the numerics are the
full ones (fp32 master, bf16 compute copy under a profile, the reference engine, every export mode).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from roundalign.cli import main
from roundalign.errors import UserError
from roundalign.rl import checkpoint
from roundalign.rl import cli as rl_cli
from roundalign.rl.config import TrainConfig
from roundalign.rl.logbook import read_metrics
from roundalign.rl.loop import TrainingDiverged, train
from roundalign.rl.policy import Policy

SMALL = dict(prompts_per_step=2, group_size=4, max_tokens=48, eval_problems=8, eval_every=2, lr=1e-4)


def _rows(out) -> list[dict]:
    return read_metrics(out / "metrics.jsonl")


def _no_timing(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("timing_s/")}


@pytest.fixture(autouse=True)
def _one_thread():
    # Bitwise comparisons between two runs need the same thread count in both; one thread is also fastest here.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_smoke_run_writes_every_metric(tmp_path):
    out = train(
        TrainConfig(steps=5, sync="stochastic", rollout_is="token-tis", **SMALL).validate(),
        tmp_path / "run",
        progress=False,
        tensorboard=True,
    )
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert set(rows[0]) == {"step", "eval/accuracy", "timing_s/eval"}
    for r in rows[1:]:
        for key in (
            "reward/mean",
            "reward/std",
            "accuracy/train",
            "response_length/mean",
            "actor/entropy",
            "actor/grad_norm",
            "rollout_corr/k3_kl",
            "mismatch/bitwise_equal_frac",
            "rollout_corr/rollout_is_mean",
            "rollout_corr/raw_is_std",
            "sync/visible_fraction",
            "sync/relative_drift",
            "sync/lag_steps",
            "timing_s/rollout",
            "timing_s/recompute",
            "timing_s/update",
            "timing_s/sync",
            "timing_s/step",
        ):
            assert key in r, key
        assert 0 <= r["reward/mean"] <= 1
        # a step where every group got equal rewards trains nothing: all advantages are 0, so is the gradient
        assert (r["actor/grad_norm"] > 0) == (r["actor/trained_sequence_frac"] > 0)
        assert r["rollout_corr/k3_kl"] >= 0
        # one inner epoch: the update's forward (with grad) is the recompute's bit for bit, so the PPO ratio is 1
        assert r["actor/ppo_kl"] in (None, 0.0) and r["actor/pg_clipfrac"] in (None, 0.0)
        total = sum(r[f"timing_s/{p}"] for p in ("rollout", "recompute", "update", "sync"))
        assert math.isclose(total, r["timing_s/step"], rel_tol=1e-6)
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 2, 4, 5]  # every 2 steps, and the last
    assert json.loads((out / "config.json").read_text())["sync"] == "stochastic"
    assert checkpoint.list_checkpoints(out)[-1].name == "step-000005"
    # TensorBoard holds the same scalars under the same names
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard")).Reload()
    logged = [(e.step, e.value) for e in events.Scalars("reward/mean")]
    assert logged == [(r["step"], pytest.approx(r["reward/mean"], rel=1e-6)) for r in rows[1:]]  # stored as fp32


def test_master_moves_and_engine_serves_the_export(tmp_path):
    """After a run, the engine holds exactly the exporter's last output, and the compute copy follows the rule."""
    from roundalign.rl.loop import Run

    config = TrainConfig(steps=1, sync="error-feedback", **SMALL).validate()
    run = Run(config, tmp_path)
    before = {k: v.clone() for k, v in run.policy.master_state().items()}
    run.sync()
    run.step(1)
    master = run.policy.master_state()
    assert any(not torch.equal(before[k], master[k]) for k in master)
    served_engine = run.engine.weights.state_dict()
    for name, served in run.served.items():
        assert torch.equal(served_engine[name], served)
        # --loss-on-served is on by default for error-feedback: the trainer computes on the served copy itself
        assert torch.equal(dict(run.policy.model.named_parameters())[name].detach(), served)


def test_resume_continues_bitwise(tmp_path):
    base = dict(sync="stochastic", rollout_is="seq-mask", save_every=2, **SMALL)
    straight = train(TrainConfig(steps=4, **base).validate(), tmp_path / "straight", progress=False, tensorboard=False)
    part = train(TrainConfig(steps=2, **base).validate(), tmp_path / "part", progress=False, tensorboard=False)
    assert main(["train", "--resume", str(part), "--steps", "4", "--quiet", "--no-tensorboard"]) == 0
    a, b = _rows(straight), _rows(part)
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    assert json.loads((part / "config.json").read_text())["steps"] == 4  # the run is now a 4-step run
    assert [_no_timing(r) for r in a] == [_no_timing(r) for r in b]  # every metric, compared as exact floats
    ma, _, _ = checkpoint.load_latest(straight)
    mb, _, _ = checkpoint.load_latest(part)
    assert all(torch.equal(ma[k], mb[k]) for k in ma)


def test_resume_rejects_changed_settings_and_finished_runs(tmp_path, capsys):
    out = train(TrainConfig(steps=1, **SMALL).validate(), tmp_path / "r", progress=False, tensorboard=False)
    assert main(["train", "--resume", str(out), "--sync", "stochastic"]) == 2
    assert "--sync 'stochastic' (the run has 'rne')" in capsys.readouterr().err
    assert main(["train", "--resume", str(out)]) == 2
    assert "already at step 1 of 1" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path / "nothing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["train", "--out", str(out), "--steps", "2"]) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_non_finite_loss_stops_with_step_and_keeps_last_checkpoint(tmp_path, monkeypatch, capsys):
    """From step 3 on, the trainer's log-probs turn NaN (zero_grad runs once per step: it counts the steps)."""
    real, real_zero = Policy.logprobs_with_grad, Policy.zero_grad

    def poisoned(self, prompt, completion):
        logp = real(self, prompt, completion)
        return logp * float("nan") if self._step_for_test >= 3 else logp

    def zero_grad(self):
        self._step_for_test = getattr(self, "_step_for_test", 0) + 1
        return real_zero(self)

    monkeypatch.setattr(Policy, "logprobs_with_grad", poisoned)

    monkeypatch.setattr(Policy, "zero_grad", zero_grad)
    out = tmp_path / "div"
    argv = [
        "train",
        "--out",
        str(out),
        "--steps",
        "5",
        "--save-every",
        "2",
        "--quiet",
        "--no-tensorboard",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--max-tokens",
        "48",
        "--eval-problems",
        "8",
        "--lr",
        "1e-4",
    ]
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert "step 3: the loss is non-finite" in err and "step-000002" in err
    assert [p.name for p in checkpoint.list_checkpoints(out)] == ["step-000002"]
    assert [r["step"] for r in _rows(out)] == [0, 1, 2]


def test_non_finite_gradient_names_the_tensor(tmp_path, monkeypatch):
    real = Policy.backward

    def backward(self, loss, step):
        real(self, loss, step)
        self.master["model.layers.1.mlp.up_proj.weight"].grad[0, 0] = float("inf")

    monkeypatch.setattr(Policy, "backward", backward)
    with pytest.raises(
        TrainingDiverged,
        match=r"step 1: the gradient of model\.layers\.1\.mlp\.up_proj\.weight has "
        r"non-finite values .*no checkpoint was saved",
    ):
        train(TrainConfig(steps=2, **SMALL).validate(), tmp_path / "g", progress=False, tensorboard=False)


def test_a_library_config_is_checked_as_the_command_line_checks_it():
    """TrainConfig.validate() is the one check: values the CLI's choices would catch are caught for library users."""
    with pytest.raises(UserError, match=r"--level must be one of 1, 2, 3, got 7"):
        TrainConfig(level=7).validate()
    with pytest.raises(UserError, match=r"--top-p must be in \(0, 1\], got 1.5"):
        TrainConfig(top_p=1.5).validate()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sync", "rne", "--loss-on-served"], "--loss-on-served with --sync rne changes nothing"),
        (["--loss-type", "reinforce", "--inner-epochs", "2"], "plain REINFORCE has no ratio"),
        (["--loss-type", "reinforce", "--clip-eps", "0.3"], "plain REINFORCE does not clip"),
        (["--group-size", "1"], "--group-size must be an int >= 2"),
        (["--temperature", "0"], "greedy rollouts make every completion of a group identical"),
        (["--rollout-is", "none", "--rollout-is-threshold", "2"], "none"),
        (["--rollout-is", "token-mask", "--rollout-is-threshold", "2_1"], "token-mask"),
        (["--trainer-profile", "nope"], "--trainer-profile"),
        (["--engine-profile", "sglang", "--engine-backend", "inductor"], "cannot serve profile 'sglang'"),
        (["--dtype", "float16", "--engine-backend", "inductor"], "kernels backend"),
        (["--optimizer", "sgd", "--betas", "0.8,0.9"], "--betas apply to --optimizer adamw only"),
        (["--enforce-eager"], "--enforce-eager is a vLLM mode: add --engine vllm"),
        (["--engine", "vllm", "--dtype", "float16"], "--engine vllm serves bfloat16"),
        # This environment has no vLLM (.venv-vllm has it): the run says where to run it.
        (["--engine", "vllm"], "it is not installed here. Run roundalign train in the environment that has it"),
    ],
)
def test_invalid_combinations_are_rejected_before_any_work(tmp_path, capsys, argv, message):
    out = tmp_path / "bad"
    assert main(["train", "--out", str(out), "--quiet", *argv]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()  # rejected before anything was loaded or written


def test_every_setting_carries_its_help_and_train_help_shows_it(capsys):
    """Each ``TrainConfig`` field documents itself; ``roundalign train --help`` shows that text, defaults filled in."""
    import dataclasses

    fields = dataclasses.fields(TrainConfig)
    assert [f.name for f in fields if not f.metadata.get("help")] == []
    assert sorted(set(rl_cli.OPTIONS) - {f.name for f in fields}) == ["no_tensorboard", "out", "quiet", "resume"]
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "training steps (default 60)" in text and "learning rate (default 1e-05)" in text
    assert "{default}" not in text and "{profiles}" not in text


def test_compare_runs_two_real_train_runs_and_plots_them(tmp_path):
    """``roundalign compare`` end to end with real ``roundalign train`` processes (no fake command)."""
    out = tmp_path / "grid"
    argv = [
        "compare",
        "--grid",
        "sync=rne,stochastic",
        "--out",
        str(out),
        "--jobs",
        "2",
        "--",
        "--steps",
        "2",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--max-tokens",
        "48",
        "--eval-problems",
        "8",
        "--eval-every",
        "1",
        "--lr",
        "1e-4",
        "--no-tensorboard",
    ]
    assert main(argv) == 0
    for cell in ("sync-rne", "sync-stochastic"):
        assert [r["step"] for r in _rows(out / cell)] == [0, 1, 2]
    summary = (out / "summary.md").read_text()
    assert "sync=rne" in summary and "sync=stochastic" in summary
    pngs = sorted(p.name for p in (out / "plots").glob("*.png"))
    assert "overview.png" in pngs and len(pngs) >= 8
    assert all((out / "plots" / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_prefill_check_is_exactly_zero_for_the_aligned_trainer_and_not_for_hf(tmp_path):
    """--prefill-check: the aligned trainer equals the engine's prefill bit for bit (k3 0, all tokens equal), at
    temperature != 1 too; the stock HF trainer does not. Independent of the decode-vs-prefill attention gap."""
    rows = {}
    for profile in ("aligned", "hf"):
        config = TrainConfig(
            steps=2,
            engine_profile="sglang",
            trainer_profile=profile,
            sync="stochastic",
            temperature=0.9,
            prefill_check=True,
            **SMALL,
        ).validate()
        rows[profile] = _rows(train(config, tmp_path / profile, progress=False, tensorboard=False))[1:]
    for r in rows["aligned"]:
        assert r["prefill/k3_kl"] == 0.0 and r["prefill/bitwise_equal_frac"] == 1.0
        assert r["mismatch/bitwise_equal_frac"] < 1.0  # the decode-time log-probs still differ (attention shapes)
    for r in rows["hf"]:
        assert r["prefill/k3_kl"] > 0 and r["prefill/bitwise_equal_frac"] < 1.0


def test_reference_kernels_make_the_run_exactly_on_policy(tmp_path):
    """An engine profile with the reference engine's kernels (attention and gemm 'reference'; the trainer follows,
    --trainer-profile engine): every step's recompute is the sampler's log-probs bit for bit, at temperature != 1
    and with stochastic export changing the served weights: k3_kl 0 and every IS ratio exactly 1, and the engine's
    decode equals its own prefill."""
    config = TrainConfig(
        steps=3,
        engine_profile="sglang+attention=reference+gemm=reference",
        sync="stochastic",
        temperature=0.9,
        prefill_check=True,
        **{**SMALL, "lr": 1e-3},
    ).validate()
    rows = _rows(train(config, tmp_path / "exact", progress=False, tensorboard=False))[1:]
    assert len(rows) == 3 and any(r["actor/trained_sequence_frac"] > 0 for r in rows[:-1])
    for r in rows:
        assert r["rollout_corr/k3_kl"] == 0.0 and r["mismatch/bitwise_equal_frac"] == 1.0
        assert r["mismatch/log_ratio_max_abs"] == 0.0
        assert r["rollout_corr/raw_is_min"] == r["rollout_corr/raw_is_max"] == 1.0
        assert r["prefill/k3_kl"] == 0.0 and r["prefill/bitwise_equal_frac"] == 1.0


@pytest.mark.parametrize(
    "settings",
    [
        dict(dtype="float16", sync="stochastic"),
        dict(loss_type="reinforce", optimizer="sgd", lr=1e-2),
        dict(inner_epochs=2, clip_eps=0.1, rollout_is="geo-mask", rollout_is_threshold="0.9_1.1"),
    ],
    ids=["float16", "reinforce-sgd", "ppo-2-epochs-geo-mask"],
)
def test_other_numerics_and_objectives_train(tmp_path, settings):
    from roundalign.rl.loop import Run

    config = TrainConfig(**{**SMALL, "steps": 1, "prompts_per_step": 4, **settings}).validate()
    run = Run(config, tmp_path)
    before = {k: v.clone() for k, v in run.policy.master_state().items()}
    run.sync()
    m = run.step(1)
    assert m["actor/trained_sequence_frac"] > 0 and m["actor/grad_norm"] > 0
    assert any(not torch.equal(before[k], v) for k, v in run.policy.master_state().items())  # the master moved
    dtype = torch.float16 if settings.get("dtype") == "float16" else torch.bfloat16
    assert run.engine.dtype == dtype and {p.dtype for p in run.policy.model.parameters()} == {dtype}
    if dtype == torch.float16:
        assert m["actor/loss_scale"] == 2.0**16 and m["actor/skipped_step"] == 0.0
    if config.inner_epochs == 2:  # the second pass sees moved weights: the ratio leaves 1
        assert m["actor/ppo_kl"] != 0.0


def test_cli_prints_a_summary_of_the_run(tmp_path, capsys):
    out = tmp_path / "cli"
    argv = [
        "train",
        "--out",
        str(out),
        "--steps",
        "2",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--max-tokens",
        "48",
        "--eval-problems",
        "8",
        "--no-tensorboard",
        "--prefill-check",
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    rows = _rows(out)
    assert (
        f"run {out}: 2 steps; trainer profile vllm, engine profile vllm (kernels backend), bfloat16, --sync rne" in text
    )
    width = rl_cli._WIDTH
    assert f"  {'reward':<{width}} {(rows[1]['reward/mean'] + rows[2]['reward/mean']) / 2:.3f}" in text
    k3 = (rows[1]["rollout_corr/k3_kl"] + rows[2]["rollout_corr/k3_kl"]) / 2
    assert f"  {'k3_kl, trainer vs sampler' + chr(39) + 's decode log-probs':<{width}} {k3:.2e}" in text
    prefill = (rows[1]["prefill/bitwise_equal_frac"] + rows[2]["prefill/bitwise_equal_frac"]) / 2
    assert f"  {'bitwise equal, vs engine prefill':<{width}} {prefill:.1%}" in text  # --prefill-check's figures
    assert f"{rows[0]['eval/accuracy']:.3f} at step 0 -> {rows[2]['eval/accuracy']:.3f} at step 2" in text
