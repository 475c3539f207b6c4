"""OSOL's advantage (rl/osol.py, "One Step, One Lead") inside TRL's ``GRPOTrainer``: per-token advantages from TRL's.

A TRL user keeps the trainer and adds two lines (docs/trl.md, "OSOL's advantage in GRPOTrainer")::

    osol = OsolAdvantage(domains=["arithmetic", "counting"], domain_column="domain")
    osol.attach(trainer)                      # right after GRPOTrainer(...), before train()

**The seam.** TRL 1.16 computes advantages inline in ``GRPOTrainer._generate_and_score_completions`` and has no
smaller hook for them; its maintainers' answer is to override that one method and return its dict with other
``advantages`` (trl#4525), and ``_compute_loss`` unsqueezes only 1-D advantages "to support subclasses that provide
advantages with shape (B, T)". ``attach`` makes that override on the trainer instance, as the mismatch metrics do,
after ``seams.check_source`` found the loss and the batch flow it relies on (``seams.TRL_ADVANTAGES``).

Per training generation batch k (counted from 1 since ``attach``):

1. each completion's domain is its dataset row's ``domain_column`` (TRL hands the rows to the method as ``inputs``);
2. the focus is ``focus_domain(D, seed, k, schedule)``, seed ``args.seed`` unless given;
3. ``base_advantages`` weights TRL's per-sequence advantages, broadcast over each completion's tokens;
4. the footprint u = log pi_k - log pi_{k-1} of the focus completions: TRL's own scoring call
   (``_get_per_token_logps_and_entropies``: the same model, autocast and fused head as its loss) runs twice on the
   focus rows, on the trainable weights kept from batch k-1 and on the live ones. Both runs see the same rows with the
   same padding, so u carries no batch-shape noise (a CPU GEMM may round a row differently in another batch). The
   kept tensors are swapped in as each parameter's ``.data`` and the live tensors put back: bit for bit, no copy;
5. ``corrected_advantages`` gives the (B, T) advantages that replace ``output["advantages"]``.

Steps 3-5 run on the batch of all ranks (gathered), as TRL normalises its rewards over all ranks, and each rank keeps
its rows. Batch 1 has no previous weights: the domain weights alone (residual "none"), as ``roundalign train``.
Cost: one copy of the trainable parameters, and two no-grad forwards over the focus rows (about 2/D of a batch).
Eval batches keep TRL's advantages. Nothing is checkpointed: a resumed run restarts the focus sequence at k = 1.
"""

from __future__ import annotations

import math

import torch

from roundalign.integrations import trl_metrics
from roundalign.integrations.seams import TRL_ADVANTAGES, check_source
from roundalign.integrations.trl_policy import check_not_sharded, unwrap_policy
from roundalign.rl.osol import (
    RESIDUALS,
    SCHEDULES,
    base_advantages,
    corrected_advantages,
    focus_domain,
    residual_seed,
    step_metrics,
)

__all__ = ["LOSS_TYPES", "OsolAdvantage"]

# TRL 1.16 loss types whose loss reads a (B, T) advantage token by token (_compute_loss): each multiplies it into
# a per-token term. "vespo" is not here: its gamma weight is one per sequence, shaped by the sign of the sequence's
# advantage (get_gamma_weights), and a per-token sign would make it per token.
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo")
# What a vision-language batch adds to the output: the footprint's forward is text only.
_MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "token_type_ids", "mm_token_type_ids")


def _number(name: str, value, least: float, strict: bool = False) -> float:
    ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    if not ok or value < least or (strict and value == least):
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {least:g}, got {value!r}")
    return float(value)


class OsolAdvantage:
    """OSOL's per-token advantage for a TRL ``GRPOTrainer`` (module docstring). Defaults as ``roundalign train``.

    Args:
        domains: the domain values the dataset's ``domain_column`` holds, at least 2; a domain's index in this list
            is what ``osol/focus_domain`` logs and ``focus_domain`` draws.
        domain_column: the dataset column naming each prompt's domain.
        focus_weight, other_weight: ``base_advantages``' weights of the focus domain and of the others.
        tau, clip, p_lo, p_hi, residual: ``corrected_advantages``' scale, clip, profile and residual
            ("drift", "random", "none").
        schedule: ``focus_domain``'s schedule, "random" or "cycle".
        seed: the focus sequence's seed; None takes the trainer's ``args.seed``.
    """

    def __init__(
        self,
        domains,
        *,
        domain_column: str = "domain",
        focus_weight: float = 1.0,
        other_weight: float = 0.5,
        tau: float = 0.03,
        clip: float = 3.0,
        p_lo: float = 0.1,
        p_hi: float = 1.0,
        residual: str = "drift",
        schedule: str = "random",
        seed: int | None = None,
    ) -> None:
        domains = list(domains)
        if len(domains) < 2:
            raise ValueError(f"OSOL rotates a focus over domains: give at least 2, got {domains!r}")
        if len(set(domains)) != len(domains):
            raise ValueError(f"domains must be distinct, got {domains!r}")
        if not isinstance(domain_column, str) or not domain_column:
            raise ValueError(f"domain_column must name a dataset column, got {domain_column!r}")
        if residual not in RESIDUALS:
            raise ValueError(f"unknown residual {residual!r}; choose one of {', '.join(RESIDUALS)}")
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown focus schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if not (0 <= p_lo <= p_hi <= 1):
            raise ValueError(f"the profile needs 0 <= p_lo <= p_hi <= 1, got p_lo={p_lo!r}, p_hi={p_hi!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"seed must be an int >= 0 or None (the trainer's args.seed), got {seed!r}")
        self.domains, self.domain_column = domains, domain_column
        self.focus_weight = _number("focus_weight", focus_weight, 0)
        self.other_weight = _number("other_weight", other_weight, 0)
        self.tau, self.clip = _number("tau", tau, 0), _number("clip", clip, 0, strict=True)
        self.p_lo, self.p_hi, self.residual, self.schedule, self.seed = p_lo, p_hi, residual, schedule, seed
        self.trainer = None
        self.step = 0  # training generation batches scored since attach
        self.previous: dict[str, torch.Tensor] | None = None  # trainable weights at the last batch: pi_{k-1}
        self.last: dict | None = None  # the latest batch's metrics and tensors, for inspection and tests

    # attaching ----------------------------------------------------------------------------------------------------

    def attach(self, trainer) -> OsolAdvantage:
        """Check ``trainer``'s settings and TRL's source, then route its generation batches through OSOL."""
        if self.trainer is trainer:
            return self
        if self.trainer is not None:
            raise ValueError("this OsolAdvantage is already attached to another trainer; make one per trainer")
        self._check(trainer)
        original = trainer._generate_and_score_completions

        def generate_and_score(inputs):
            output = original(inputs)
            if trainer.model.training:  # eval batches keep TRL's advantages (and take no step)
                self._apply(trainer, inputs, output)
            return output

        trainer._generate_and_score_completions = generate_and_score
        self.trainer = trainer
        if self.seed is None:
            self.seed = int(trainer.args.seed)
        return self

    def _check(self, trainer) -> None:
        for name, needles in TRL_ADVANTAGES:  # the override has no smaller documented seam (integrations/seams.py)
            check_source(getattr(type(trainer), name), needles, "per-token advantages reaching the loss", "TRL")
        args = trainer.args
        if trainer.loss_type not in LOSS_TYPES:
            why = (
                "its gamma weight is one per sequence, picked by the sign of the sequence's advantage, and OSOL's "
                "advantages change sign within a sequence"
                if trainer.loss_type == "vespo"
                else "its loss has not been checked for per-token advantages"
            )
            raise ValueError(
                f"OSOL gives per-token advantages, which loss_type={trainer.loss_type!r} cannot use: {why}; use one "
                f"of {', '.join(LOSS_TYPES)}"
            )
        if any(getattr(x, "off_policy_mask_threshold", None) is not None for x in (trainer, args)):
            raise ValueError(
                "off_policy_mask_threshold is set: TRL's off-policy sequence mask keeps or drops a whole sequence by "
                "the sign of its advantage, and OSOL's advantages change sign within a sequence (TRL would mask "
                "token by token instead); unset it to use OSOL"
            )
        if getattr(args, "remove_unused_columns", False):
            raise ValueError(
                f"remove_unused_columns=True drops the {self.domain_column!r} column before TRL sees a batch; set "
                "remove_unused_columns=False (GRPOConfig's default)"
            )
        if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:
            raise ValueError(
                "OSOL's footprint swaps the previous weights into the policy, which FSDP and DeepSpeed shard; train "
                "with DDP or on one process"
            )
        check_not_sharded(unwrap_policy(trainer), "policy", "OSOL's footprint needs whole parameters")
        columns = getattr(trainer.train_dataset, "column_names", None)
        if columns is not None and self.domain_column not in columns:
            raise ValueError(
                f"the training dataset has no {self.domain_column!r} column (columns: {', '.join(columns)}); add "
                f"one naming each prompt's domain, or pass domain_column= the column that does"
            )

    # the batch --------------------------------------------------------------------------------------------------

    def _domains(self, inputs: list[dict]) -> list[int]:
        out = []
        for row in inputs:
            if self.domain_column not in row:
                raise ValueError(
                    f"a training row has no {self.domain_column!r} column (it has {', '.join(map(str, row))}); "
                    "give every prompt its domain in that column"
                )
            value = row[self.domain_column]
            if value not in self.domains:
                raise ValueError(
                    f"unknown domain {value!r} in column {self.domain_column!r}; OsolAdvantage(domains=...) knows "
                    f"{', '.join(map(repr, self.domains))}: add it there or fix the dataset"
                )
            out.append(self.domains.index(value))
        return out

    def _apply(self, trainer, inputs: list[dict], output: dict) -> None:
        if any(key in output for key in _MULTIMODAL):
            raise ValueError("OsolAdvantage scores text completions only; this batch has images or token types")
        grpo = output["advantages"]
        if grpo.dim() != 1 or grpo.numel() != len(inputs):
            raise RuntimeError(
                f"TRL gave advantages of shape {tuple(grpo.shape)} for {len(inputs)} completions; OsolAdvantage "
                "expects one per completion (is another hook already making per-token advantages?)"
            )
        domains = self._domains(inputs)
        self.step += 1
        focus = focus_domain(len(self.domains), self.seed, self.step, self.schedule)
        mask = output["completion_mask"].bool()
        if output.get("tool_mask") is not None:
            mask = mask & output["tool_mask"].bool()
        base = base_advantages(grpo.detach().cpu(), domains, focus, self.focus_weight, self.other_weight)
        base = base[:, None].expand(mask.shape).clone()
        focus_rows = torch.tensor([d == focus for d in domains])
        u = torch.zeros(mask.shape)
        rows = focus_rows.nonzero().flatten()
        have_footprint = self.previous is not None
        if have_footprint and rows.numel():
            u[rows] = self._footprint(trainer, output, rows.to(mask.device)).float().cpu()

        # The batch of all ranks, as TRL normalises its rewards; then this rank's rows and width.
        acc = trainer.accelerator
        mask_cpu = mask.cpu()
        g_base, g_mask, g_u = (_gather(acc, t) for t in (base, mask_cpu, u))
        g_focus = _gather(acc, focus_rows)
        result = corrected_advantages(
            g_base, g_mask, g_focus, g_u, tau=self.tau, clip=self.clip, p_lo=self.p_lo, p_hi=self.p_hi,
            residual=self.residual if have_footprint else "none",
            generator=torch.Generator().manual_seed(residual_seed(self.seed, self.step)),
        )  # fmt: skip
        n = len(inputs)
        start = acc.process_index * n
        output["advantages"] = result.advantages[start : start + n, : mask.shape[1]].to(grpo.device)

        in_e = g_mask & g_focus[:, None]
        metrics = step_metrics(result, focus, g_u[in_e] if have_footprint else None)
        trl_metrics._push(trainer, "train", metrics)
        self.last = {"metrics": metrics, "focus_rows": focus_rows, "u": u, "base": base, "domains": domains}
        self._remember(trainer)

    # the weights ----------------------------------------------------------------------------------------------

    @staticmethod
    def _trainable(trainer) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in unwrap_policy(trainer).named_parameters() if p.requires_grad}

    def _remember(self, trainer) -> None:
        """Keep the weights that sampled this batch: the next batch's pi_{k-1}."""
        with torch.no_grad():
            self.previous = {n: p.detach().clone() for n, p in self._trainable(trainer).items()}

    def _footprint(self, trainer, output: dict, rows: torch.Tensor) -> torch.Tensor:
        """(R, T) log pi_k - log pi_{k-1} of the focus rows, both by TRL's scoring call on the same sub-batch."""
        from trl.models.utils import disable_gradient_checkpointing

        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)[rows]
        attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)[rows]
        width = output["completion_ids"].size(1)

        def score() -> torch.Tensor:
            logps, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, attention, width, batch_size=trainer.args.per_device_train_batch_size
            )
            return logps

        params = self._trainable(trainer)
        if params.keys() != self.previous.keys():
            raise RuntimeError("the policy's trainable parameters changed between two batches; OSOL cannot compare")
        with torch.no_grad(), disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs):
            current = score()
            live = {n: p.data for n, p in params.items()}
            try:
                for n, p in params.items():
                    p.data = self.previous[n]
                previous = score()
            finally:
                for n, p in params.items():  # the live tensors themselves: pi_k back bit for bit
                    p.data = live[n]
        return current - previous


def _gather(acc, t: torch.Tensor) -> torch.Tensor:
    """Every rank's rows, padded to the widest; a no-op on one process."""
    if acc.num_processes == 1:
        return t
    dtype = t.dtype
    t = t.to(acc.device, torch.int64 if dtype == torch.bool else t.dtype)  # gloo gathers no bool tensors
    if t.dim() == 2:
        t = acc.pad_across_processes(t.contiguous(), dim=1, pad_index=0)
    t = acc.gather(t).cpu()
    return t.bool() if dtype == torch.bool else t
