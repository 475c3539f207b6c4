"""roundalign.integrations.trl inside a real TRL 1.16 GRPOTrainer, on the CPU, on the shipped tiny-qwen3.

What is proved here, each against a reference the test computes itself:

- TRL 1.16 applies no IS correction and logs no ``sampling/*`` for a plain ``rollout_func`` with ``use_vllm=False``;
- with ``EngineRolloutFunc.attach`` it does, from the engine's log-probs: TRL's ``sampling_per_token_logps`` are the
  engine's own decode log-probs (re-scored independently), and its IS ratio and ``sampling/*`` values follow
  from those and TRL's recompute by TRL's formulas;
- the engine's served weights are the RNE / stochastic / error-feedback export of the policy's fp32 master after
  every optimizer step;
- on the same rollouts, the policy patched with the engine's profile has a lower ``rollout_corr/k3_kl`` than stock;
- the same training runs as 2 DDP processes under ``accelerate launch --multi_gpu --num_processes 2``, which without
  a GPU is torchrun over gloo on the CPU (``--cpu`` would start one process in accelerate 1.15; slow).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

import roundalign
import trl_setup
from roundalign.engine import Engine, SamplingParams
from roundalign.integrations.trl import EngineRolloutFunc, log_mismatch, patch_policy, unwrap_policy
from roundalign.sync import KEYS as SYNC_KEYS
from roundalign.sync import ExportState, export_bf16, tensor_seed

TEMPERATURE = 0.9


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 2-core machine shared with other jobs: one thread is the fast setting here
    yield
    torch.set_num_threads(threads)


class Capture(TrainerCallback):
    """Records, per generation batch, what TRL scored and the engine's independent re-score of the same tokens, and,
    at attach and after every sync, the policy's master and the engine's served weights."""

    def __init__(self, trainer, rollout: EngineRolloutFunc):
        self.trainer, self.rollout = trainer, rollout
        self.batches, self.weights = [], [self.snapshot()]  # the export done at attach
        inner = trainer._generate_and_score_completions  # already wrapped by the rollout's metrics hook

        def outer(inputs):
            output = inner(inputs)
            r = rollout.last_rollout
            # The engine has not been synced since it sampled these (that happens after the optimizer step).
            rescored = rollout.engine.score(
                r["prompt_ids"], r["completion_ids"], mode="decode", temperature=TEMPERATURE
            )
            prefill = rollout.engine.score(
                r["prompt_ids"], r["completion_ids"], mode="prefill", temperature=TEMPERATURE
            )
            # The policy's plain forward (logits, no fused LM head) on TRL's padded batch, under TRL's autocast.
            ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
            attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
            with torch.no_grad(), trainer.accelerator.autocast():
                logits = trainer.model(input_ids=ids, attention_mask=attention).logits
            start = output["prompt_ids"].shape[1] - 1
            padded = (logits[:, start:-1].float() / TEMPERATURE).log_softmax(-1)
            padded = padded.gather(2, output["completion_ids"][..., None])[..., 0]
            self.batches.append(
                {"output": output, "rollout": r, "rescored": rescored, "prefill": prefill, "padded_forward": padded}
            )
            return output

        trainer._generate_and_score_completions = outer
        trainer.add_callback(self)  # after attach's callback: sees the weights it synced

    def snapshot(self):
        master = {n: t.detach().clone() for n, t in unwrap_policy(self.trainer).state_dict().items()}
        served = {n: t.clone() for n, t in self.rollout.engine.weights.state_dict().items()}
        return master, served

    def on_step_end(self, args, state, control, **kwargs):
        self.weights.append(self.snapshot())


def run_trainer(tmp_path, *, fp32=True, sync="rne", steps=3, attribution_every=1, profile="vllm", **config):
    """3 steps of the policy patched ``profile`` sampled by an engine with ``profile``, recorded by ``Capture``."""
    model, tokenizer = trl_setup.policy(fp32)
    patch_policy(model, profile)
    trainer = trl_setup.trainer(
        model, tokenizer, str(tmp_path), fp32=fp32, steps=steps, temperature=TEMPERATURE, **config
    )
    rollout = EngineRolloutFunc(
        engine_profile=profile,
        sync=sync,
        seed=3,
        attribution_every=attribution_every,
        prefill_check=attribution_every > 0,
    )
    rollout.attach(trainer)
    capture = Capture(trainer, rollout)
    inner = trainer._get_per_token_logps_and_entropies
    capture.scored = []  # every log-prob TRL computed: the recompute (old_per_token_logps) and the loss's forward

    def scored(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        out = inner(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        capture.scored.append((input_ids[:, -logits_to_keep:].clone(), out[0].detach().clone()))
        return out

    trainer._get_per_token_logps_and_entropies = scored
    trainer.train()
    return trainer, rollout, capture


@pytest.fixture(scope="module", params=["fp32-autocast", "bf16"])
def aligned_run(request, tmp_path_factory):
    """The policy patched with the engine's profile (``vllm``), RNE sync, attribution at every step."""
    return run_trainer(tmp_path_factory.mktemp("aligned"), fp32=request.param == "fp32-autocast")


# ----------------------------------------------------------------------------------------------------------------
# the finding: TRL 1.16 with a plain rollout_func and use_vllm=False


def test_stock_trl_applies_no_is_correction_to_a_rollout_func(tmp_path):
    model, tokenizer = trl_setup.policy(fp32=True)
    engine = Engine(model, profile="vllm")
    outputs = []

    def rollout_func(prompts, trainer):
        ids = trainer._tokenize_prompts(prompts)[0]
        outs = engine.generate(
            ids,
            SamplingParams(
                temperature=TEMPERATURE, max_tokens=40, seed=0, logprobs_mode="processed", stop_token_ids=(0,)
            ),
        )
        return {
            "prompt_ids": ids,
            "completion_ids": [o.token_ids for o in outs],
            "logprobs": [o.logprobs for o in outs],
        }

    trainer = trl_setup.trainer(
        model, tokenizer, str(tmp_path), steps=1, temperature=TEMPERATURE, rollout_func=rollout_func
    )
    log_mismatch(trainer, "vllm")  # our metrics without EngineRolloutFunc: the logger recomputes what TRL skipped
    inner = trainer._generate_and_score_completions

    def outer(inputs):
        output = inner(inputs)
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        with torch.no_grad():  # TRL's own log-prob method, as it would compute old_per_token_logps
            old = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, attention, output["completion_ids"].size(1), batch_size=8
            )[0]
        outputs.append((output, old))
        return output

    trainer._generate_and_score_completions = outer
    trainer.train()
    ((output, old),) = outputs
    # The sampler's log-probs reach TRL...
    assert output["sampling_per_token_logps"] is not None
    # ...but TRL uses none of them: no recompute, no IS ratio, no sampling/* metrics.
    assert "importance_sampling_ratio" not in output and "old_per_token_logps" not in output
    assert trainer.args.vllm_importance_sampling_correction  # on by default: it is use_vllm that gates it
    (logs,) = trl_setup.step_logs(trainer)
    assert "loss" in logs and not [k for k in logs if k.startswith("sampling/")]
    # log_mismatch's k3 (verl's formula) is the trainer's recompute against the sampler's log-probs.
    mask = output["completion_mask"].bool()
    rho = torch.cat(
        [(o.double() - s.double())[m] for o, s, m in zip(old, output["sampling_per_token_logps"], mask, strict=True)]
    )
    assert logs["rollout_corr/k3_kl"] == (torch.expm1(rho) - rho).mean().item() > 0


# ----------------------------------------------------------------------------------------------------------------
# attached: TRL's vLLM branch runs on the engine's log-probs


def _padded(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    return torch.stack([torch.cat([r, r.new_zeros(width - len(r))]) for r in rows])  # right-padded with 0, as TRL


def test_trl_is_correction_and_sampling_metrics_use_the_engine_logprobs(aligned_run):
    trainer, rollout, capture = aligned_run
    logs = trl_setup.step_logs(trainer)
    assert len(capture.batches) == len(logs) == 3
    lo, hi = trainer.args.vllm_importance_sampling_clip_min, trainer.args.vllm_importance_sampling_clip_max
    assert trainer.args.vllm_importance_sampling_mode == "sequence_mask" and lo is None and hi == 3.0  # defaults
    for batch, log in zip(capture.batches, logs, strict=True):
        out, rescored = batch["output"], batch["rescored"]
        mask = out["completion_mask"].bool()
        # The engine's decode log-probs, re-scored independently, are what TRL holds as the sampler's.
        for row, m, lp, returned in zip(
            out["sampling_per_token_logps"], mask, rescored, batch["rollout"]["logprobs"], strict=True
        ):
            assert torch.equal(row[m], lp) and torch.equal(lp, torch.tensor(returned))
        engine = _padded(rescored, mask.shape[1])
        old = out["old_per_token_logps"]
        # TRL's sequence_mask ratio, from the formula: exp(sum_t (old - engine)), zeroed outside [-inf, 3].
        ratio = torch.exp(((old - engine) * mask).sum(dim=-1, keepdim=True))
        ratio = ratio.masked_fill(ratio > hi, 0.0)
        assert torch.equal(out["importance_sampling_ratio"], ratio)
        delta = (old - engine).abs()[mask]
        assert log["sampling/sampling_logp_difference/mean"] == delta.mean().item()
        assert log["sampling/sampling_logp_difference/max"] == delta.max().item()
        assert log["sampling/importance_sampling_ratio/mean"] == ratio.mean().item()
        # Ours, verl's definition: k3 = mean(exp(rho) - rho - 1), rho = trainer - engine, in float64.
        rho = torch.cat([(o.double() - e.double())[m] for o, e, m in zip(old, engine, mask, strict=True)])
        assert log["rollout_corr/k3_kl"] == (torch.expm1(rho) - rho).mean().item()
        assert log["rollout_corr/raw_is_max"] == torch.exp(rho.float()).max().item()
        assert log["rollout_corr/raw_is_seq_max"] == torch.exp(((old - engine) * mask).sum(-1)).max().item()


def test_metrics_appear_in_the_log_history(aligned_run):
    trainer, _, _ = aligned_run
    regions = ("rms_norm", "qk_norm", "residual", "rope", "swiglu")
    expected = [
        "rollout_corr/k3_kl",
        "rollout_corr/raw_is_min",
        "rollout_corr/raw_is_max",
        "rollout_corr/rollout_is_ratio_fraction_high",
        "mismatch/log_ratio_rms",
        *SYNC_KEYS,
        "attribution/base/k3_kl",
        "attribution/target/k3_kl",
        "prefill/k3_kl",
        "prefill/bitwise_equal_frac",
    ]
    expected += [f"attribution/{r}/{kind}" for r in regions for kind in ("switch", "alone")]
    for log in trl_setup.step_logs(trainer):
        missing = [k for k in expected if k not in log]
        assert not missing, missing
        assert log["sync/visible_fraction"] > 0  # the policy moved, and some of it reached the engine


def test_aligned_k3_is_below_stock_on_the_same_rollouts(aligned_run):
    trainer, _, _ = aligned_run
    for log in trl_setup.step_logs(trainer):
        # target: the policy as trained (patched with the engine's profile), re-scored: the very numbers TRL's own
        # recompute gives. base: the same policy with stock HF numerics, on the same rollouts.
        assert log["attribution/target/k3_kl"] == log["rollout_corr/k3_kl"]
        assert log["attribution/target/prefill_k3_kl"] == log["prefill/k3_kl"]
        # Against the engine's own prefill of the sampled tokens (rounding locations alone, without decode's
        # attention shapes), the aligned trainer is below stock at every step. Against the decode log-probs it is
        # not at every step on this model: docs/trl.md has the figures.
        assert log["attribution/target/prefill_k3_kl"] < log["attribution/base/prefill_k3_kl"], log


def test_aligned_policy_computes_the_engine_prefill_bitwise_in_trls_batch(aligned_run):
    """What is left of the aligned trainer's gap to the engine's prefill is TRL's log-prob arithmetic, not rounding
    locations: the patched policy's own logits on TRL's padded batch give the engine's prefill log-probs bit for
    bit; TRL's fused LM head (a chunked log-softmax of its own) lands within ~1e-6 nats of them."""
    _, _, capture = aligned_run
    for batch in capture.batches:
        mask = batch["output"]["completion_mask"].bool()
        old = batch["output"]["old_per_token_logps"]
        for padded, trl_row, m, prefill in zip(batch["padded_forward"], old, mask, batch["prefill"], strict=True):
            assert torch.equal(padded[m], prefill)
            assert (trl_row[m] - prefill).abs().max() < 1e-5  # fp32 log-softmax arithmetic, measured <= 1.5e-6


def test_attribution_restores_the_policy_profile(aligned_run):
    trainer, _, _ = aligned_run
    assert roundalign.patched_profile(trainer.model).name == "vllm"


# ----------------------------------------------------------------------------------------------------------------
# exactly on-policy: the reference engine's kernels in the engine and the policy, the engine's log-prob head in TRL


@pytest.fixture(scope="module", params=["fp32-autocast", "bf16"])
def exact_run(request, tmp_path_factory):
    return run_trainer(
        tmp_path_factory.mktemp("exact"),
        fp32=request.param == "fp32-autocast",
        profile="vllm-reference-kernels",
        attribution_every=0,
    )


def test_exact_policy_reproduces_the_sampler_logprobs_at_every_step(exact_run):
    """Every log-prob TRL computes (its recompute and the loss's own forward, in its padded batch, under its
    autocast) equals the engine's decode log-prob bit for bit; the IS ratio is exactly 1 and k3_kl exactly 0."""
    trainer, _, capture = exact_run
    logs = trl_setup.step_logs(trainer)
    assert len(capture.batches) == len(logs) == 3
    assert len(capture.scored) == 2 * len(capture.batches)  # per step: the recompute, then the loss's forward
    for i, (batch, log) in enumerate(zip(capture.batches, logs, strict=True)):
        out = batch["output"]
        mask = out["completion_mask"].bool()
        engine = _padded(batch["rescored"], mask.shape[1])  # the engine's decode log-probs, re-scored by it
        assert torch.equal(out["sampling_per_token_logps"][mask], engine[mask])
        assert torch.equal(out["old_per_token_logps"][mask], engine[mask])
        for completion_ids, trl_logps in capture.scored[2 * i : 2 * i + 2]:
            # TRL shuffles the batch before the loss's forward: match each row to its completion.
            rows = [_row_of(c, out["completion_ids"], mask) for c in completion_ids]
            assert torch.equal(trl_logps[mask[rows]], engine[rows][mask[rows]])
        assert bool((out["importance_sampling_ratio"] == 1).all())
        assert log["rollout_corr/k3_kl"] == 0 and log["mismatch/bitwise_equal_frac"] == 1
        assert log["sampling/sampling_logp_difference/max"] == 0


def _row_of(completion: torch.Tensor, completions: torch.Tensor, mask: torch.Tensor) -> int:
    rows = [i for i, (c, m) in enumerate(zip(completions, mask, strict=True)) if torch.equal(c[m], completion[m])]
    assert rows, "a scored completion that is not in the batch"
    return rows[0]  # identical completions of one prompt have identical log-probs


def test_trls_own_fused_head_is_not_exact(exact_run):
    """Why the engine's log-prob head replaces TRL's: TRL's chunked online log-sum-exp on the same policy's logits
    lands within ~1e-6 nats of the engine, not on it."""
    trainer, rollout, capture = exact_run
    batch = capture.batches[-1]
    out, r = batch["output"], batch["rollout"]
    # The engine's decode log-probs of these tokens at the current weights (it was synced after the last step).
    engine = rollout.engine.score(r["prompt_ids"], r["completion_ids"], mode="decode", temperature=TEMPERATURE)
    trl_forward = unwrap_policy(trainer)._roundalign_trl_head["trl_forward"]  # TRL's add_fused_lm_head forward
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    attention = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
    labels = ids.masked_fill(attention == 0, -100)
    labels[:, : out["prompt_ids"].shape[1]] = -100
    with torch.no_grad(), trainer.accelerator.autocast():
        trl = trl_forward(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True).log_probs
    mask = out["completion_mask"].bool()
    engine = _padded(engine, mask.shape[1])[mask]
    trl = trl[:, out["prompt_ids"].shape[1] - 1 :][mask]
    assert not torch.equal(trl, engine)
    assert (trl - engine).abs().max() < 1e-5


def test_engine_logprob_head_forward_and_gradient():
    from roundalign.kernels.logprobs import engine_logprobs

    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(37, 264, generator=g)).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 264, (37,), generator=g)
    picked, entropy = engine_logprobs(logits, targets, TEMPERATURE)
    # The forward: the engine's formula (roundalign.engine.sampling), bit for bit.
    logp = (logits.detach().float() / TEMPERATURE).log_softmax(-1)
    assert torch.equal(picked, logp.gather(-1, targets[:, None])[:, 0])
    assert torch.equal(entropy, -(logp.exp() * logp).sum(-1))
    # The backward: autograd's gradient of the same formula (a standard gradient, recomputed in chunks).
    w1, w2 = torch.randn(37, generator=g), torch.randn(37, generator=g)
    (picked * w1 + entropy * w2).sum().backward()
    ref = logits.detach().clone().requires_grad_()
    lp = (ref.float() / TEMPERATURE).log_softmax(-1)
    (lp.gather(-1, targets[:, None])[:, 0] * w1 - (lp.exp() * lp).sum(-1) * w2).sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits.grad.float(), ref.grad.float(), rtol=2**-7, atol=2**-24)  # one bf16 ulp


# ----------------------------------------------------------------------------------------------------------------
# weight sync


def _reference_exports(weights, mode: str, seed: int):
    """Independent exports of each recorded master: RNE cast, or per-tensor SR / EF states kept across syncs."""
    states, refs = {}, []
    for master, _ in weights:
        ref = {}
        for name, m in master.items():
            if mode == "rne":
                ref[name] = m.to(torch.bfloat16)
            elif mode == "stochastic":
                state = states.setdefault(name, ExportState.seeded(tensor_seed(seed, name)))
                ref[name] = export_bf16(m, "stochastic", state)
            else:  # error feedback, from its definition: v = m + e, s = r(v), e = v - s
                v = m + states.get(name, torch.zeros_like(m))
                ref[name] = v.to(torch.bfloat16)
                states[name] = v - ref[name].float()
        refs.append(ref)
    return refs


def test_engine_weights_follow_the_policy_rne(aligned_run):
    _, rollout, capture = aligned_run
    _check_follow(capture, rollout, "rne")


@pytest.mark.parametrize("mode", ["stochastic", "error-feedback"])
def test_engine_weights_follow_the_policy_fair_cast(tmp_path, mode):
    _, rollout, capture = run_trainer(tmp_path, sync=mode, attribution_every=0)
    _check_follow(capture, rollout, mode)
    if mode == "stochastic":  # and, from SR's definition, every served value is a bf16 neighbour of its master
        for master, served in capture.weights:
            for name, m in master.items():
                near = m.to(torch.bfloat16)
                below = torch.where(near.float() <= m, near, torch.nextafter(near, near.new_tensor(-float("inf"))))
                above = torch.where(near.float() >= m, near, torch.nextafter(near, near.new_tensor(float("inf"))))
                assert bool(((served[name] == below) | (served[name] == above)).all()), name


def _check_follow(capture, rollout, mode):
    assert len(capture.weights) == rollout.syncs == 4  # attach + 3 optimizer steps
    assert mode == "rne" or capture.weights[0][0]["lm_head.weight"].dtype == torch.float32
    for (prev, _), (master, _) in zip(capture.weights, capture.weights[1:], strict=False):
        assert any(not torch.equal(prev[n], master[n]) for n in master)  # every step moved the policy
    for (master, served), ref in zip(capture.weights, _reference_exports(capture.weights, mode, 3), strict=True):
        for name in master:
            assert torch.equal(served[name], ref[name]), (mode, name)


# ----------------------------------------------------------------------------------------------------------------
# settings, patching and errors


def test_rollout_honours_trl_sampling_settings(tmp_path):
    model, tokenizer = trl_setup.policy(fp32=True)
    trainer = trl_setup.trainer(model, tokenizer, str(tmp_path), temperature=0.7, top_k=1, max_completion_length=5)
    rollout = EngineRolloutFunc(engine_profile="vllm").attach(trainer)
    prompts = [trl_setup.dataset()[0]["prompt"]] * 4
    out = rollout(prompts, trainer)
    # top_k=1 keeps one token: processed log-probs are exactly log 1 = 0, and every sample is the argmax.
    assert all(lp == 0.0 for lps in out["logprobs"] for lp in lps)
    assert len({tuple(c) for c in out["completion_ids"]}) == 1
    assert all(len(c) == 5 for c in out["completion_ids"])  # max_completion_length (no stop within 5 tokens)
    assert out["prompt_ids"][0] == tokenizer(prompts[0])["input_ids"]


@pytest.mark.parametrize(
    ("setting", "value"), [("min_p", 0.1), ("repetition_penalty", 1.1), ("generation_kwargs", {"num_beams": 2})]
)
def test_unsupported_generation_settings_are_refused(tmp_path, setting, value):
    model, tokenizer = trl_setup.policy(fp32=True)
    trainer = trl_setup.trainer(model, tokenizer, str(tmp_path), **{setting: value})
    with pytest.raises(ValueError, match=setting):
        EngineRolloutFunc().attach(trainer)


def test_usage_errors(tmp_path):
    model, tokenizer = trl_setup.policy(fp32=False)
    trainer = trl_setup.trainer(model, tokenizer, str(tmp_path), fp32=False)
    with pytest.raises(TypeError, match="fp32 master"):
        EngineRolloutFunc(sync="stochastic").attach(trainer)
    with pytest.raises(RuntimeError, match="attach"):
        EngineRolloutFunc()(["x"], trainer)
    with pytest.raises(ValueError, match="sync mode"):
        EngineRolloutFunc(sync="nearest")


def test_patch_policy_after_construction_patches_policy_and_reference_model(tmp_path):
    model, tokenizer = trl_setup.policy(fp32=True)
    trainer = trl_setup.trainer(model, tokenizer, str(tmp_path), beta=0.04)  # beta > 0: TRL builds a ref model
    patched = patch_policy(trainer, "sglang")
    assert patched is model and roundalign.patched_profile(model).name == "sglang"
    assert roundalign.patched_profile(trainer.ref_model).name == "sglang"


def _shard_and_patch(rank, world_size):
    from torch.distributed.fsdp import fully_shard

    model, _ = trl_setup.policy(fp32=True)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    try:
        patch_policy(model, "vllm")
    except ValueError as e:
        return str(e)
    return None


def test_patch_policy_refuses_an_fsdp_wrapped_model():
    from distributed import spawn_gloo

    (message,) = spawn_gloo(_shard_and_patch, 1)
    assert message is not None and "before" in message and "FSDP" in message


# ----------------------------------------------------------------------------------------------------------------
# two processes


@pytest.mark.slow
def test_ddp_two_processes_train_and_log(tmp_path):
    script = Path(__file__).with_name("trl_ddp_train.py")
    accelerate = Path(sys.executable).with_name("accelerate")
    # Not `--cpu`: with it accelerate 1.15 uses its single-process launcher (multi-CPU only through MPI), and the
    # script runs once with world size 1. `--multi_gpu` starts torchrun, and without a GPU every rank joins gloo.
    cmd = [
        str(accelerate),
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "bf16",
        "--dynamo_backend",
        "no",
        str(script),
        "--out",
        str(tmp_path),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["world_size"] == 2 and r["backend"] == "gloo" and r["device"].startswith("cpu")
        assert r["served_is_rne_of_master"] and r["syncs"] == 3
        assert r["ddp_wrapped"] and r["policy_profile"] == "vllm"
    assert ranks[0]["served_digest"] == ranks[1]["served_digest"]  # each rank's engine, the same served copy
    assert ranks[0]["completions"] != ranks[1]["completions"]  # ranks sample their own prompts and seeds
    logs0, logs1 = ranks[0]["logs"], ranks[1]["logs"]
    assert len(logs0) == 2
    for a, b in zip(logs0, logs1, strict=True):
        for key in (
            "rollout_corr/k3_kl",
            "sampling/sampling_logp_difference/mean",
            "sync/visible_fraction",
            "attribution/base/k3_kl",
            "prefill/k3_kl",
        ):
            assert key in a and a[key] == b[key], key  # gathered over both ranks: the same number on each
        assert a["attribution/target/prefill_k3_kl"] < a["attribution/base/prefill_k3_kl"]
