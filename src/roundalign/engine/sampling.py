"""Sampling parameters, the sampler, and the two log-prob modes, with vLLM's semantics.

Per step the engine hands the sampler fp32 logits ``(sequences, vocab)`` (the 16-bit lm_head output, upcast). Then,
as vLLM's V1 sampler does:

1. temperature: ``logits / temperature``; ``temperature == 0`` is greedy (argmax of the raw logits, and top-k/top-p
   do not apply, since the argmax is always kept);
2. top-k, then top-p on what top-k left (``apply_top_k_top_p``): top-k keeps every logit >= the k-th largest;
   top-p keeps the smallest set of most likely tokens whose probability sums to at least ``top_p``, and always at
   least one token. Everything else becomes -inf;
3. a sample: ``argmax(probs / q)`` with ``q ~ Exp(1)`` drawn from the sequence's own ``torch.Generator`` (vLLM's
   ``random_sample``), which is a draw from ``probs``.

Each sequence owns a generator seeded from ``(seed, its index in the request)``, so a seeded run reproduces and a
sequence's samples do not depend on the other sequences of the batch.

Log-prob of the sampled token, like vLLM's ``logprobs_mode``:

- ``raw``: ``log_softmax`` of the raw logits over the full vocabulary (what the trainer computes: temperature 1,
  no truncation). The probe compares these (docs/engine.md).
- ``processed``: ``log_softmax`` of the processed logits (after temperature, top-k, top-p). For greedy requests,
  which skip processing, it equals ``raw``.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from dataclasses import dataclass

import torch

from roundalign.errors import UserError

LOGPROBS_MODES = ("raw", "processed")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """What to sample and when to stop. Validated on construction.

    Fields:
        temperature: >= 0; 0 means greedy.
        top_p: in (0, 1]; 1 keeps every token.
        top_k: 0 or -1 keep every token; k > 0 keeps the k most likely (ties with the k-th included).
        max_tokens: > 0, the most tokens a completion gets.
        seed: an int for reproducible sampling; None draws a fresh seed per call.
        stop_token_ids: extra ids that end a completion (kept in it, with their log-prob), besides the model's EOS.
        logprobs_mode: "raw" or "processed" (module docstring).
        ignore_eos: do not stop at the model's EOS ids (benchmarks use this for fixed-length completions).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    logprobs_mode: str = "raw"
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise UserError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise UserError(f"top_p must be in (0, 1] (1 keeps every token), got {p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise UserError(
                f"top_k must be an int: 0 or -1 to keep every token, k > 0 for the k most likely; got {self.top_k!r}"
            )
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise UserError(f"max_tokens must be an int > 0, got {self.max_tokens!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise UserError(f"seed must be an int or None, got {self.seed!r}")
        if self.stop_token_ids is not None:
            ids = tuple(self.stop_token_ids)
            if not all(_is_int(i) and i >= 0 for i in ids):
                raise UserError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
            object.__setattr__(self, "stop_token_ids", ids)
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise UserError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """vLLM's ``apply_top_k_top_p`` for one k and p: every logit outside the kept set becomes -inf."""
    if top_k <= 0 and top_p >= 1:
        return logits
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if 0 < top_k < logits.shape[-1]:
        kth = logits_sort[:, -top_k].unsqueeze(1)  # the k-th largest; ties with it stay
        logits_sort = logits_sort.masked_fill(logits_sort < kth, -float("inf"))
    if top_p < 1:
        probs_sum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        # Drop the least likely tokens whose mass together stays <= 1 - p; the most likely token always stays.
        drop = probs_sum <= 1 - top_p
        drop[:, -1] = False
        logits_sort = logits_sort.masked_fill(drop, -float("inf"))
    return logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)


def process(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k/top-p, on fp32 ``(sequences, vocab)`` logits. Greedy requests are not processed."""
    if params.greedy:
        return logits
    return apply_top_k_top_p(logits / params.temperature, params.top_k, params.top_p)


def sample(processed: torch.Tensor, params: SamplingParams, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row: argmax for greedy, else ``argmax(probs / q)`` with ``q ~ Exp(1)`` per row's generator."""
    if params.greedy:
        return processed.argmax(dim=-1)
    probs = processed.softmax(dim=-1)
    q = torch.empty_like(probs)
    for row, g in enumerate(generators):
        q[row].exponential_(generator=g)
    return probs.div(q).argmax(dim=-1)


def token_logprobs(logits: torch.Tensor, processed: torch.Tensor, tokens: torch.Tensor, mode: str) -> torch.Tensor:
    """The log-prob of each row's token under ``mode``: fp32, one per row."""
    src = logits if mode == "raw" else processed
    return src.log_softmax(dim=-1).gather(1, tokens[:, None])[:, 0]


def request_seeds(seed: int, n: int) -> list[int]:
    """One seed per sequence, derived from ``(seed, index)``: the requests of a batch sample independently, and the
    same (seed, index) always gives the same stream (a real engine's per-request seeds take these too)."""
    return [int.from_bytes(hashlib.sha256(f"{seed}:{i}".encode()).digest()[:8], "little") >> 1 for i in range(n)]


def request_generators(seed: int | None, n: int) -> list[torch.Generator]:
    """One generator per sequence, seeded by ``request_seeds``; a fresh random seed when ``seed`` is None."""
    base = secrets.randbits(63) if seed is None else seed
    return [torch.Generator().manual_seed(s) for s in request_seeds(base, n)]
