"""End-to-end probe: the acceptance facts the audit rests on, on a small random Qwen3 saved to disk.

- kernels backend, trainer profile == engine profile, prefill reference: every log-prob bitwise equal, k3_kl 0;
  per-layer hidden states bitwise equal; the decode-shape experiment with attention and matmuls computed as in
  prefill is bitwise equal too.
- stock ``hf`` against a ``vllm`` engine is not exact, and the attribution accounts for it region by region.
- a JSONL import of what the engine sampled gives the same numbers as the engine's own decode reference.
"""

from __future__ import annotations

import math

import pytest
import torch

from roundalign.probe.run import ProbeConfig, run_probe
from roundalign.rollouts import Rollout, write_engine_logprobs
from roundalign.trainer import TrainerSide, load_trainer_model
from tests.vllm_native import tiny_qwen3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3")
    tiny_qwen3(seed=3, num_hidden_layers=3, vocab_size=256).save_pretrained(path)
    return path


def _prompts(n=5, vocab=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, vocab, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


def _cmp(report, trainer, backend, reference):
    for c in report["comparisons"]:
        if (c["trainer_profile"], c["backend"], c["reference"]) == (trainer, backend, reference):
            return c["metrics"]
    raise KeyError((trainer, backend, reference))


@pytest.mark.parametrize("engine_profile", ["vllm", "sglang", "aligned", "hf"])
def test_trainer_equals_engine_at_prefill_kernels(model_dir, engine_profile):
    cfg = ProbeConfig(
        model=str(model_dir),
        engine_profile=engine_profile,
        trainer_profiles=(engine_profile,),
        backends=("kernels",),
        prompts=_prompts(),
        num_samples=5,
        max_tokens=10,
        seed=1,
        layer_sequences=2,
    )
    report, _ = run_probe(cfg)
    m = _cmp(report, engine_profile, "kernels", "prefill")
    assert m["mismatch/bitwise_equal_frac"] == 1.0
    assert m["rollout_corr/k3_kl"] == 0.0
    assert m["sampling/sampling_logp_difference/max"] == 0.0
    (layers,) = report["layers"]
    assert all(row["equal_frac"] == 1.0 and row["max_ulp"] == 0 for row in layers["layers"])
    both = [v for v in report["decode_shapes"]["variants"] if set(v["prefill_shaped"]) == {"attention", "matmul"}]
    assert both[0]["metrics"]["mismatch/bitwise_equal_frac"] == 1.0


def test_hf_trainer_against_vllm_engine_is_attributed(model_dir):
    cfg = ProbeConfig(
        model=str(model_dir),
        engine_profile="vllm",
        trainer_profiles=("hf", "vllm"),
        backends=("kernels",),
        prompts=_prompts(8),
        num_samples=8,
        max_tokens=12,
        seed=2,
        layer_sequences=2,
    )
    report, arrays = run_probe(cfg)
    hf = _cmp(report, "hf", "kernels", "prefill")
    assert hf["mismatch/bitwise_equal_frac"] < 1.0  # stock HF rounds elsewhere: some log-probs differ
    assert hf["mismatch/log_ratio_rms"] > 0
    (entry,) = [a for a in report["attribution"] if a["reference"] == "prefill"]
    assert entry["target"] == 0.0  # the whole engine profile removes the prefill mismatch entirely
    assert entry["base"] == hf["mismatch/log_ratio_rms"]
    by_region = {r["region"]: r for r in entry["regions"]}
    assert set(by_region) == {"rms_norm", "qk_norm", "residual", "rope", "swiglu"}  # no MoE experts in Qwen3
    for r in by_region.values():
        assert r["same_rule"] is False  # hf and vllm differ in every dense Qwen3 region
        assert r["share"] is not None and math.isfinite(r["share"])
    hf_layers = next(x for x in report["layers"] if x["trainer_profile"] == "hf")["layers"]
    assert hf_layers[-1]["equal_frac"] < 1.0 and hf_layers[-1]["max_ulp"] > 0
    assert len(arrays["log_ratios"]["hf vs kernels/prefill"]) == report["tokens"]["completion_tokens"]


def test_kernels_are_attributed_beside_the_regions(model_dir):
    """The default engine (vllm-reference-kernels) against the rounding rules alone: no rounding region differs, so
    the attribution's two kernel entries carry the gap, and both together (the engine profile) close it."""
    cfg = ProbeConfig(
        model=str(model_dir), trainer_profiles=("vllm",), prompts=_prompts(4), num_samples=4, max_tokens=12,
        layer_sequences=0,
    )  # fmt: skip
    report, _ = run_probe(cfg)
    assert report["engine"]["profile"]["name"] == "vllm-reference-kernels"
    for entry in report["attribution"]:  # decode and prefill
        assert entry["trainer_profile"] == "vllm" and entry["target"] == 0.0
        by_region = {r["region"]: r for r in entry["regions"]}
        assert [r for r, e in by_region.items() if not e["same_rule"]] == ["attention", "gemm"]
        assert (by_region["attention"]["trainer_rule"], by_region["attention"]["engine_rule"]) == ("hf", "reference")
        assert (by_region["gemm"]["trainer_rule"], by_region["gemm"]["engine_rule"]) == ("torch", "reference")
        # Two kernels: the engine profile with only attention put back is the trainer with only gemm switched.
        assert by_region["attention"]["alone"] == by_region["gemm"]["value"]
        assert by_region["gemm"]["alone"] == by_region["attention"]["value"]
        assert entry["base"] > 0  # the random test model: HF's kernels are not the engine's decode ones


def test_jsonl_import_matches_the_engine_decode_reference(model_dir, tmp_path):
    cfg = ProbeConfig(
        model=str(model_dir),
        engine_profile="vllm",
        trainer_profiles=("hf",),
        backends=("kernels",),
        prompts=_prompts(4),
        num_samples=4,
        max_tokens=8,
        seed=4,
        layer_sequences=0,
    )
    report, arrays = run_probe(cfg)
    dump = tmp_path / "dump.jsonl"
    write_engine_logprobs(dump, [Rollout(r.prompt_token_ids, r.token_ids, r.logprobs) for r in arrays["rollouts"]])
    imported, _ = run_probe(
        ProbeConfig(model=str(model_dir), engine_profile="vllm", trainer_profiles=("hf",), engine_logprobs=str(dump))
    )
    assert _cmp(imported, "hf", "jsonl", "jsonl") == _cmp(report, "hf", "kernels", "decode")
    assert imported["layers"] == [] and imported["decode_shapes"] is None
    assert any("imported" in n for n in imported["notes"])


def test_trainer_hidden_states_are_the_pre_norm_residual(model_dir):
    """The last layer's hidden state is the residual before the final norm (HF's last entry is after it)."""
    model = load_trainer_model(model_dir)
    ids = _prompts(1)[0]
    side = TrainerSide(model)
    hidden = side.hidden_states("hf", ids)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    assert len(hidden) == model.config.num_hidden_layers
    for i in range(len(hidden) - 1):
        assert torch.equal(hidden[i], out.hidden_states[i + 1][0])
    assert torch.equal(model.model.norm(hidden[-1][None])[0], out.hidden_states[-1][0])
    # and the teacher-forced log-probs are HF's own logits' log-softmax at the completion positions
    r = Rollout(ids[:3], ids[3:])
    (lp,) = side.logprobs("hf", [r])
    ref = out.logits[0].float().log_softmax(-1)[2:-1].gather(-1, torch.tensor(ids[3:])[:, None])[:, 0]
    assert torch.equal(lp, ref)


def test_shipped_model_acceptance():
    """The acceptance fact on the shipped tiny-qwen3 with its default prompts: kernels backend, trainer profile ==
    engine profile, prefill reference: every log-prob bitwise equal, k3_kl exactly 0. Stock HF is not."""
    cfg = ProbeConfig(
        engine_profile="vllm",
        trainer_profiles=("hf", "vllm"),
        backends=("kernels",),
        num_samples=8,
        max_tokens=32,
        layer_sequences=0,
    )
    report, _ = run_probe(cfg)
    assert report["tokens"]["completion_tokens"] > 50
    aligned = _cmp(report, "vllm", "kernels", "prefill")
    assert aligned["mismatch/bitwise_equal_frac"] == 1.0 and aligned["rollout_corr/k3_kl"] == 0.0
    stock = _cmp(report, "hf", "kernels", "prefill")
    assert stock["mismatch/bitwise_equal_frac"] < 1.0 and stock["rollout_corr/k3_kl"] > 0.0
    # a peaked model, as a real LM: mean entropy of the sampled positions far below log(vocab)
    assert report["tokens"]["mean_entropy_nats"] < 0.25 * report["tokens"]["log_vocab"]


def test_the_run_advances_through_the_planned_stages_exactly(model_dir):
    from roundalign.probe.run import _Stages, stages

    cfg = ProbeConfig(
        model=str(model_dir),
        engine_profile="vllm",
        trainer_profiles=("hf", "vllm"),
        backends=("kernels",),
        prompts=_prompts(),
        num_samples=2,
        max_tokens=4,
        layer_sequences=1,
    ).validate()
    seen = []
    run_probe(cfg, lambda description, total: seen.append((description, total)))
    planned = stages(cfg)
    assert [d for d, _ in seen] == planned
    assert {t for _, t in seen} == {len(planned)}
    assert planned[0] == "loading the model" and planned[-1] == "decode shapes (attention vs matmul)"
    assert "region attribution (hf -> vllm)" in planned and "region attribution (vllm -> vllm)" not in planned
    tick = _Stages(["a", "b"], None)
    tick("a")
    with pytest.raises(RuntimeError, match="ran 'c', but stages\\(\\) planned 'b'"):
        tick("c")
    with pytest.raises(RuntimeError, match="ran 1 of the 2 stages"):
        tick.finish()
