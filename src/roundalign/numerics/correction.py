"""Importance-sampling corrections for the gap between the rollout engine's log-probs and the trainer's.

The engine samples a completion and reports its log-probs; the trainer recomputes them at the same weights ("old"
log-probs, verl's decoupled mode). Both are the same policy in exact arithmetic, but they round to bf16 at different
places, so the per-token ratio rho_t = pi_old / pi_rollout is not exactly 1. GRPO's policy gradient assumes samples
from pi_old; these corrections reweight (TIS, Yao, Liu et al.) or reject (MIS / Geo-RS, Liu, Li et al.) tokens or
whole sequences whose ratio is off, with the names and defaults of verl's ``algorithm.rollout_correction`` and TRL's
``vllm_importance_sampling_*``:

    log rho_t = old_logp_t - rollout_logp_t,   rho_t = exp(clamp(log rho_t, -20, 20))   (verl SAFETY_BOUND)
    S = clamp(sum_t log rho_t, -20, 20)    (sequence log-ratio)     G = clamp(mean_t log rho_t, -20, 20)   (geometric)

    mode        weight                                 verl                          TRL
    none        w_t = 1                                disabled()                    correction=False
    token-tis   w_t = clamp(rho_t, low, high)          rollout_is=token              token_truncate
    seq-tis     w = clamp(exp(S), low, high)           rollout_is=sequence           sequence_truncate
    token-mask  w_t = 1[low <= rho_t <= high]          rollout_rs=token_k1           token_mask
    seq-mask    w = 1[low <= exp(S) <= high]           rollout_rs=seq_sum_k1         sequence_mask
    geo-mask    w = 1[low <= exp(G) <= high]           rollout_rs=seq_mean_k1        (none; "Geo-RS")

Sums and means run over valid tokens only and use the unclamped token log-ratios; the clamp applies to the
sequence statistic, in verl's order. A sequence weight applies to every valid token of that sequence. Bounds are
inclusive and are compared with the fp32 ratio after rounding the bound to fp32 (which is what torch does when verl
and TRL compare an fp32 tensor with a Python float); the rounding is spelled out below. verl's k1 rejection modes
compare -log rho with [log L, log U] instead; for an asymmetric band such as 0.999_1.001 that accepts [1/U, 1/L]
in ratio space, slightly off the [L, U] its docs state, so we follow the ratio-space statement (and TRL).

Metrics: the raw ratios (before any correction, the same in every mode, so runs with different modes compare),
the applied weights, and what masking removed; ``METRIC_KEYS`` lists them, the same set for every mode so JSONL
columns stay stable. All reductions are float64 over the fp32 values, so metrics add no rounding of their own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from roundalign.numerics.metrics import SAFETY_BOUND

IS_MODES = ("none", "token-tis", "seq-tis", "token-mask", "seq-mask", "geo-mask")

_TOKEN_MODES = ("token-tis", "token-mask")
_TRUNCATE_MODES = ("token-tis", "seq-tis")
_MASK_MODES = ("token-mask", "seq-mask", "geo-mask")

# Defaults as (low, high): verl rollout_is_threshold 2.0 (one-sided .clamp(max=2.0)); the decoupled_seq_is_rs preset
# "0.5_2.0" for the masks; the decoupled_geo_rs preset "0.999_1.001" for the geometric mask.
_DEFAULTS: dict[str, tuple[float | None, float | None]] = {
    "none": (None, None),
    "token-tis": (None, 2.0),
    "seq-tis": (None, 2.0),
    "token-mask": (0.5, 2.0),
    "seq-mask": (0.5, 2.0),
    "geo-mask": (0.999, 1.001),
}

METRIC_KEYS = (
    "rollout_corr/raw_is_mean",
    "rollout_corr/raw_is_std",
    "rollout_corr/raw_is_min",
    "rollout_corr/raw_is_max",
    "rollout_corr/raw_is_seq_mean",
    "rollout_corr/raw_is_seq_min",
    "rollout_corr/raw_is_seq_max",
    "rollout_corr/raw_is_geo_min",
    "rollout_corr/raw_is_geo_max",
    "rollout_corr/rollout_is_ratio_fraction_high",
    "rollout_corr/rollout_is_ratio_fraction_low",
    "rollout_corr/rollout_is_mean",
    "rollout_corr/rollout_is_std",
    "rollout_corr/rollout_is_min",
    "rollout_corr/rollout_is_max",
    "rollout_corr/rollout_is_eff_sample_size",
    "rollout_corr/rollout_rs_masked_fraction",
    "rollout_corr/rollout_rs_seq_masked_fraction",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)


def _format_hint(mode: str) -> str:
    low, high = _DEFAULTS[mode]
    if mode in _TRUNCATE_MODES:
        return f'an upper bound "U" (default {high!r}) or two-sided "L_U" such as "0.5_{high!r}", or a float'
    return f'"L_U" such as "{low!r}_{high!r}" (the default), a single "U" meaning L = 1/U, or a float'


def _parse_bound(text: str, mode: str, threshold: object) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(
            f"IS correction {mode!r}: cannot read threshold {threshold!r}; expected {_format_hint(mode)}"
        ) from None


@dataclass(frozen=True)
class ISCorrection:
    """An importance-sampling correction: a mode from ``IS_MODES`` and its inclusive ratio bounds.

    Build it with ``ISCorrection.parse(mode, threshold)``; constructing it directly validates the same way.
    """

    mode: str
    low: float | None
    high: float | None

    def __post_init__(self) -> None:
        if self.mode not in IS_MODES:
            raise ValueError(f"unknown IS correction mode {self.mode!r}; choose one of {', '.join(IS_MODES)}")
        if self.mode == "none":
            if self.low is not None or self.high is not None:
                raise ValueError("IS correction 'none' takes no bounds; pass low=None, high=None")
            return
        for name, value in (("low", self.low), ("high", self.high)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"IS correction {self.mode!r}: {name} must be a float, got {type(value).__name__}")
            if not math.isfinite(value) or value <= 0:
                raise ValueError(
                    f"IS correction {self.mode!r}: {name} bound must be a finite positive ratio, got {value!r}; "
                    f"expected {_format_hint(self.mode)}"
                )
        if self.high is None:
            raise ValueError(f"IS correction {self.mode!r} needs an upper bound; expected {_format_hint(self.mode)}")
        if self.mode in _MASK_MODES and self.low is None:
            raise ValueError(f"IS correction {self.mode!r} needs a lower bound; expected {_format_hint(self.mode)}")
        if self.low is not None and not self.low < self.high:
            raise ValueError(
                f"IS correction {self.mode!r}: lower bound {self.low!r} must be below upper bound {self.high!r}; "
                f"expected {_format_hint(self.mode)}"
            )

    @classmethod
    def parse(cls, mode: str, threshold: str | float | None = None) -> ISCorrection:
        """threshold in verl's format: "U" or "L_U" (e.g. "0.5_2.0"), or a float. Defaults per mode:
        token-tis / seq-tis: high 2.0, low None (verl rollout_is_threshold 2.0; one-sided .clamp(max=U));
        "L_U" gives TRL's two-sided truncate [C_min, C_max].
        token-mask / seq-mask: "0.5_2.0" (verl decoupled_seq_is_rs preset); a single U means low = 1/U (verl k1).
        geo-mask: "0.999_1.001" (verl decoupled_geo_rs preset).
        none: no threshold allowed (ValueError if one is given).
        Validate: 0 < low < high, finite; clear errors naming the mode and the expected format."""
        if not isinstance(mode, str):
            raise TypeError(f"IS correction mode must be a string, one of {', '.join(IS_MODES)}")
        if mode not in IS_MODES:
            raise ValueError(f"unknown IS correction mode {mode!r}; choose one of {', '.join(IS_MODES)}")
        if mode == "none":
            if threshold is not None:
                raise ValueError(
                    f"IS correction 'none' takes no threshold, got {threshold!r}; drop the threshold or pick a mode "
                    f"from {', '.join(IS_MODES[1:])}"
                )
            return cls(mode, None, None)
        if threshold is None:
            low, high = _DEFAULTS[mode]
            return cls(mode, low, high)
        if isinstance(threshold, bool) or not isinstance(threshold, (str, int, float)):
            raise TypeError(
                f"IS correction {mode!r}: threshold must be a string or a float, got {type(threshold).__name__}; "
                f"expected {_format_hint(mode)}"
            )
        if isinstance(threshold, str):
            parts = threshold.strip().split("_")
            if len(parts) > 2 or any(not p.strip() for p in parts):
                raise ValueError(
                    f"IS correction {mode!r}: cannot read threshold {threshold!r}; expected {_format_hint(mode)}"
                )
            bounds = [_parse_bound(p.strip(), mode, threshold) for p in parts]
        else:
            bounds = [float(threshold)]
        if len(bounds) == 2:
            low, high = bounds
        else:
            (high,) = bounds
            if not math.isfinite(high) or high <= 0:
                raise ValueError(
                    f"IS correction {mode!r}: upper bound must be a finite positive ratio, got {high!r}; "
                    f"expected {_format_hint(mode)}"
                )
            # A single U: truncation stays one-sided (verl TIS); a mask gets the band [1/U, U] (verl k1).
            low = None if mode in _TRUNCATE_MODES else 1.0 / high
        return cls(mode, low, high)

    def describe(self) -> str:
        """One line with the weight formula and its bounds, e.g. "token-tis: w_t = min(rho_t, 2.0)"."""
        if self.mode == "none":
            return "none: w_t = 1 (no correction)"
        stat = {
            "token-tis": "rho_t",
            "token-mask": "rho_t",
            "seq-tis": "prod_t rho_t",
            "seq-mask": "prod_t rho_t",
            "geo-mask": "(prod_t rho_t)^(1/T)",
        }[self.mode]
        per = "" if self.mode in _TOKEN_MODES else " per sequence"
        lhs = "w_t" if self.mode in _TOKEN_MODES else "w"
        if self.mode in _TRUNCATE_MODES:
            if self.low is None:
                return f"{self.mode}: {lhs} = min({stat}, {self.high!r}){per}"
            return f"{self.mode}: {lhs} = clamp({stat}, {self.low!r}, {self.high!r}){per}"
        return f"{self.mode}: {lhs} = 1[{self.low!r} <= {stat} <= {self.high!r}]{per}"


def _check_inputs(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> None:
    for name, t in (("old_logp", old_logp), ("rollout_logp", rollout_logp), ("mask", mask)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True on completion tokens), got {mask.dtype}; use mask.bool()")
    if mask.dim() != 2:
        raise ValueError(f"mask must have shape (B, T), got {tuple(mask.shape)}")
    for name, t in (("old_logp", old_logp), ("rollout_logp", rollout_logp)):
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32 per-token log-probs, got {t.dtype}; pass {name}.float()")
        if t.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but mask has {tuple(mask.shape)}; they must match")
    empty = (~mask.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"rows {empty} of mask have no completion token; every completion needs at least one")
    for name, t in (("old_logp", old_logp), ("rollout_logp", rollout_logp)):
        bad = int((~torch.isfinite(t) & mask).sum())
        if bad:
            raise ValueError(f"{name} is not finite at {bad} completion tokens; log-probs must be finite there")


def _fraction(flags: Tensor) -> float:
    return float(flags.double().mean()) if flags.numel() else 0.0


def is_weights(
    old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, correction: ISCorrection
) -> tuple[Tensor, dict[str, float]]:
    """Per-token importance weights for ``correction`` and their metrics (see the module docstring).

    old_logp: the trainer's recomputed log-probs at the rollout's weights (verl's decoupled "old"); rollout_logp: the
    engine's; both (B, T) float32, mask (B, T) bool. Returns fp32 weights (B, T), detached, 0 at padding, and
    ``METRIC_KEYS`` as floats computed over valid tokens / sequences:

    - raw_is_{mean,std,min,max}: token rho (population std, as verl); raw_is_seq_{mean,min,max}: exp(S) per sequence;
      raw_is_geo_{min,max}: exp(G) per sequence; rollout_is_ratio_fraction_{high,low}: fraction of valid tokens
      with raw rho above high / below low, 0 when that bound is None. (verl measures these per sequence in its
      sequence mode and uses 1/U when there is no lower bound; here they are token fractions in every mode.)
    - rollout_is_{mean,std,min,max}: the applied weights over valid tokens; rollout_is_eff_sample_size:
      1 / mean(w_norm^2), w_norm = w / mean(w) (verl's definition, without its +1e-8), 0.0 when every weight is 0;
      rollout_rs_masked_fraction: fraction of valid tokens with weight 0; rollout_rs_seq_masked_fraction: fraction
      of sequences with at least one valid token at weight 0 (verl's definition: in the sequence modes that is the
      fraction of rejected sequences; in token-mask mode, of sequences that lost a token).
    - sampling/importance_sampling_ratio/{min,mean,max}: TRL's names for the applied weights, over valid tokens in
      the token modes and over sequences in the sequence modes (TRL flattens its (B, 1) ratio there).
    """
    if not isinstance(correction, ISCorrection):
        raise TypeError(f"correction must be an ISCorrection (use ISCorrection.parse), got {type(correction).__name__}")
    _check_inputs(old_logp, rollout_logp, mask)
    mode, low, high = correction.mode, correction.low, correction.high
    with torch.no_grad():
        # Padding never enters: its log-ratio is replaced by 0 before any arithmetic.
        log_rho = torch.where(mask, old_logp.detach() - rollout_logp.detach(), 0.0)
        rho = torch.exp(log_rho.clamp(-SAFETY_BOUND, SAFETY_BOUND))
        n_tok = mask.sum(dim=1)
        seq_log = log_rho.sum(dim=1)
        seq_rho = torch.exp(seq_log.clamp(-SAFETY_BOUND, SAFETY_BOUND))
        geo_rho = torch.exp((seq_log / n_tok.to(torch.float32)).clamp(-SAFETY_BOUND, SAFETY_BOUND))

        # The bounds are rounded to fp32 here, once, so the comparison is fp32 against fp32 (visible, not implied).
        low32 = None if low is None else torch.tensor(low, dtype=torch.float32)
        high32 = None if high is None else torch.tensor(high, dtype=torch.float32)
        seq_w = None  # the per-sequence weight in the sequence modes (TRL's (B, 1) ratio)
        if mode == "none":
            w = torch.ones_like(rho)
        elif mode == "token-tis":
            w = rho.clamp(min=low32, max=high32)
        elif mode == "token-mask":
            w = ((rho >= low32) & (rho <= high32)).to(torch.float32)
        else:
            if mode == "seq-tis":
                seq_w = seq_rho.clamp(min=low32, max=high32)
            else:
                stat = seq_rho if mode == "seq-mask" else geo_rho
                seq_w = ((stat >= low32) & (stat <= high32)).to(torch.float32)
            w = seq_w[:, None].expand_as(rho)
        w = torch.where(mask, w, 0.0)

        raw_high = torch.zeros_like(mask) if high32 is None else rho > high32
        raw_low = torch.zeros_like(mask) if low32 is None else rho < low32
        metrics = _metrics(rho, seq_rho, geo_rho, w, seq_w, raw_high, raw_low, mask)
    return w, metrics


def _metrics(
    rho: Tensor,
    seq_rho: Tensor,
    geo_rho: Tensor,
    w: Tensor,
    seq_w: Tensor | None,
    raw_high: Tensor,
    raw_low: Tensor,
    mask: Tensor,
) -> dict[str, float]:
    tok = rho[mask].double()
    seq, geo = seq_rho.double(), geo_rho.double()
    wt = w[mask].double()
    w_mean = float(wt.mean())
    ess = 0.0 if w_mean == 0.0 else 1.0 / float(((wt / w_mean) ** 2).mean())
    zero_tok = (w == 0) & mask
    seq_any_zero = zero_tok.any(dim=1)
    trl = wt if seq_w is None else seq_w.double()
    return {
        "rollout_corr/raw_is_mean": float(tok.mean()),
        "rollout_corr/raw_is_std": float(tok.std(correction=0)),
        "rollout_corr/raw_is_min": float(tok.min()),
        "rollout_corr/raw_is_max": float(tok.max()),
        "rollout_corr/raw_is_seq_mean": float(seq.mean()),
        "rollout_corr/raw_is_seq_min": float(seq.min()),
        "rollout_corr/raw_is_seq_max": float(seq.max()),
        "rollout_corr/raw_is_geo_min": float(geo.min()),
        "rollout_corr/raw_is_geo_max": float(geo.max()),
        "rollout_corr/rollout_is_ratio_fraction_high": _fraction(raw_high[mask]),
        "rollout_corr/rollout_is_ratio_fraction_low": _fraction(raw_low[mask]),
        "rollout_corr/rollout_is_mean": w_mean,
        "rollout_corr/rollout_is_std": float(wt.std(correction=0)),
        "rollout_corr/rollout_is_min": float(wt.min()),
        "rollout_corr/rollout_is_max": float(wt.max()),
        "rollout_corr/rollout_is_eff_sample_size": ess,
        "rollout_corr/rollout_rs_masked_fraction": _fraction(zero_tok[mask]),
        "rollout_corr/rollout_rs_seq_masked_fraction": _fraction(seq_any_zero),
        "sampling/importance_sampling_ratio/min": float(trl.min()),
        "sampling/importance_sampling_ratio/mean": float(trl.mean()),
        "sampling/importance_sampling_ratio/max": float(trl.max()),
    }
