"""Batched generation: ragged prompts, stopping, seeds, and the decode/prefill references.

Invariants (the first three for both backends, the rest on the kernels backend):
- a ragged batch gives each sequence the tokens and log-probs it gets alone (greedy), so positions, the per-slot
  KV cache and its mask are right, and the decode attention is batch-invariant; decode log-probs stay close to the
  one-sequence prefill's (close, not equal: that gap is what the probe measures);
- ``score(mode="decode")`` replays ``generate`` bitwise;
- with ``prefill_shaped=("attention", "matmul")`` the replay is the prefill bitwise;
- stop tokens are kept with their log-prob; EOS, max_tokens and the context limit set ``finish_reason``;
- seeded runs reproduce.
"""

from __future__ import annotations

import pytest
import torch

from roundalign.engine import Engine, SamplingParams
from tests.cpu_kernels import gemm_rows_matter
from tests.helpers import assert_bitwise_equal
from tests.test_engine_matches_trainer import sequences, trainer_model

LENGTHS = (3, 17, 9, 30)
TOKENS = 8  # greedy completion length


@pytest.fixture(scope="module")
def model():
    return trainer_model("qwen3", num_hidden_layers=2)


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, profile="vllm")


@pytest.fixture(scope="module", params=["kernels", pytest.param("inductor", marks=pytest.mark.slow)])
def any_backend(model, request):
    return Engine(model, profile="vllm", backend=request.param)


def _greedy_batch(engine):
    prompts = sequences(engine.vocab_size, lengths=LENGTHS)
    return prompts, engine.generate(prompts, SamplingParams(temperature=0, max_tokens=TOKENS))


@pytest.fixture(scope="module")
def greedy_batch(engine):
    return _greedy_batch(engine)


def test_ragged_batch_greedy_equals_each_prompt_alone(any_backend):
    prompts, outs = _greedy_batch(any_backend)
    for p, out in zip(prompts, outs, strict=True):
        (alone,) = any_backend.generate([p], SamplingParams(temperature=0, max_tokens=TOKENS))
        assert out.prompt_token_ids == p
        assert out.token_ids == alone.token_ids
        assert out.logprobs == alone.logprobs  # bitwise: a sequence's kernel calls are the ones it gets alone
        assert len(out.token_ids) == len(out.logprobs) == TOKENS and out.finish_reason == "length"
    assert len({tuple(o.token_ids) for o in outs}) == len(outs)  # not one degenerate output for every prompt

    # Batched decode vs each sequence alone in one forward: the same model and tokens, other attention shapes.
    # A position or mask error would move log-probs by O(1) nats; bf16 noise by a few logit ulps (0.016 at 4).
    prefill = any_backend.score(prompts, [o.token_ids for o in outs], mode="prefill")
    for out, ref in zip(outs, prefill, strict=True):
        diff = (torch.tensor(out.logprobs) - ref).abs().max().item()
        print(f"{any_backend.backend}: max |decode - prefill| = {diff:.4f}")
        assert diff < 0.1


def test_batch_invariance_does_not_rest_on_row_invariant_gemms(any_backend):
    """Under an emulated GEMM whose rows depend on the call's row count (as oneDNN's on an Intel Xeon with AMX, but
    on any CPU), a ragged batch still gives each prompt exactly what it gets alone: the engine never puts two
    sequences in one GEMM call. The emulation does change what a shared call would give (the last check)."""
    with gemm_rows_matter():
        prompts, outs = _greedy_batch(any_backend)
        for p, out in zip(prompts, outs, strict=True):
            (alone,) = any_backend.generate([p], SamplingParams(temperature=0, max_tokens=TOKENS))
            assert (out.token_ids, out.logprobs) == (alone.token_ids, alone.logprobs)
        w = any_backend.weights.model.layers[0].mlp.down_proj.weight
        x = torch.randn(sum(LENGTHS), w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.dtype)
        shared = torch.nn.functional.linear(x, w)
        own = torch.cat([torch.nn.functional.linear(r, w) for r in x.split(list(LENGTHS))])
        assert not torch.equal(shared, own)


def test_score_decode_replays_generate_bitwise(any_backend):
    engine = any_backend
    prompts = sequences(engine.vocab_size, lengths=LENGTHS, seed=5)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=3, stop_token_ids=[7, 11, 13])
    outs = engine.generate(prompts, params)
    assert {len(o.token_ids) for o in outs} != {1}  # sequences leave the batch at different steps
    lps = engine.score(prompts, [o.token_ids for o in outs], mode="decode")
    for out, lp in zip(outs, lps, strict=True):
        assert_bitwise_equal(lp, torch.tensor(out.logprobs))


def test_decode_with_prefill_shapes_equals_prefill(engine, greedy_batch):
    prompts, outs = greedy_batch
    completions = [o.token_ids for o in outs]
    prefill = torch.cat(engine.score(prompts, completions, mode="prefill"))
    both = torch.cat(engine.score(prompts, completions, mode="decode", prefill_shaped=("attention", "matmul")))
    assert_bitwise_equal(both, prefill)
    plain = torch.cat(engine.score(prompts, completions, mode="decode"))
    assert (plain != prefill).any()  # the decode shapes do change the log-probs: the comparison can fail
    for part in ("attention", "matmul"):
        one = torch.cat(engine.score(prompts, completions, mode="decode", prefill_shaped=(part,)))
        print(
            f"prefill_shaped={part}: {(one == prefill).float().mean():.1%} of log-probs equal the prefill "
            f"(plain decode: {(plain == prefill).float().mean():.1%})"
        )


def test_stop_token_is_kept_with_its_logprob(engine, greedy_batch):
    prompts, outs = greedy_batch
    free = outs[1].token_ids
    stop = free[4]
    first = free.index(stop)
    (out,) = engine.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=TOKENS, stop_token_ids=[stop]))
    assert out.finish_reason == "stop"
    assert out.token_ids == free[: first + 1]
    assert out.logprobs == outs[1].logprobs[: first + 1]


def test_eos_from_config_stops_unless_ignored(model, greedy_batch):
    prompts, outs = greedy_batch
    eos = outs[2].token_ids[3]
    saved = model.config.eos_token_id
    model.config.eos_token_id = eos
    try:
        engine = Engine(model, profile="vllm")
    finally:
        model.config.eos_token_id = saved
    assert eos in engine.eos_token_ids
    (out,) = engine.generate([prompts[2]], SamplingParams(temperature=0, max_tokens=TOKENS))
    assert out.finish_reason == "stop" and out.token_ids[-1] == eos
    assert len(out.token_ids) == outs[2].token_ids.index(eos) + 1
    (full,) = engine.generate([prompts[2]], SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))
    assert full.token_ids == outs[2].token_ids and full.finish_reason == "length"


def test_context_limit_finishes_with_length_and_long_prompts_are_refused():
    model = trainer_model("qwen3", num_hidden_layers=1, max_position_embeddings=32)
    engine = Engine(model, profile="vllm")
    assert engine.max_model_len == 32
    (short, near) = engine.generate([[1] * 10, [2] * 30], SamplingParams(temperature=0, max_tokens=8))
    assert len(short.token_ids) == 8 and short.finish_reason == "length"
    assert len(near.token_ids) == 2 and near.finish_reason == "length"  # 30 + 2 = max_model_len
    with pytest.raises(ValueError, match="max_model_len 32 leaves room for at most 31"):
        engine.generate([[1] * 32], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="more than max_model_len"):
        engine.score([[1] * 20], [[2] * 13])


def test_seeded_sampling_reproduces(engine):
    prompts = sequences(engine.vocab_size, lengths=(4, 12), seed=9)
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=1234)
    a, b = engine.generate(prompts, params), engine.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.logprobs for o in a] == [o.logprobs for o in b]
    c = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=6, seed=1235))
    assert [o.token_ids for o in c] != [o.token_ids for o in a]
    # seed=None: a fresh seed per call
    d, e = (engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=6)) for _ in range(2))
    assert [o.token_ids for o in d] != [o.token_ids for o in e]


def test_processed_logprobs_renormalize_over_the_kept_tokens(engine):
    """Same seed, same samples; with top_k the processed log-prob is the raw one renormalized over the top k,
    so it is never lower, and at temperature 1 without truncation the two modes agree exactly."""
    prompts = sequences(engine.vocab_size, lengths=(6, 11), seed=4)
    raw = engine.generate(prompts, SamplingParams(top_k=5, max_tokens=5, seed=0))
    proc = engine.generate(prompts, SamplingParams(top_k=5, max_tokens=5, seed=0, logprobs_mode="processed"))
    for r, p in zip(raw, proc, strict=True):
        assert r.token_ids == p.token_ids
        assert all(pl >= rl for pl, rl in zip(p.logprobs, r.logprobs, strict=True))
        assert any(pl > rl for pl, rl in zip(p.logprobs, r.logprobs, strict=True))
    plain = engine.generate(prompts, SamplingParams(max_tokens=5, seed=0, logprobs_mode="processed"))
    ref = engine.generate(prompts, SamplingParams(max_tokens=5, seed=0))
    assert [o.logprobs for o in plain] == [o.logprobs for o in ref]


def test_score_at_a_temperature_matches_processed_sampling_and_the_formula(engine):
    """score(temperature=T): decode mode replays generate's processed log-probs at T (top-p 1) bitwise; prefill mode
    is log_softmax(logits / T) of the prefill's own logits, checked against the T = 1 scores: log_softmax(z / T) is
    computed here from z recovered up to a per-row constant (z = logp_1 + logsumexp), in float64."""
    prompts = sequences(engine.vocab_size, lengths=(6, 11, 9), seed=8)
    outs = engine.generate(prompts, SamplingParams(temperature=0.7, max_tokens=6, seed=2, logprobs_mode="processed"))
    completions = [o.token_ids for o in outs]
    decode = engine.score(prompts, completions, mode="decode", temperature=0.7)
    for out, lp in zip(outs, decode, strict=True):
        assert_bitwise_equal(lp, torch.tensor(out.logprobs))
    warm = engine.score(prompts, completions, mode="prefill", temperature=0.7)
    cold = engine.score(prompts, completions, mode="prefill")
    assert all((w != c).any() for w, c in zip(warm, cold, strict=True))
    for p, c, w in zip(prompts, completions, warm, strict=True):
        logits = engine._prefill_logprobs(p + c)[len(p) - 1 : -1].double()  # log_softmax(z): z up to a row constant
        ref = (logits / 0.7).log_softmax(-1).gather(1, torch.tensor(c)[:, None])[:, 0]
        assert (w.double() - ref).abs().max() < 1e-5  # fp32 vs float64 evaluation of the same formula
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        engine.score(prompts, completions, temperature=0)
