"""Mismatch metrics between a trainer's and an engine's per-token log-probs, named as RL dashboards name them.

The probe compares, for the same sampled tokens, the trainer's log-probs (teacher forcing) with an engine
reference ("rollout": the engine's decode-time log-probs, its own prefill recompute, or an imported JSONL dump).
Users read those gaps on verl and TRL dashboards, so every metric that exists there keeps its exact name and its
exact definition, read in the source (docs/probe-report.md cites each one):

- ``rollout_corr/*``: verl ``verl/trainer/ppo/rollout_corr_helper.py::compute_offpolicy_metrics``;
- ``training/rollout_probs_diff_*`` and ``training/rollout_actor_probs_pearson_corr``: verl
  ``verl/utils/debug/metrics.py::calculate_debug_metrics`` (probability space, despite the name);
- ``sampling/sampling_logp_difference/*``: TRL ``GRPOTrainer`` (|old - sampling| over completion tokens);
- ``mismatch/*``: ours. Raw (never truncated) importance ratios, the RMS log-ratio in nats, the bitwise-equal
  fraction, and Fast-LLM #525's error correlation rho between the two sides' deviations from an fp32 forward.

With rho_t = logp_train - logp_rollout (verl's log ratio), token means pool all tokens of all sequences (verl's
masked means over a batch), sequence means weight each sequence once. All arithmetic is float64 so that the
metrics themselves add no rounding worth speaking of to the bf16 gaps they measure, and where verl writes
``exp(x) - 1`` we evaluate the same quantity as ``expm1(x)``: for the tiny log-ratios of an aligned trainer,
``exp(rho) - rho - 1`` cancels to rounding noise and even goes negative (-1.1e-16 at rho = 1e-8), while
``expm1(rho) - rho`` keeps k3 accurate and >= 0 (chi2 likewise: mean(exp(rho)^2) - 1 = mean(expm1(2 rho))).

A metric that is undefined (a constant side for a correlation, one token for a standard deviation, no fp32
reference, float64 overflow) is None, never NaN, so reports stay valid JSON.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from roundalign.numerics.bf16 import bf16_ulps_of_larger

# verl clamps log-ratios to [-20, 20] before exponentiating them (rollout_corr_helper.SAFETY_BOUND).
SAFETY_BOUND = 20.0

# Raw importance ratios outside this band count as "outside" (verl's default TIS threshold is 2.0; 0.5 = 1/2).
IS_BAND = (0.5, 2.0)

# Every key mismatch_metrics returns, in display order. Reports must carry all of them (report.validate_report).
METRIC_KEYS = (
    "rollout_corr/kl",
    "rollout_corr/k3_kl",
    "rollout_corr/chi2_token",
    "rollout_corr/chi2_seq",
    "rollout_corr/training_ppl",
    "rollout_corr/rollout_ppl",
    "rollout_corr/training_log_ppl",
    "rollout_corr/rollout_log_ppl",
    "rollout_corr/log_ppl_diff",
    "rollout_corr/log_ppl_abs_diff",
    "rollout_corr/log_ppl_diff_max",
    "rollout_corr/log_ppl_diff_min",
    "rollout_corr/ppl_ratio",
    "training/rollout_probs_diff_mean",
    "training/rollout_probs_diff_max",
    "training/rollout_probs_diff_std",
    "training/rollout_actor_probs_pearson_corr",
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "mismatch/is_token_raw_min",
    "mismatch/is_token_raw_mean",
    "mismatch/is_token_raw_max",
    "mismatch/is_token_raw_frac_outside",
    "mismatch/is_seq_raw_min",
    "mismatch/is_seq_raw_mean",
    "mismatch/is_seq_raw_max",
    "mismatch/is_seq_raw_frac_outside",
    "mismatch/log_ratio_rms",
    "mismatch/log_ratio_mean",
    "mismatch/log_ratio_max_abs",
    "mismatch/bitwise_equal_frac",
    "mismatch/error_corr_rho",
    "mismatch/error_rms_train",
    "mismatch/error_rms_rollout",
    "mismatch/tokens",
    "mismatch/sequences",
)


def _check_sides(named: dict[str, list[Tensor]]) -> list[int]:
    """Validate parallel lists of 1-D float log-prob tensors; return each sequence's length."""
    for name, side in named.items():
        if not isinstance(side, (list, tuple)):
            raise TypeError(f"{name} must be a list of tensors, one per sequence, not {type(side).__name__}")
    first_name, first = next(iter(named.items()))
    if len(first) == 0:
        raise ValueError(f"{first_name} must be a non-empty list of per-sequence log-prob tensors")
    lengths = []
    for name, side in named.items():
        if len(side) != len(first):
            raise ValueError(f"{name} has {len(side)} sequences but {first_name} has {len(first)}; pass the same ones")
    for i, seq in enumerate(first):
        for name, side in named.items():
            t = side[i]
            if not isinstance(t, Tensor) or not t.is_floating_point() or t.dim() != 1:
                raise TypeError(f"{name}[{i}] must be a 1-D floating-point tensor of per-token log-probs")
            if t.numel() == 0:
                raise ValueError(f"{name}[{i}] is empty; every sequence needs at least one completion token")
            if t.shape != seq.shape:
                raise ValueError(
                    f"sequence {i}: {name} has {t.numel()} tokens but {first_name} has {seq.numel()}; "
                    "both sides must score the same completion tokens"
                )
            bad = ~torch.isfinite(t)
            if bad.any():
                pos = int(bad.nonzero()[0, 0])
                raise ValueError(f"{name}[{i}][{pos}] is {t[pos].item()}; log-probs must be finite")
        lengths.append(seq.numel())
    return lengths


def _f(x: Tensor | float) -> float | None:
    """A Python float, or None where float64 could not represent it (overflow) or it is undefined (NaN)."""
    value = float(x)
    return value if math.isfinite(value) else None


def _pearson(x: Tensor, y: Tensor) -> float | None:
    """Pearson correlation of two float64 vectors; None when either side is constant (zero variance)."""
    dx, dy = x - x.mean(), y - y.mean()
    denom = dx.norm() * dy.norm()
    if denom == 0:
        return None
    return _f((dx @ dy) / denom)


def _outside(ratio: Tensor) -> float:
    low, high = IS_BAND
    return float(((ratio < low) | (ratio > high)).double().mean())


def log_ratios(train: list[Tensor], rollout: list[Tensor]) -> Tensor:
    """rho_t = logp_train - logp_rollout over all tokens of all sequences, pooled (float64), for histograms."""
    _check_sides({"train": train, "rollout": rollout})
    return torch.cat([t.double() for t in train]) - torch.cat([r.double() for r in rollout])


def mismatch_metrics(train: list[Tensor], rollout: list[Tensor], fp32: list[Tensor] | None = None) -> dict:
    """All mismatch metrics for one (trainer, engine reference) pair; keys and order as in METRIC_KEYS.

    train[i], rollout[i]: per-token log-probs of sequence i's completion tokens from the trainer and the engine
    reference; fp32[i]: the same tokens from an fp32 reference forward (enables the error correlation).
    Values are Python floats (ints for the counts) or None where undefined; see the module docstring.
    """
    sides = {"train": train, "rollout": rollout} | ({"fp32": fp32} if fp32 is not None else {})
    lengths = _check_sides(sides)
    counts = torch.tensor(lengths)
    seq_id = torch.repeat_interleave(torch.arange(len(lengths)), counts)

    # Bitwise equality is decided on the fp32 values the sides produced, before any upcast.
    equal = torch.cat([(t.float() == r.float()) for t, r in zip(train, rollout, strict=True)])
    t = torch.cat([x.double() for x in train])
    r = torch.cat([x.double() for x in rollout])
    rho = t - r

    def per_seq_sum(x: Tensor) -> Tensor:
        return torch.zeros(len(lengths), dtype=torch.float64).index_add_(0, seq_id, x)

    mean_t_train = per_seq_sum(t) / counts
    mean_t_rollout = per_seq_sum(r) / counts
    log_ppl_diff = mean_t_rollout - mean_t_train  # per sequence
    rho_safe = rho.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    seq_rho_safe = per_seq_sum(rho).clamp(-SAFETY_BOUND, SAFETY_BOUND)

    p_train, p_rollout = t.exp(), r.exp()
    probs_diff = (p_train - p_rollout).abs()
    logp_diff = rho.abs()
    # verl's rollout_probs_diff_std is torch.std (Bessel-corrected): undefined for a single token.
    probs_std = _f(probs_diff.std()) if probs_diff.numel() > 1 else None

    token_ratio = rho.exp()  # raw: no truncation, no mask (TRL logs its ratios after both)
    seq_ratio = seq_rho_safe.exp()  # exp(sum_t rho), TRL's sum form, through verl's safety clamp

    out: dict = {
        "rollout_corr/kl": _f((r - t).mean()),
        "rollout_corr/k3_kl": _f((torch.expm1(rho) - rho).mean()),
        "rollout_corr/chi2_token": _f(torch.expm1(2.0 * rho_safe).mean()),
        "rollout_corr/chi2_seq": _f(torch.expm1(2.0 * seq_rho_safe).mean()),
        "rollout_corr/training_ppl": _f((-mean_t_train).exp().mean()),
        "rollout_corr/rollout_ppl": _f((-mean_t_rollout).exp().mean()),
        "rollout_corr/training_log_ppl": _f((-mean_t_train).mean()),
        "rollout_corr/rollout_log_ppl": _f((-mean_t_rollout).mean()),
        "rollout_corr/log_ppl_diff": _f(log_ppl_diff.mean()),
        "rollout_corr/log_ppl_abs_diff": _f(log_ppl_diff.abs().mean()),
        "rollout_corr/log_ppl_diff_max": _f(log_ppl_diff.max()),
        "rollout_corr/log_ppl_diff_min": _f(log_ppl_diff.min()),
        "rollout_corr/ppl_ratio": _f(log_ppl_diff.exp().mean()),
        "training/rollout_probs_diff_mean": _f(probs_diff.mean()),
        "training/rollout_probs_diff_max": _f(probs_diff.max()),
        "training/rollout_probs_diff_std": probs_std,
        "training/rollout_actor_probs_pearson_corr": _pearson(p_train, p_rollout),
        "sampling/sampling_logp_difference/mean": _f(logp_diff.mean()),
        "sampling/sampling_logp_difference/max": _f(logp_diff.max()),
        "mismatch/is_token_raw_min": _f(token_ratio.min()),
        "mismatch/is_token_raw_mean": _f(token_ratio.mean()),
        "mismatch/is_token_raw_max": _f(token_ratio.max()),
        "mismatch/is_token_raw_frac_outside": _outside(token_ratio),
        "mismatch/is_seq_raw_min": _f(seq_ratio.min()),
        "mismatch/is_seq_raw_mean": _f(seq_ratio.mean()),
        "mismatch/is_seq_raw_max": _f(seq_ratio.max()),
        "mismatch/is_seq_raw_frac_outside": _outside(seq_ratio),
        "mismatch/log_ratio_rms": _f(rho.square().mean().sqrt()),
        "mismatch/log_ratio_mean": _f(rho.mean()),
        "mismatch/log_ratio_max_abs": _f(logp_diff.max()),
        "mismatch/bitwise_equal_frac": float(equal.double().mean()),
        "mismatch/error_corr_rho": None,
        "mismatch/error_rms_train": None,
        "mismatch/error_rms_rollout": None,
        "mismatch/tokens": int(t.numel()),
        "mismatch/sequences": len(lengths),
    }
    if fp32 is not None:
        # Fast-LLM #525: e = low-precision - fp32 per side; rho -> 1 when both sides round alike.
        ref = torch.cat([x.double() for x in fp32])
        e_train, e_rollout = t - ref, r - ref
        out["mismatch/error_corr_rho"] = _pearson(e_train, e_rollout)
        out["mismatch/error_rms_train"] = _f(e_train.square().mean().sqrt())
        out["mismatch/error_rms_rollout"] = _f(e_rollout.square().mean().sqrt())
    return out


def layer_agreement(trainer_hidden: list[Tensor], engine_hidden: list[Tensor]) -> list[dict]:
    """Per-layer bit agreement of trainer and engine hidden states (one bf16 tensor per layer, same shapes).

    Each row: ``layer`` (the list index), ``equal_frac`` (fraction of elements whose 16-bit patterns are
    identical), ``differ`` (how many elements' values differ), ``max_ulp`` (the largest |trainer - engine| in ulps
    of the larger magnitude of the two: ``bf16_ulps_of_larger``, which does not count across zero),
    ``mean_abs_diff`` (mean |trainer - engine|, float64; None if an infinity makes it undefined).
    """
    if len(trainer_hidden) != len(engine_hidden):
        raise ValueError(
            f"trainer has {len(trainer_hidden)} layers of hidden states but the engine {len(engine_hidden)}"
        )
    if not trainer_hidden:
        raise ValueError("no hidden states given; pass one tensor per decoder layer")
    rows = []
    for i, (h_train, h_engine) in enumerate(zip(trainer_hidden, engine_hidden, strict=True)):
        if h_train.shape != h_engine.shape:
            raise ValueError(
                f"layer {i}: trainer hidden state {tuple(h_train.shape)} vs engine {tuple(h_engine.shape)}; "
                "both must cover the same tokens"
            )
        if h_train.numel() == 0:
            raise ValueError(f"layer {i}: empty hidden states")
        ulp = bf16_ulps_of_larger(h_train, h_engine)
        same_bits = h_train.view(torch.int16) == h_engine.view(torch.int16)
        rows.append(
            {
                "layer": i,
                "equal_frac": float(same_bits.double().mean()),
                "differ": int((ulp > 0).sum()),
                "max_ulp": float(ulp.max()),
                "mean_abs_diff": _f((h_train.double() - h_engine.double()).abs().mean()),
            }
        )
    return rows
