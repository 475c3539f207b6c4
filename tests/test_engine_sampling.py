"""The sampler against hand-written references, its statistics, and SamplingParams validation.

References are written from the semantics, not from ``roundalign.engine.sampling``: top-k keeps every token whose
logit is at least the k-th largest; top-p keeps the most likely tokens, in order, until their probability reaches
top_p (the token that crosses it included, at least one token); processed log-probs are the log-softmax of
``logits / temperature`` restricted to the kept tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from roundalign.engine import SamplingParams
from roundalign.engine.sampling import apply_top_k_top_p, process, request_generators, sample, token_logprobs


def _logits(rows: int = 6, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return 2 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def _kept_reference(row: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """The kept token set for one row of logits, by the definitions above, in float64 loops."""
    values = [float(v) for v in row]
    order = sorted(range(len(values)), key=lambda i: -values[i])
    kept = order
    if 0 < top_k < len(values):
        kth = values[order[top_k - 1]]
        kept = [i for i in order if values[i] >= kth]
    if top_p < 1:
        m = max(values[i] for i in kept)
        z = sum(math.exp(values[i] - m) for i in kept)
        total, chosen = 0.0, []
        for i in kept:  # most likely first
            chosen.append(i)
            total += math.exp(values[i] - m) / z
            if total >= top_p:
                break
        kept = chosen
    return set(kept)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (1, 1.0), (5, 1.0), (0, 0.5), (0, 0.9), (10, 0.7), (3, 0.99)])
def test_top_k_top_p_keeps_the_reference_set(top_k, top_p):
    logits = _logits()
    out = apply_top_k_top_p(logits, top_k, top_p)
    for row, got in zip(logits, out, strict=True):
        kept = set(torch.nonzero(got > -float("inf")).flatten().tolist())
        assert kept == _kept_reference(row, top_k, top_p)
        assert torch.equal(got[list(kept)], row[list(kept)])  # kept logits are untouched


def test_top_k_keeps_ties_with_the_kth_logit():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    out = apply_top_k_top_p(logits, 2, 1.0)
    assert (out > -float("inf")).tolist() == [[True, False, True, True, False]]


def test_top_p_always_keeps_the_most_likely_token():
    logits = torch.tensor([[10.0, 0.0, 0.0]])  # the top token alone has p ~ 0.9999 >= any top_p below it
    out = apply_top_k_top_p(logits, 0, 1e-6)
    assert (out > -float("inf")).tolist() == [[True, False, False]]


def test_processed_logprobs_are_the_tempered_truncated_softmax():
    logits = _logits(rows=3)
    params = SamplingParams(temperature=0.7, top_k=8, top_p=0.8)
    processed = process(logits, params)
    tokens = processed.argmax(-1)
    got = token_logprobs(logits, processed, tokens, "processed")
    for r in range(3):
        keep = torch.zeros(logits.shape[1], dtype=torch.bool)
        keep[sorted(_kept_reference(logits[r] / 0.7, 8, 0.8))] = True
        ref = torch.where(keep, logits[r] / 0.7, -float("inf")).log_softmax(-1)[tokens[r]]
        assert torch.equal(got[r], ref)
    raw = token_logprobs(logits, processed, tokens, "raw")
    assert torch.equal(raw, logits.log_softmax(-1).gather(1, tokens[:, None])[:, 0])


def test_greedy_is_argmax_and_top_k_1_is_greedy():
    logits = _logits(rows=8)
    gens = request_generators(0, 8)
    greedy = sample(process(logits, SamplingParams(temperature=0)), SamplingParams(temperature=0), gens)
    assert torch.equal(greedy, logits.argmax(-1))
    p = SamplingParams(temperature=1.3, top_k=1)
    assert torch.equal(sample(process(logits, p), p, request_generators(1, 8)), greedy)
    # greedy ignores top-k/top-p, and its processed log-probs are the raw ones
    g = SamplingParams(temperature=0, top_k=3, top_p=0.5)
    assert torch.equal(process(logits, g), logits)


def test_sample_frequencies_match_the_distribution():
    """10000 draws from one 6-token distribution (top-k 5 drops one token): every frequency within 5 standard
    deviations of its probability, and the dropped token never drawn."""
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])
    params = SamplingParams(temperature=0.8, top_k=5)
    probs = process(logits, params).softmax(-1)[0]
    n = 10000
    draws = [int(sample(process(logits, params), params, [g])) for g in request_generators(7, n)]
    counts = torch.bincount(torch.tensor(draws), minlength=6).double()
    assert counts[5] == 0
    for c, p in zip(counts.tolist(), probs.double().tolist(), strict=True):
        assert abs(c / n - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-12


def test_a_rows_sample_depends_on_its_own_generator_only():
    """Row 0 sampled in a batch equals row 0 sampled alone with the same (seed, index) generator."""
    logits = _logits(rows=4, vocab=200)
    params = SamplingParams(temperature=1.0)
    batch = sample(process(logits, params), params, request_generators(5, 4))
    for i in range(4):
        alone = sample(process(logits[i : i + 1], params), params, [request_generators(5, 4)[i]])
        assert int(alone) == int(batch[i])
    gens_a, gens_b = request_generators(5, 2), request_generators(5, 3)
    assert torch.equal(torch.rand(4, generator=gens_a[1]), torch.rand(4, generator=gens_b[1]))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_tokens=0), "max_tokens must be an int > 0"),
        (dict(max_tokens=-3), "max_tokens must be an int > 0"),
        (dict(max_tokens=2.0), "max_tokens must be an int > 0"),
        (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
        (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-2), "top_k must be an int"),
        (dict(top_k=2.5), "top_k must be an int"),
        (dict(seed="1"), "seed must be an int or None"),
        (dict(stop_token_ids=[-1]), "stop_token_ids must be non-negative ints"),
        (dict(logprobs_mode="logits"), "logprobs_mode must be one of"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_and_normalization():
    p = SamplingParams(stop_token_ids=[3, 4])
    assert p.stop_token_ids == (3, 4) and p.logprobs_mode == "raw" and not p.greedy
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=-1).top_k == -1
