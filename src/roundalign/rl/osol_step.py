"""OSOL inside ``roundalign train`` (``--adv-estimator osol``): the focus domain, the footprint, the metrics.

The formulas are in rl/osol.py; this module feeds them from a run. The footprint of the previous update needs the
previous weights: after every sync the run hands over what the trainer's compute copy was set from (the served copy
under ``--loss-on-served``, else a copy of the RNE cast), and the one before it is kept. A step then

1. recomputes the focus domain's completions on the previous weights, with the run's own trainer profile (one extra
   forward over 1/D of the batch), so u = log pi_k - log pi_{k-1} is a difference of two forwards of one trainer;
2. builds the corrected per-token advantages;
3. after its sync, recomputes the same completions on the new weights (another forward over 1/D of the batch): the
   realized change v, and how much of the last update it undoes (``osol/backtracking``).

The footprint against the trainer's mismatch (``osol/footprint_below_mismatch``, ``osol/rank_change_frac``) takes d,
the trainer's recomputed log-prob minus the sampler's, on the same focus tokens. A trainer that is bit-exact to the
sampler has d = 0 and both are 0; a stock trainer's d is the rounding noise inside its footprint.

The previous weights are part of the checkpoint (``state.pt``, tensors only), so a resumed run computes the same
footprints as the uninterrupted one. The first step has no previous update: no residual, and its footprint metrics
are null.
"""

from __future__ import annotations

import torch

from roundalign.rl.config import TrainConfig
from roundalign.rl.osol import (
    backtracking,
    base_advantages,
    corrected_advantages,
    focus_domain,
    footprint_vs_mismatch,
    residual_seed,
    step_metrics,
)


class OsolStep:
    def __init__(self, config: TrainConfig, n_domains: int):
        self.config, self.n_domains = config, n_domains
        self.previous: dict | None = None  # the compute copy's source one sync ago: pi_{k-1}
        self.current: dict | None = None  # the compute copy's source now: pi_k
        self._focus_rows: list[int] = []
        self._u: list[torch.Tensor] = []  # this step's footprint on its focus rows
        self._old: list[torch.Tensor] = []  # their log-probs on pi_k, the trainer's recompute

    # weights ----------------------------------------------------------------------------------------------------

    def remember(self, policy, source: dict | None, served: dict | None = None) -> None:
        """After a sync set the compute copy from ``source`` (None: the RNE cast of the master). ``served``: the
        export, when it is that RNE cast itself (``--sync rne``, a bf16 engine), kept instead of a second copy."""
        self.previous = self.current
        if source is None:
            source = served if served is not None else {n: p.detach().clone() for n, p in policy._compute.items()}
        self.current = source

    @staticmethod
    def _logprobs(policy, outs, rows: list[int]) -> list[torch.Tensor]:
        """The trainer's log-probs (no gradient) of the completions ``rows`` on its compute copy as it is now."""
        return [policy.logprobs(outs[i].prompt_token_ids, outs[i].token_ids)[0] for i in rows]

    def _logprobs_on(self, policy, weights: dict, outs, rows: list[int]) -> list[torch.Tensor]:
        policy.set_compute_weights(weights)
        try:
            return self._logprobs(policy, outs, rows)
        finally:
            policy.set_compute_weights(self.current)  # back to pi_k, bit for bit (copies, no arithmetic)

    # the step -----------------------------------------------------------------------------------------------------

    def advantages(self, step, policy, outs, domains, grpo, old_pad, mask, sampler_pad) -> tuple[torch.Tensor, dict]:
        """(B, T) corrected advantages and the step's osol/* metrics."""
        c = self.config
        focus = focus_domain(self.n_domains, c.seed, step, c.osol_schedule)
        base = base_advantages(grpo, domains, focus, c.osol_focus_weight, c.osol_other_weight)
        base = base[:, None].expand(mask.shape).clone()
        focus_rows = torch.tensor([d == focus for d in domains])
        rows = focus_rows.nonzero().flatten().tolist()
        u = torch.zeros(mask.shape)
        have_footprint = self.previous is not None
        if have_footprint:
            previous = self._logprobs_on(policy, self.previous, outs, rows)
            for i, lp in zip(rows, previous, strict=True):
                u[i, : len(lp)] = old_pad[i, : len(lp)] - lp
        generator = torch.Generator().manual_seed(residual_seed(c.seed, step))
        result = corrected_advantages(
            base, mask, focus_rows, u, tau=c.osol_tau, clip=c.osol_clip, p_lo=c.osol_p_lo, p_hi=c.osol_p_hi,
            residual=c.osol_residual if have_footprint else "none", generator=generator,
        )  # fmt: skip
        in_e = mask & focus_rows[:, None]
        m = step_metrics(result, focus, u[in_e] if have_footprint else None)
        m |= {"osol/footprint_below_mismatch": None, "osol/rank_change_frac": None}
        if have_footprint:
            d = (old_pad - sampler_pad)[in_e]
            share = footprint_vs_mismatch(u[in_e], d, c.osol_p_lo, c.osol_p_hi)
            m["osol/footprint_below_mismatch"] = share["below_mismatch"]
            m["osol/rank_change_frac"] = share["rank_change"]
        self._focus_rows = rows if have_footprint else []
        self._u = [u[i, : len(outs[i].token_ids)] for i in self._focus_rows]
        self._old = [old_pad[i, : len(outs[i].token_ids)] for i in self._focus_rows]
        return result.advantages, m

    def backtracking(self, step: int, policy, outs) -> dict:
        """After the sync: how much of the last update (this step's footprint) the one just made undoes."""
        every = self.config.osol_backtracking_every
        if not self._focus_rows or not every or step % every:
            return {"osol/backtracking": None, "osol/backtrack_token_frac": None}
        after = self._logprobs(policy, outs, self._focus_rows)  # on pi_{k+1}, which the sync just set
        v = torch.cat([a - o for a, o in zip(after, self._old, strict=True)])
        out = backtracking(torch.cat(self._u), v)
        return {"osol/backtracking": out["ratio"], "osol/backtrack_token_frac": out["token_frac"]}

    # checkpoints ----------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"previous": self.previous}

    def load_state_dict(self, state: dict | None) -> None:
        self.previous = None if state is None else state["previous"]
