"""``fit``: which rounding profile reproduces an engine's dumped log-probs.

For each candidate (``roundalign.fit.space``) the trainer model is patched with its rules and every dumped
completion is re-scored teacher-forced, in prefill, one sequence per forward (``TrainerSide.token_logprobs``, what
``roundalign probe`` and an RL trainer compute). Candidates are ranked by agreement with the dump:

1. ``mismatch/bitwise_equal_frac``, the fraction of tokens whose fp32 log-prob equals the engine's bit for bit;
2. ``rollout_corr/k3_kl``, then ``mismatch/log_ratio_rms`` (verl's and the probe's definitions).

When no candidate reproduces even ``BITWISE_FLOOR`` of the tokens bitwise (an engine on other matmul/attention
kernels), the ranking starts at k3_kl instead: a handful of coincidentally equal tokens should not decide.

Time is one forward per (candidate, sequence), so it grows with candidates x tokens. Pruning (on unless
``exhaustive``): all candidates are first scored on a screening prefix of the dump (``screen_tokens``); for each
region, an option whose *best* candidate is beaten by the overall best's on a clear majority of the tokens where
the two differ (a sign test, z >= ``prune_z``) is dropped, with every candidate that uses it. A candidate with
log-probs identical to the best's on the screen is never dropped (no token tells them apart). The survivors are
scored on the rest. ``exhaustive=True`` scores every candidate on every token: the search provably covers the space.

Before ranking, the dump is checked against the model (``model_check``): is it as close to the best candidate as
rounding rules and kernels put log-probs of the same model? The statistic is the 90th percentile over tokens of
|log-ratio|, robust to the few tokens where one flipped bit has spread along a sequence, and sensitive to a dense
shift of every token, which is what another checkpoint, processed log-probs or another tokenizer cause. Its unit is
the larger of the rounding scale (the median of the same statistic between the best candidate and every other) and,
when rounding alone does not explain the dump, the kernel scale: the best candidate recomputed by the trainer with
a sampler's kernel shapes (``TrainerSide.decode_logprobs``: one-row GEMMs, one-query attention over a KV cache),
which measures what kernels alone do on the machine at hand. A dump beyond ``max_excess`` times that raises
``DumpNotExplained`` with the evidence instead of a fitted profile (docs/fit.md has the calibration, on both kinds
of CPU behaviour).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import roundalign
from roundalign.errors import UserError
from roundalign.fit.space import Candidate, Space
from roundalign.fit.verdict import KEYS, fitted_profile, margin, regions_verdict, sign_test
from roundalign.numerics.metrics import mismatch_metrics
from roundalign.rollouts import Rollout
from roundalign.trainer import TrainerSide

BITWISE_FLOOR = 0.05


class DumpNotExplained(ValueError):
    """The dump differs from every candidate by far more than rounding rules can: ``evidence`` says how much."""

    def __init__(self, message: str, evidence: dict):
        super().__init__(message)
        self.evidence = evidence


@dataclass(eq=False)  # compared by identity: it holds tensors
class Scored:
    """A candidate's log-probs (per sequence index) and its metrics on the tokens scored so far."""

    candidate: Candidate
    logprobs: dict[int, torch.Tensor] = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)

    def cat(self, idxs) -> torch.Tensor:
        return torch.cat([self.logprobs[i] for i in idxs])


@dataclass
class FitResult:
    space: Space
    rank_by: str  # "bitwise" or "k3_kl"
    ranking: list[Scored]  # the candidates scored on the whole dump, best first
    equivalents: list[Candidate]  # bitwise-identical to the best on the whole dump (the best included)
    runner_up: Scored | None
    margin: dict
    regions: dict[str, dict]  # searched region -> rule, status (determined / identical / unclear), evidence
    named_matches: list[str]  # built-in profiles in the best's equivalence class
    pruned: list[dict]  # one entry per dropped (region, rule), with its evidence
    excess: dict  # the wrong-model check
    profile: roundalign.Profile
    stats: dict  # tokens, sequences, forwards, seconds

    @property
    def best(self) -> Scored:
        return self.ranking[0]

    @property
    def undetermined(self) -> dict[str, str]:
        """Region -> why the data does not decide it: the regions not exercised, and those not ``determined``."""
        return {**self.space.idle, **{r: d["why"] for r, d in self.regions.items() if d["status"] != "determined"}}


class _Scorer:
    """Scores candidates on sequences not scored yet, counting forwards (the search's unit of time)."""

    def __init__(
        self, trainer: TrainerSide, space: Space, rollouts: list[Rollout], progress: Callable[[int], None] | None
    ):
        self.trainer, self.space, self.rollouts = trainer, space, rollouts
        self.progress = progress or (lambda n: None)
        self.forwards = 0
        self.decode_forwards = 0  # the model check's kernel scale: one small forward per token

    def decode(self, entry: Scored, idxs: list[int]) -> list[torch.Tensor]:
        """The candidate's log-probs on ``idxs`` computed with a sampler's kernel shapes (one forward per token)."""
        with self.trainer.patched(self.space.profile(entry.candidate)) as model:
            out = [TrainerSide.decode_logprobs(model, self.rollouts[i]) for i in idxs]
        self.decode_forwards += sum(len(self.rollouts[i].token_ids) for i in idxs)
        return out

    def score(self, entry: Scored, idxs: list[int]) -> None:
        todo = [i for i in idxs if i not in entry.logprobs]
        if not todo:
            return
        with self.trainer.patched(self.space.profile(entry.candidate)) as model:
            for i in todo:
                entry.logprobs[i] = TrainerSide.token_logprobs(model, self.rollouts[i])
                self.forwards += 1
                self.progress(1)


def _rank_key(rank_by: str, named: set[Candidate]):
    """Sort key, best first; on equal metrics a built-in profile's candidate goes first (it names the class)."""
    if rank_by == "bitwise":
        return lambda s: (-s.metrics[KEYS[0]], s.metrics[KEYS[1]], s.metrics[KEYS[2]], s.candidate not in named)
    return lambda s: (s.metrics[KEYS[1]], s.metrics[KEYS[2]], -s.metrics[KEYS[0]], s.candidate not in named)


def _measure(entries: list[Scored], idxs: list[int], data: dict[int, torch.Tensor]) -> None:
    engine = [data[i] for i in idxs]
    for e in entries:
        e.metrics = {k: v for k, v in mismatch_metrics([e.logprobs[i] for i in idxs], engine).items() if k in KEYS}


CHECK_QUANTILE = 0.9  # the model check's statistic: this quantile of |log-ratio| over the checked tokens
# Between what an engine's own dumps reach (kernel and shape effects, GEMMs whose rows depend on the row count) and
# what a model or sampling mismatch reaches (weight noise, processed log-probs): calibrated on the shipped model,
# with the figures in docs/fit.md ("Calibration").
MAX_EXCESS = 5.0


def _spread(a: torch.Tensor, b: torch.Tensor) -> float:
    """The model check's statistic between two log-prob vectors of the same tokens."""
    return float((a.double() - b.double()).abs().quantile(CHECK_QUANTILE))


def _excess(distance: float, rounding: float, kernels: float | None, max_excess: float, tokens: int) -> dict:
    scale = max(rounding, kernels or 0.0)
    ratio = distance / scale if scale > 0 else (0.0 if distance == 0 else math.inf)
    return {
        "statistic": f"p{CHECK_QUANTILE * 100:.0f} |log-ratio|",
        "distance": distance,
        "rounding_scale": rounding,
        "kernel_scale": kernels,
        "excess": ratio,
        "max_excess": max_excess,
        "tokens": tokens,
    }


def screen_prefix(rollouts: list[Rollout], screen_tokens: int) -> tuple[list[int], int]:
    """The first whole sequences that hold at least ``screen_tokens`` tokens, and their token count."""
    idxs, count = [], 0
    for i, r in enumerate(rollouts):
        if count >= screen_tokens:
            break
        idxs.append(i)
        count += len(r.token_ids)
    return idxs, count


def _model_check(
    scorer: _Scorer, entries: list[Scored], idxs: list[int], data: torch.Tensor, max_excess: float
) -> dict:
    """How far the dump is from the best of the sorted ``entries``, in units of what rounding rules (and, if those
    do not explain it, kernels) do to the same tokens; raises ``DumpNotExplained`` above ``max_excess``.

    The rounding scale is the median over all candidates, not the maximum: the extreme pairs (HF against a
    never-rounded residual stream) would let a different checkpoint pass. The kernel scale costs one forward per
    checked token, so it is measured only when the rounding scale alone does not explain the dump (a decode dump
    on a CPU or GPU whose GEMM rows depend on the batch's row count)."""
    best = entries[0]
    ref = best.cat(idxs)
    rounding = float(torch.tensor([_spread(e.cat(idxs), ref) for e in entries]).median())
    distance = _spread(data, ref)
    excess = _excess(distance, rounding, None, max_excess, int(ref.numel()))
    if excess["excess"] <= max_excess:
        return excess
    decoded = torch.cat(scorer.decode(best, idxs))
    excess = _excess(distance, rounding, _spread(decoded, ref), max_excess, int(ref.numel()))
    if excess["excess"] <= max_excess:
        return excess
    raise DumpNotExplained(
        f"the dump is not explained by any rounding profile: {excess['statistic']} between its log-probs and the "
        f"closest candidate's is {distance:.3g} over {excess['tokens']} tokens, {excess['excess']:.3g}x what "
        f"rounding rules ({rounding:.3g}) and kernels ({excess['kernel_scale']:.3g}) do to the same tokens (the "
        f"limit is {max_excess:g}x, --max-excess). Check that --model is the checkpoint the engine served (same "
        "weights, same revision), that the dump holds raw log-probs (vLLM logprobs_mode='raw_logprobs', no "
        "temperature or penalties applied), and that the prompts were tokenized with this model's tokenizer. If "
        "all of that is right and the engine's kernels simply differ more, raise --max-excess.",
        {**excess, "closest": best.candidate.label(), "metrics": best.metrics},
    )


def _prune(space: Space, entries: list[Scored], best: Scored, idxs, data, prune_z: float) -> tuple[set, list[dict]]:
    """The options each region drops on the screen: beaten by the best on a clear majority of differing tokens."""
    ref = best.cat(idxs)
    dropped, decisions = set(), []
    for region in space.regions:
        winner = best.candidate.rule(region)
        seen = {winner}
        for e in entries:  # sorted best first: the first entry with an option is that option's best candidate
            option = e.candidate.rule(region)
            if option in seen:
                continue
            seen.add(option)
            wins, losses, z = sign_test(ref, e.cat(idxs), data)
            decision = {
                "region": region,
                "rule": option,
                "kept_rule": winner,
                "best_with_rule": e.candidate.label(),
                "tokens_closer_with_kept": wins,
                "tokens_closer_with_rule": losses,
                "z": z,
                "dropped": z >= prune_z,
            }
            decisions.append(decision)
            if decision["dropped"]:
                dropped.add((region, option))
    return dropped, decisions


def fit(
    model,
    rollouts: list[Rollout],
    *,
    exhaustive: bool = False,
    screen_tokens: int = 512,
    prune_z: float = 5.0,
    decide_z: float = 3.0,
    max_excess: float = MAX_EXCESS,
    progress: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
    quantization: str | None = None,
) -> FitResult:
    """Fit a profile to ``rollouts`` (each with the engine's ``logprobs``) on an unpatched bf16 HF ``model``.

    ``progress(n)`` is called after every n forwards, ``on_total(total)`` whenever the planned number of forwards
    changes (pruning lowers it). ``quantization``: the scheme the engine served (a dump's engine.json says), which
    every candidate computes. Raises ``DumpNotExplained`` for a dump no rounding rule explains.
    """
    if not rollouts:
        raise UserError("the dump holds no rollouts; fit needs at least one scored completion")
    for i, r in enumerate(rollouts):
        if r.logprobs is None or len(r.logprobs) != len(r.token_ids):
            raise UserError(f"rollout {i} needs one engine log-prob per completion token")
    trainer = TrainerSide(model)  # refuses a patched model
    space = Space.of(model, quantization)
    data = {i: torch.tensor(r.logprobs, dtype=torch.float32) for i, r in enumerate(rollouts)}
    everything = list(range(len(rollouts)))
    n_tokens = sum(len(r.token_ids) for r in rollouts)
    entries = [Scored(c) for c in space.candidates()]
    named = set(space.named().values())
    scorer = _Scorer(trainer, space, rollouts, progress)
    t0 = time.perf_counter()

    first, count = screen_prefix(rollouts, screen_tokens)
    screening = not exhaustive and n_tokens - count >= count  # worth it only when the rest is at least as long
    first = first if screening else everything
    if on_total:
        on_total(len(entries) * len(first))

    for e in entries:
        scorer.score(e, first)
    _measure(entries, first, data)
    bitwise_max = max(e.metrics[KEYS[0]] for e in entries)
    rank_by = "bitwise" if bitwise_max >= BITWISE_FLOOR else "k3_kl"
    entries.sort(key=_rank_key(rank_by, named))
    first_data = torch.cat([data[i] for i in first])
    excess = _model_check(scorer, entries, first, first_data, max_excess)

    pruned: list[dict] = []
    survivors = entries
    if screening:
        dropped, pruned = _prune(space, entries, entries[0], first, first_data, prune_z)
        survivors = [e for e in entries if not any((r, e.candidate.rule(r)) in dropped for r in space.regions)]
        # The margin is reported on the whole dump: the best dropped candidate that differs from the best on the
        # screen is scored on the rest too, as the runner-up when every survivor is identical to the best.
        ref = entries[0].cat(first)
        runner = next((e for e in entries if e not in survivors and not torch.equal(e.cat(first), ref)), None)
        survivors += [runner] if runner is not None else []
        rest = [i for i in everything if i not in set(first)]
        if on_total:
            on_total(len(entries) * len(first) + len(survivors) * len(rest))
        for e in survivors:
            scorer.score(e, rest)
        _measure(survivors, everything, data)
        survivors.sort(key=_rank_key(rank_by, named))
    seconds = time.perf_counter() - t0

    best = survivors[0]
    ref = best.cat(everything)
    equivalents = [e.candidate for e in survivors if torch.equal(e.cat(everything), ref)]
    runner_up = next((e for e in survivors if e.candidate not in equivalents), None)
    data_all = torch.cat([data[i] for i in everything])
    margin_ = margin(best, runner_up, everything, data_all, decide_z)
    regions = regions_verdict(space, survivors, equivalents, everything, data_all, pruned, decide_z)
    named_matches = [n for n, c in space.named().items() if c in equivalents]
    stats = {
        "tokens": n_tokens,
        "sequences": len(rollouts),
        "candidates": len(entries),
        "screen_tokens": count if screening else 0,
        "survivors": len(survivors),
        "forwards": scorer.forwards,
        "model_check_decode_forwards": scorer.decode_forwards,
        "seconds": seconds,
        "seconds_per_forward": seconds / max(scorer.forwards, 1),
    }
    profile = fitted_profile(space, best.candidate, named_matches, regions, stats)
    return FitResult(
        space,
        rank_by,
        survivors,
        equivalents,
        runner_up,
        margin_,
        regions,
        named_matches,
        pruned,
        excess,
        profile,
        stats,
    )
