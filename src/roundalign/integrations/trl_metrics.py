"""Mismatch, IS-ratio, update-visibility and attribution metrics in TRL's ``GRPOTrainer`` logs.

A ``TrainerCallback`` never sees a batch, and TRL's per-token log-probs only exist inside
``_generate_and_score_completions``. ``install`` therefore wraps that method on the trainer instance: after TRL has
scored a generation batch (its recompute ``old_per_token_logps`` and the sampler's ``sampling_per_token_logps``),
the metrics below are computed from those very tensors and appended to TRL's metric buffers (``trainer._metrics``),
which TRL averages over ``logging_steps`` and logs with its own (``trainer.state.log_history``, ``report_to``).
``RoundalignCallback`` syncs the engine after every optimizer step and logs ``sync/*``.

Per generation batch, over every completion token of every rank (gathered, so all ranks log the same numbers):

- ``rollout_corr/*``, ``training/rollout_probs_diff_*``, ``mismatch/*``: ``roundalign.numerics.metrics`` with verl's
  definitions (``rollout_corr/k3_kl`` = mean(exp(rho) - rho - 1), rho = logp_trainer - logp_sampler);
- ``rollout_corr/raw_is_*``: the raw importance ratios, before TRL truncates or masks them (trl#5231), and
  ``rollout_corr/rollout_is_ratio_fraction_{high,low}`` against TRL's clip band (``roundalign.numerics.correction``);
- with a prefill scorer (``EngineRolloutFunc(prefill_check=True)``), ``prefill/*``: the trainer against the engine's own
  one-sequence prefill of the same tokens, the rounding-location gap without decode's attention shapes;
- every ``attribution_every`` training steps, ``attribution/*``: the same rollouts re-scored by the policy under
  the base profile (stock ``hf``), under the engine profile, and with one region switched at a time
  (``roundalign.numerics.attribution``). ``attribution/base/k3_kl`` against ``attribution/target/k3_kl`` is the stock
  against the aligned trainer on the same samples.
"""

from __future__ import annotations

import math

import torch
from transformers import TrainerCallback

import roundalign
from roundalign.integrations.trl_policy import check_not_sharded, unwrap_policy
from roundalign.numerics.attribution import SHARE_METRIC, attribution_entry, region_switches
from roundalign.numerics.correction import ISCorrection, is_weights
from roundalign.numerics.metrics import mismatch_metrics
from roundalign.sync import KEYS as SYNC_KEYS

# What is logged from roundalign.numerics.metrics (TRL logs sampling/sampling_logp_difference/* itself).
MISMATCH_KEYS = (
    "rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/chi2_token", "rollout_corr/chi2_seq",
    "rollout_corr/log_ppl_abs_diff", "rollout_corr/ppl_ratio", "training/rollout_probs_diff_mean",
    "training/rollout_probs_diff_max", "mismatch/log_ratio_rms", "mismatch/log_ratio_max_abs",
    "mismatch/bitwise_equal_frac",
)  # fmt: skip
RAW_IS_KEYS = (
    "rollout_corr/raw_is_mean", "rollout_corr/raw_is_std", "rollout_corr/raw_is_min", "rollout_corr/raw_is_max",
    "rollout_corr/raw_is_seq_mean", "rollout_corr/raw_is_seq_min", "rollout_corr/raw_is_seq_max",
    "rollout_corr/raw_is_geo_min", "rollout_corr/raw_is_geo_max",
)  # fmt: skip
FRACTION_KEYS = ("rollout_corr/rollout_is_ratio_fraction_high", "rollout_corr/rollout_is_ratio_fraction_low")
ATTRIBUTION_METRICS = ("rollout_corr/k3_kl", "mismatch/log_ratio_rms", "mismatch/bitwise_equal_frac")
# With a prefill re-score (EngineRolloutFunc(prefill_check=True)): the trainer against the engine's own prefill,
# under the names roundalign train --prefill-check logs.
PREFILL_KEYS = (
    "rollout_corr/k3_kl", "mismatch/log_ratio_rms", "mismatch/bitwise_equal_frac", "mismatch/log_ratio_max_abs",
)  # fmt: skip


def _push(trainer, mode: str, metrics: dict) -> None:
    """Into TRL's buffers; None (undefined) becomes NaN, which TRL's averaging skips and logs as None."""
    for key, value in metrics.items():
        trainer._metrics[mode][key].append(math.nan if value is None else float(value))


def log_sync(trainer, metrics: dict) -> None:
    _push(trainer, "train", {k: metrics[k] for k in SYNC_KEYS if k in metrics})


class RoundalignCallback(TrainerCallback):
    """After every optimizer step: export the policy to the engine (``EngineRolloutFunc.sync``) and log ``sync/*``."""

    def __init__(self, rollout) -> None:
        self.rollout = rollout

    def on_step_end(self, args, state, control, **kwargs):
        log_sync(self.rollout.trainer, self.rollout.sync())
        return control


class MismatchLogger:
    """The batch hook: computes and pushes the metrics of the module docstring after TRL scores a batch.

    ``prefill_scorer(output, mode)``, when given, returns the engine's own prefill re-score of the batch's
    completion tokens as a (B, T) tensor like TRL's; it adds ``prefill/*`` and becomes the attribution's reference.
    """

    def __init__(self, engine_profile, attribution_every: int = 0, attribution_base="hf", prefill_scorer=None) -> None:
        self.engine_profile, self.attribution_base = engine_profile, attribution_base
        self.attribution_every = attribution_every
        self.prefill_scorer = prefill_scorer
        self.last: dict | None = None  # the latest batch's metrics, for inspection

    def install(self, trainer) -> None:
        original = trainer._generate_and_score_completions

        def generate_and_score(inputs):
            output = original(inputs)
            if output.get("sampling_per_token_logps") is not None:  # no sampler log-probs: nothing to compare
                self.record(trainer, output)
            return output

        trainer._generate_and_score_completions = generate_and_score

    def record(self, trainer, output: dict) -> dict:
        mode = "train" if trainer.model.training else "eval"
        mask = output["completion_mask"].bool()
        if output.get("tool_mask") is not None:
            mask = mask & output["tool_mask"].bool()
        old = output.get("old_per_token_logps")
        if old is None:  # TRL skipped its recompute (IS correction off): do it as TRL would
            old = trainer_logps(trainer, output, mode)
        sampler = output["sampling_per_token_logps"]
        mask = mask & ~torch.isnan(sampler)  # vLLM reports NaN for a token it could not score; TRL skips those too
        refs = {"sampler": sampler}
        if self.prefill_scorer is not None:
            refs["prefill"] = self.prefill_scorer(output, mode)
        old_all, mask_all, *ref_all = _gather(trainer, old, mask, *refs.values())
        rows = mask_all.any(dim=1)  # a fully masked completion (mask_truncated_completions) has nothing to compare
        if not rows.any():
            return {}
        old_all, mask_all = old_all[rows].float(), mask_all[rows]
        refs = {name: t[rows].float() for name, t in zip(refs, ref_all, strict=True)}
        metrics = batch_metrics(old_all, refs["sampler"], mask_all, trainer.args)
        if "prefill" in refs:
            pm = mismatch_metrics(_rows(old_all, mask_all), _rows(refs["prefill"], mask_all))
            metrics |= {f"prefill/{k.split('/')[-1]}": pm[k] for k in PREFILL_KEYS}
        every = self.attribution_every
        if every and mode == "train" and trainer.state.global_step % every == 0:
            metrics |= self.attribution(trainer, output, refs, mask_all, rows, mode)
        self.last = metrics
        _push(trainer, mode, metrics)
        return metrics

    def attribution(self, trainer, output, refs, mask, rows, mode) -> dict:
        """Re-score this batch under the base profile, the engine profile and each one-region switch. The region
        shares are measured against the engine's prefill re-score when there is one (rounding locations alone),
        else against the sampler's log-probs."""
        policy = unwrap_policy(trainer)
        check_not_sharded(policy, "policy", "the attribution re-patches it between steps; set attribution_every=0")
        original = roundalign.patched_profile(policy)
        switches = region_switches(self.attribution_base, self.engine_profile, policy.config)

        reference = "prefill" if "prefill" in refs else "sampler"

        def scored(profile) -> dict[str, dict]:
            roundalign.revert(policy)
            roundalign.apply(policy, profile, allow_non_bf16=True)
            (logps,) = _gather(trainer, trainer_logps(trainer, output, mode))
            train = _rows(logps[rows].float(), mask)
            return {name: mismatch_metrics(train, _rows(ref, mask)) for name, ref in refs.items()}

        try:
            base, target = scored(self.attribution_base), scored(self.engine_profile)
            switched = {s.region: scored(s.profile)[reference] for s in switches if s.profile is not None}
            alone = {s.region: scored(s.alone)[reference] for s in switches if s.alone is not None}
        finally:
            roundalign.revert(policy)
            if original is not None:
                roundalign.apply(policy, original, allow_non_bf16=True)
        entry = attribution_entry(
            base=roundalign.get_profile(self.attribution_base),
            engine=roundalign.get_profile(self.engine_profile),
            backend="trl",
            reference=reference,
            base_metrics=base[reference],
            target_metrics=target[reference],
            switches=switches,
            switch_metrics=switched,
            alone_metrics=alone,
        )
        out = {}
        for side, metrics in (("base", base), ("target", target)):
            for name, m in metrics.items():
                prefix = "" if name == "sampler" else "prefill_"
                out |= {f"attribution/{side}/{prefix}{k.split('/')[-1]}": m[k] for k in ATTRIBUTION_METRICS}
        for region in entry["regions"]:
            out[f"attribution/{region['region']}/switch"] = region["share"]
            out[f"attribution/{region['region']}/alone"] = region["alone_share"]
        return out


def _gather(trainer, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's (B, T) tensor, padded to the longest T and stacked: the same batch on every rank."""
    acc = trainer.accelerator
    out = []
    for t in tensors:
        dtype = t.dtype
        t = t.to(torch.int64) if dtype == torch.bool else t  # gloo gathers no bool tensors
        t = acc.gather(acc.pad_across_processes(t.contiguous(), dim=1, pad_index=0))
        out.append(t.bool() if dtype == torch.bool else t)
    return out


def _rows(values: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    return [v[m] for v, m in zip(values, mask, strict=True)]


def batch_metrics(old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, args) -> dict:
    """The logged per-batch metrics from the trainer's and the sampler's (B, T) fp32 log-probs over ``mask``."""
    mm = mismatch_metrics(_rows(old, mask), _rows(sampling, mask))
    metrics = {k: mm[k] for k in MISMATCH_KEYS}
    low, high = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
    band = high is not None and (low is None or 0 < low < high)
    correction = ISCorrection("token-tis", low, high) if band else ISCorrection("none", None, None)
    _, stats = is_weights(old, sampling, mask, correction)  # the weights are TRL's business; the raw stats are ours
    metrics |= {k: stats[k] for k in RAW_IS_KEYS}
    if band:  # fractions of raw token ratios outside TRL's [clip_min, clip_max]
        metrics |= {k: stats[k] for k in FRACTION_KEYS}
    return metrics


def trainer_logps(trainer, output: dict, mode: str) -> torch.Tensor:
    """The policy's per-token log-probs of a scored batch, computed exactly as TRL computes its ``old`` ones."""
    ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
    args = trainer.args
    batch_size = args.per_device_train_batch_size if mode == "train" else args.per_device_eval_batch_size
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, attention, output["completion_ids"].size(1), batch_size=batch_size
        )
    return logps


__all__ = ["MismatchLogger", "RoundalignCallback", "SHARE_METRIC", "batch_metrics", "log_sync", "trainer_logps"]
