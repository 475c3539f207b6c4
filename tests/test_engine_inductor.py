"""The inductor backend: vLLM's forward_native model compiled piecewise, run through the engine's KV cache.

Invariants (the engine mechanics, ragged batches and the decode replay, are tested for both backends in
tests/test_engine_generate.py):
- one compiled graph serves every step (prefill of any length, decode of any batch, a padded one-token step), a
  second engine of the same shapes reuses it, and ``load_weights`` updates it in place without a recompile;
- its rounding points are the compiler's: its prefill log-probs agree with the trainer patched with the ``vllm``
  profile (the measured rules of the piecewise compile) far more often than with stock HF's or with the
  ``normalize_fp32_sum`` rule, but not everywhere (docs/engine.md);
- capturing the hidden states (an extra graph output) leaves the log-probs unchanged.
"""

from __future__ import annotations

import pytest
import torch

import roundalign
from roundalign.engine import Engine, SamplingParams
from tests.helpers import assert_bitwise_equal
from tests.test_engine_matches_trainer import sequences, trainer_logprobs, trainer_model

pytestmark = pytest.mark.slow  # compiles with Inductor

# A shape of its own (vocab 384), so that this module's engine compiles its graph whatever ran before.
SHAPE = dict(num_hidden_layers=2, vocab_size=384)


@pytest.fixture(scope="module")
def model():
    return trainer_model("qwen3", **SHAPE)


@pytest.fixture(scope="module")
def engine(model):
    eng = Engine(model, backend="inductor")
    eng.generate(sequences(eng.vocab_size, lengths=(3, 17, 9)), SamplingParams(temperature=0, max_tokens=2))
    print(f"inductor backend, 2-layer model: {eng.compile_stats}")
    return eng


def test_one_graph_for_every_step(engine):
    before = dict(engine.compile_stats)
    prompts = sequences(engine.vocab_size, lengths=(1, 5, 40), seed=2)
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6))  # decode batches of 3, then fewer
    engine.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=3))  # one-token prefill and decode
    assert engine.compile_stats == before
    assert before["graphs"] == 1 and before["pieces"] == 3  # 2 layers: 3 pieces around 2 attention ops


def _fraction_equal(engine, model, profile, seqs, split=3, **overrides) -> float:
    roundalign.apply(model, profile, **overrides)
    try:
        equal = total = 0
        for ids in seqs:
            ref = trainer_logprobs(model, ids)[split - 1 : -1].gather(1, torch.tensor(ids[split:])[:, None])[:, 0]
            (got,) = engine.score([ids[:split]], [ids[split:]], mode="prefill")
            equal += int((got == ref).sum())
            total += got.numel()
    finally:
        roundalign.revert(model)
    return equal / total


def test_prefill_follows_the_measured_vllm_rules(engine, model):
    seqs = sequences(engine.vocab_size, lengths=(16, 40, 64, 24, 48), seed=11)
    vllm = _fraction_equal(engine, model, "vllm", seqs)
    hf = _fraction_equal(engine, model, "hf", seqs)
    every_add = _fraction_equal(engine, model, "vllm", seqs, residual="normalize_fp32_sum")
    print(
        f"inductor prefill log-probs bitwise equal to the trainer: vllm {vllm:.1%}, "
        f"vllm with normalize_fp32_sum {every_add:.1%}, stock HF {hf:.1%}"
    )
    assert vllm >= 0.5
    assert vllm >= max(hf, every_add) + 0.3


def test_hidden_states_capture_leaves_logprobs_unchanged(engine):
    ids = sequences(engine.vocab_size, lengths=(33,), seed=8)[0]
    graphs = engine.compile_stats["graphs"]
    plain = engine._prefill_logprobs(ids)
    captured, hidden = engine._prefill_logprobs(ids, capture=True)
    assert engine.compile_stats["graphs"] <= graphs + 1  # the capture variant: one more graph, at most
    assert_bitwise_equal(captured, plain)
    assert [tuple(h.shape) for h in hidden] == [(33, engine.config.hidden_size)] * engine.config.num_hidden_layers
    assert all(h.dtype == torch.bfloat16 for h in hidden)
    assert all(torch.equal(a, b) for a, b in zip(engine.hidden_states(ids), hidden, strict=True))


def test_hidden_states_close_to_the_kernels_backend(engine, model):
    """Same weights, vllm-profile formulas vs the compiler: most elements agree bitwise, layer by layer."""
    ids = sequences(engine.vocab_size, lengths=(40,), seed=9)[0]
    kernels = Engine(model, profile="vllm").hidden_states(ids)
    for i, (a, b) in enumerate(zip(engine.hidden_states(ids), kernels, strict=True)):
        frac = (a == b).float().mean().item()
        print(f"layer {i}: {frac:.2%} of hidden-state elements bitwise equal (inductor vs kernels/vllm)")
        assert frac >= 0.9


def test_engines_share_the_graph_and_load_weights_in_place(engine, model):
    ids = sequences(engine.vocab_size, lengths=(20,), seed=10)[0]
    (ref,) = engine.score([ids[:4]], [ids[4:]])
    other = Engine(trainer_model("qwen3", seed=1, **SHAPE), backend="inductor")
    (before,) = other.score([ids[:4]], [ids[4:]])
    assert not torch.equal(before, ref)
    other.load_weights(model.state_dict())
    (after,) = other.score([ids[:4]], [ids[4:]])
    assert_bitwise_equal(after, ref)
    assert other.compile_stats["graphs"] == 0  # reused the first engine's compiled graph
