"""Exactly on-policy with a quantized sampler: the real vLLM serves the checkpoint roundalign writes, and the trainer
with the scheme's exact profile computes its sampler's log-probs bit for bit.

vLLM's CPU build (.venv-vllm) serves W8A8 int8, W4A16 (groups of 128, and of 32 with zero points) and FP8 from
compressed-tensors checkpoints; ``roundalign dump --quantization SCHEME`` quantizes the bf16 model into one and
samples from it in ``enforce_eager`` mode. The trainer side (tests/kernels_trainer.py, in the engine's Python)
applies ``<build>-kernels+quantization=SCHEME``: the build's rounding rules, vLLM's attention, and each linear
through vLLM's own quantized layer. Three models: the shipped Qwen3 (head_dim 64, confident), a random Llama
(head_dim 128, about 2 nats of entropy) and a random Qwen2 (biases on q/k/v). Also here: compressed-tensors itself
as an independent producer of the checkpoint, the in-place reload of a running quantized engine, and
``probe --engine vllm --quantization``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from roundalign import models
from roundalign.engines.dump import DumpConfig
from roundalign.engines.launch import run_dump
from roundalign.rollouts.dumpdir import read_dump, read_info
from tests.test_real_vllm_kernels import KERNELS, ROUNDING, TRAINER
from tests.wide_model import build_llama, build_qwen2

HERE = Path(__file__).parent
# Every scheme on a model of each shape, each kernel at least twice (one vLLM start-up per case, so not the full
# product): the shipped Qwen3 (head_dim 64), the Llama (head_dim 128) and the Qwen2 (biases on q/k/v).
CASES = [("llama", s) for s in ("w8a8-int8", "w4a16", "fp8")] + [
    ("shipped", "w8a8-int8"),
    ("shipped", "w4a16-g32-zp"),
    ("shipped", "fp8-online"),  # vLLM's own quantizer, with the FP8 kernel llama's fp8 case runs too
    ("qwen2", "w8a8-int8"),  # biases on q/k/v: vLLM's epilogue adds them in one fused multiply-add
    ("qwen2", "w4a16"),
]


def _dump(engine_python, model, out: Path, scheme: str, samples=8, tokens=40):
    cfg = DumpConfig(
        engine="vllm", model=str(model), out=str(out), enforce_eager=True, num_samples=samples, max_tokens=tokens,
        ignore_eos=True, quantization=scheme,
    ).validate()  # fmt: skip
    run_dump(cfg, engine_python)
    return cfg.out


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_llama(tmp_path_factory.mktemp("llama") / "model")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return build_qwen2(tmp_path_factory.mktemp("qwen2") / "model")


@pytest.fixture(scope="module", params=CASES, ids=[f"{m}-{s}" for m, s in CASES])
def exact(request, engine_python, llama, qwen2, tmp_path_factory):
    """(model dir, scheme, the engine's dump, the exact trainer's results) per model and scheme."""
    name, scheme = request.param
    tmp = tmp_path_factory.mktemp(f"quant-{name}-{scheme}")
    model = {"shipped": models.path(), "llama": llama, "qwen2": qwen2}[name]
    dump_dir = _dump(engine_python, model, tmp / "dump", scheme)
    profile = f"{KERNELS}+quantization={scheme}"
    proc = subprocess.run([engine_python, str(TRAINER), str(model), dump_dir, profile, str(tmp / "trainer.pt")],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    dump = read_dump(dump_dir, vocab_size=264, max_model_len=256 if name == "shipped" else 512)
    return model, scheme, dump_dir, dump, torch.load(tmp / "trainer.pt")


@pytest.mark.parametrize("layout", ["unpadded", "left", "right"])
def test_exact_quantized_trainer_is_the_sampler_bit_for_bit(exact, layout):
    _, scheme, _, dump, trainer = exact
    assert trainer["profile"] == f"{KERNELS}+quantization={scheme}"
    assert sum(len(r.token_ids) for r in dump.rollouts) == 8 * 40
    for mine, rollout, prefill in zip(trainer[layout], dump.rollouts, dump.prefill, strict=True):
        assert torch.equal(mine, torch.tensor(rollout.logprobs, dtype=torch.float32))  # what vLLM's sampler returned
        assert torch.equal(mine, torch.tensor(prefill, dtype=torch.float32))


def test_the_dump_served_the_quantized_checkpoint(exact):
    from roundalign.quant import SCHEMES

    model, scheme, dump_dir, _, trainer = exact
    info = read_info(dump_dir)
    assert info["quantization"] == scheme
    served = json.loads((Path(info["served_model"]) / "config.json").read_text())
    if SCHEMES[scheme].online:  # vLLM quantized the bf16 model itself at load
        assert Path(info["served_model"]) == Path(model).resolve() and "quantization_config" not in served
        assert info["linear_kernel"] == "Fp8PtpcOnlineLinearMethod"
    else:
        assert served["quantization_config"]["quant_method"] == "compressed-tensors"
        assert info["linear_kernel"] == "CompressedTensorsLinearMethod"
    # The straight-through backward gave gradients to every projection's weight, and they are finite.
    grads = trainer["step"]
    assert any(k.endswith("q_proj.weight") for k in grads)
    assert all(torch.isfinite(g).all() for g in grads.values())


def test_bf16_and_aligned_trainers_are_not_exact(exact):
    """The contrast: without the scheme, or without vLLM's kernels, tokens differ; so the equality above is the
    quantized layers' doing."""
    from roundalign.trainer import TrainerSide, load_trainer_model

    model_dir, scheme, _, dump, _ = exact
    side = TrainerSide(load_trainer_model(model_dir))
    sampler = torch.tensor([x for r in dump.rollouts for x in r.logprobs], dtype=torch.float32)
    for profile in (ROUNDING, f"{ROUNDING}+quantization={scheme}"):
        assert not torch.equal(torch.cat(side.logprobs(profile, dump.rollouts)), sampler), profile


@pytest.mark.parametrize("scheme", ["w8a8-int8", "w4a16", "w4a16-g32-zp", "fp8"])
def test_an_independent_producer_writes_the_same_checkpoint(engine_python, scheme, tmp_path):
    """compressed-tensors' own quantizer and compressor (llm-compressor's round-to-nearest recipe, no roundalign
    code) write bit for bit the tensors roundalign writes."""
    from safetensors.torch import load_file

    from roundalign.quant import SCHEMES, checkpoint

    out = tmp_path / "theirs"
    proc = subprocess.run([engine_python, str(HERE / "quant_producer.py"), str(models.path()), scheme, str(out)],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = load_file(str(out / "model.safetensors"))
    ours = checkpoint.served_state_dict(load_file(str(models.path() / "model.safetensors")), SCHEMES[scheme])
    assert set(theirs) == set(ours)
    for key, t in ours.items():
        assert t.dtype == theirs[key].dtype and t.shape == theirs[key].shape, key
        bits = (lambda x: x.view(torch.uint8)) if t.dtype == torch.float8_e4m3fn else (lambda x: x)
        assert torch.equal(bits(t), bits(theirs[key])), key
    config = json.loads((out / "config.json").read_text())
    assert checkpoint.from_compressed_tensors(config["quantization_config"]) is SCHEMES[scheme]


def test_vllm_serves_the_independent_checkpoint_as_ours(engine_python, tmp_path):
    proc = subprocess.run(
        [engine_python, str(HERE / "quant_producer.py"), str(models.path()), "w4a16-g32-zp", str(tmp_path / "theirs")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = read_dump(
        _dump(engine_python, tmp_path / "theirs", tmp_path / "d1", None, 4, 24), vocab_size=264, max_model_len=256
    )
    ours = read_dump(
        _dump(engine_python, models.path(), tmp_path / "d2", "w4a16-g32-zp", 4, 24), vocab_size=264, max_model_len=256
    )
    assert read_info(tmp_path / "d1")["quantization"] == "w4a16-g32-zp"  # read from the checkpoint's config
    for a, b in zip(theirs.rollouts, ours.rollouts, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


@pytest.mark.parametrize("scheme", ["w8a8-int8", "w4a16-zp", "fp8", "fp8-online"])
def test_a_running_engine_reloads_quantized_weights_exactly(engine_python, scheme, tmp_path):
    """After an in-place reload the engine serves what a fresh engine on the same checkpoint serves, and reloading
    the first weights gives the first log-probs back (vLLM's own reload leaves W8A8 int8 layers returning NaN)."""
    cmd = [engine_python, str(HERE / "quant_reload.py"), str(models.path()), scheme, str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "reload.json").read_text())
    assert result["reloaded"] == result["fresh"]
    assert result["back"] == result["first"]
    assert result["reloaded"] != result["first"]
    assert result["audit"] == [[], 36] and result["audit_off"] == ["model.layers.1.self_attn.qkv_proj"]


@pytest.mark.parametrize(("scheme", "sync"), [("w4a16-g32-zp", "stochastic"), ("w8a8-int8", "error-feedback")])
def test_a_running_engine_serves_the_codes_an_export_chose(engine_python, scheme, sync, tmp_path):
    """Fair Cast onto the grid: the in-place reload of an export's checkpoint tensors (stochastic rounding or error
    feedback: other codes than round-to-nearest) serves what a fresh vLLM started on the checkpoint written from
    those tensors serves, bit for bit."""
    cmd = [engine_python, str(HERE / "quant_reload.py"), str(models.path()), scheme, str(tmp_path), sync]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "reload.json").read_text())
    assert result["codes_differ"]
    assert result["audit"] == [[], 36] and result["audit_off"] == ["model.layers.1.self_attn.qkv_proj"]
    assert result["reloaded"] == result["fresh"]
    assert result["back"] == result["first"]
    assert result["reloaded"] != result["first"]


def test_probe_compares_the_four_trainers(engine_python, tmp_path):
    """``probe --engine vllm --quantization``: stock bf16, rounding only, quantization-aligned and exact, with the
    quantization among the attributed causes."""
    out = tmp_path / "probe"
    cmd = [engine_python, "-m", "roundalign", "probe", "--engine", "vllm", "--enforce-eager", "--quantization",
           "w8a8-int8", "--num-samples", "4", "--max-tokens", "16", "--no-plots", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    rows = {c["trainer_profile"]: c["metrics"] for c in report["comparisons"] if c["reference"] == "decode"}
    assert list(rows) == ["hf", ROUNDING, f"{ROUNDING}+quantization=w8a8-int8", f"{KERNELS}+quantization=w8a8-int8"]
    assert rows[f"{KERNELS}+quantization=w8a8-int8"]["mismatch/bitwise_equal_frac"] == 1.0
    assert rows["hf"]["mismatch/bitwise_equal_frac"] < 1.0
    assert any(r["region"] == "quantization" for a in report["attribution"] for r in a["regions"])


@pytest.mark.parametrize(
    ("scheme", "sync"), [("w8a8-int8", "rne"), ("w8a8-int8", "stochastic"), ("fp8", "error-feedback")]
)
def test_train_on_a_quantized_vllm_is_exactly_on_policy_every_step(engine_python, scheme, sync, tmp_path):
    """``roundalign train --engine vllm --enforce-eager --quantization SCHEME --sync SYNC``: vLLM serves the checkpoint
    written to OUT/served-model, the trainer (the build's ``-kernels`` profile with the scheme) recomputes and
    updates, and the updated weights are exported onto the grid (round to nearest, or Fair Cast's stochastic
    rounding or error feedback, whose codes the trainer then computes with) and reloaded into the running vLLM
    after every step. Every step's recompute equals the sampler's log-probs, also after updates that changed the
    served weights."""
    out = tmp_path / "run"
    argv = [engine_python, "-m", "roundalign", "train", "--engine", "vllm", "--enforce-eager", "--out", str(out)]
    argv += ["--quantization", scheme, "--sync", sync, "--steps", "3", "--prompts-per-step", "3", "--group-size", "4"]
    argv += ["--audit-served"]  # every served weight read back from vLLM after every sync
    argv += ["--max-tokens", "24", "--level", "1", "--lr", "1e-3", "--eval-every", "0", "--eval-problems", "4"]
    proc = subprocess.run([*argv, "--quiet", "--no-tensorboard"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert config["trainer_profile"] == f"{KERNELS}+quantization={scheme}"
    assert json.loads((out / "served-model" / "config.json").read_text())["quantization_config"]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        # 4 layers x (4 fused linears, 4 norms), embeddings, final norm, lm_head (as a tensor and through its GEMM)
        assert m["sync/served_checked"] == 36
        assert m["rollout_corr/k3_kl"] == 0.0 and m["mismatch/bitwise_equal_frac"] == 1.0
        assert m["rollout_corr/raw_is_min"] == m["rollout_corr/raw_is_max"] == 1.0
    # an update that reached the engine before a later step's sampling (SR and EF move codes at every export)
    changed = [a["sync/update_transfer"] is not None and a["sync/visible_fraction"] > 0.1 for a in steps[:-1]]
    assert any(changed), "no step changed the served weights; raise the learning rate"


def test_quant_cost_benchmark_runs_and_reports(engine_python, tmp_path):
    """benchmarks/quant_cost.py (make bench) in the engine's Python: a smoke run of one scheme with every trainer
    and pass against stock in the same run, the export modes against the bf16 cast, and the report's block. No
    timing assertions."""
    bench = HERE.parent / "benchmarks"
    out = tmp_path / "quant.json"
    argv = [engine_python, str(bench / "quant_cost.py"), "--quick", "--schemes", "w8a8-int8", "--json", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert {(r["variant"], r["pass"]) for r in data["train"]} == {
        (v, p) for v in ("stock", "rounding", "exact") for p in ("train step", "first recompute", "recompute")
    }
    assert {r["profile"] for r in data["train"] if r["variant"] == "exact"} == {f"{KERNELS}+quantization=w8a8-int8"}
    assert [(r["set"], r["scheme"]) for r in data["export"]] == [("tiny", s) for s in ("w8a8-int8", "w4a16", "fp8")]
    for r in data["export"]:
        assert set(r["ratio"]) == {"bf16 rne", "rne", "stochastic", "error-feedback"} and r["ratio"]["bf16 rne"] == 1
    page = tmp_path / "bench.md"
    page.write_text("<!-- bench:quant -->\n<!-- /bench:quant -->\n")
    report = subprocess.run(
        [engine_python, str(bench / "report.py"), "--quant", str(out), "--out", str(page)],
        capture_output=True,
        text=True,
    )
    assert report.returncode == 0, report.stderr[-3000:]
    text = page.read_text()
    assert "| w8a8-int8 | tiny-qwen3 | 2x32 | train step | quantization-aligned |" in text
    assert "| tiny (3.3M) | fp8 |" in text
