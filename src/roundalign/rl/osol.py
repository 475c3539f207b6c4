"""OSOL's cross-step interference control ("One Step, One Lead", Lin et al., arXiv 2609.06469), as formulas.

Multi-domain GRPO loses per-domain quality because consecutive updates partly undo each other. OSOL measures that per
token with the *footprint* of the previous update on the current batch, u_i = log pi_k(a_i) - log pi_{k-1}(a_i)
(the previous checkpoint's log-probs of the current tokens, stop-gradient), and penalises the tokens the last update
pushed down the most, in one rotating *focus* domain per step:

    focus        f_k != f_{k-1}                                  focus_domain (schedule: ours, see below)
    base         A_base_i = w(d_i) * A_grpo_i,  w_focus > w_other  base_advantages
    candidates   C = { i in E : u_i < 0 },  E = the focus domain's completion tokens
    profile      q_i in [-p_hi, -p_lo] by rank of u_i in C (most negative first), 0 outside C     rebound_profile
    scale        kappa = tau * std_E(A_base) / std_E(q)
    advantage    A~_i = clip(A_base_i + kappa * q_i, -c, c)     penalty only: q <= 0      corrected_advantages

The paper leaves these open; the choices here are roundalign's (docs/multi-domain.md says so):
- the rank-to-profile map: linear in the rank, -p_hi for the most negative footprint to -p_lo for the least, ties
  taking the mean of the ranks they span (so equal footprints get equal penalties); one candidate gets -p_hi;
- std over E (every focus token, the zeros of the non-candidates included), population std (ddof 0), in float64;
  kappa = 0 where either std is 0 (no candidate, one value everywhere, a zero-variance batch): no residual;
- the focus schedule: uniform over the domains other than the last focus ("random"), or a fixed rotation ("cycle");
- the clip applies to every token's advantage, focus or not, so the objective is one formula.

Diagnostics (``footprint_vs_mismatch``, ``backtracking``) say whether the footprint is signal: with a trainer whose
log-probs differ from the sampler's by d_i, part of u is that noise.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor

SCHEDULES = ("random", "cycle")
RESIDUALS = ("drift", "random", "none")


def _h(seed: int, k: int) -> int:
    digest = hashlib.sha256(f"roundalign.osol/focus/{seed}/{k}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def focus_domain(n_domains: int, seed: int, step: int, schedule: str = "random") -> int:
    """The focus domain's index at ``step`` (>= 1): never the previous step's, a pure function of (seed, step) so
    that a resumed run continues the same sequence."""
    if isinstance(n_domains, bool) or not isinstance(n_domains, int) or n_domains < 2:
        raise ValueError(f"OSOL rotates a focus over domains: it needs at least 2, got {n_domains!r}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1, got {step!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown focus schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if schedule == "cycle":
        return (_h(seed, 0) % n_domains + step - 1) % n_domains
    focus = _h(seed, 1) % n_domains
    for k in range(2, step + 1):  # each draw excludes the previous focus; O(step) integer work, nothing stored
        j = _h(seed, k) % (n_domains - 1)
        focus = j if j < focus else j + 1
    return focus


def residual_seed(seed: int, step: int) -> int:
    """The random-residual ablation's permutation seed for (run seed, step), shared by every caller so that
    ``roundalign train`` and the TRL integration draw the same permutations."""
    digest = hashlib.sha256(f"roundalign.osol/random-residual/{seed}/{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def base_advantages(grpo: Tensor, domains: list[int], focus: int, w_focus: float, w_other: float) -> Tensor:
    """GRPO's advantage weighted by domain: ``w_focus`` for the focus domain's samples, ``w_other`` for the rest."""
    if len(domains) != grpo.numel():
        raise ValueError(f"{len(domains)} domain labels for {grpo.numel()} advantages; give one per completion")
    for name, w in (("w_focus", w_focus), ("w_other", w_other)):
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) or w < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {w!r}")
    weights = torch.tensor([w_focus if d == focus else w_other for d in domains], dtype=torch.float32)
    return grpo.float() * weights


def rebound_profile(u: Tensor, p_lo: float = 0.1, p_hi: float = 1.0) -> Tensor:
    """q (N,) fp32: 0 where u >= 0; over the candidates (u < 0), linear in the rank of u from -p_hi (most negative)
    to -p_lo (least), tied values sharing the mean of their ranks."""
    if not (0 <= p_lo <= p_hi <= 1):
        raise ValueError(f"the profile needs 0 <= p_lo <= p_hi <= 1, got p_lo={p_lo!r}, p_hi={p_hi!r}")
    if u.dim() != 1:
        raise ValueError(f"u must be 1-D (the focus tokens' footprints), got shape {tuple(u.shape)}")
    if not torch.isfinite(u).all():
        raise ValueError("the footprint u is not finite; the previous checkpoint's log-probs must be finite")
    q = torch.zeros(u.shape, dtype=torch.float64)
    idx = (u < 0).nonzero().flatten()
    n = idx.numel()
    if n == 0:
        return q.float()
    if n == 1:
        q[idx] = -p_hi
        return q.float()
    values = u[idx].double()
    order = torch.argsort(values, stable=True)
    ranks = torch.empty(n, dtype=torch.float64)
    ranks[order] = torch.arange(n, dtype=torch.float64)
    # ties: every member of a run of equal values takes the mean rank of the run
    uniq, inverse = torch.unique(values, return_inverse=True)
    mean_rank = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inverse, ranks)
    mean_rank /= torch.bincount(inverse, minlength=uniq.numel()).double()
    q[idx] = -(p_hi - (p_hi - p_lo) * mean_rank[inverse] / (n - 1))
    return q.float()


@dataclass
class OsolResult:
    """``corrected_advantages``' output: the per-token advantages and what the step's metrics report."""

    advantages: Tensor  # (B, T) fp32, 0 at padding
    q: Tensor  # (B, T) fp32, the profile at the focus tokens, 0 elsewhere
    kappa: float
    candidates: int
    focus_tokens: int
    residual_share: float


def _std(x: Tensor) -> float:
    return float(x.double().std(correction=0)) if x.numel() else 0.0


def corrected_advantages(
    base: Tensor,
    mask: Tensor,
    focus: Tensor,
    u: Tensor,
    *,
    tau: float = 0.03,
    clip: float = 3.0,
    p_lo: float = 0.1,
    p_hi: float = 1.0,
    residual: str = "drift",
    generator: torch.Generator | None = None,
) -> OsolResult:
    """A~ = clip(A_base + kappa q, -clip, clip) on the focus tokens, clip(A_base) on the others (module docstring).

    base (B, T) fp32 per-token base advantages; mask (B, T) bool; focus (B,) bool; u (B, T) fp32, read at the focus
    tokens only. ``residual``: "drift" (OSOL), "random" (the same profile values in a random order over the focus
    tokens: same scale, no drift ranking; an ablation), "none" (kappa = 0: the domain weights alone)."""
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
        raise TypeError("mask must be a (B, T) bool tensor")
    for name, t in (("base", base), ("u", u)):
        if not isinstance(t, Tensor) or t.shape != mask.shape:
            raise ValueError(f"{name} must be a tensor of mask's shape {tuple(mask.shape)}")
    if not isinstance(focus, Tensor) or focus.dtype != torch.bool or focus.shape != mask.shape[:1]:
        raise ValueError(f"focus must be a (B,) bool tensor, B = {mask.shape[0]}")
    if residual not in RESIDUALS:
        raise ValueError(f"unknown residual {residual!r}; choose one of {', '.join(RESIDUALS)}")
    if not (math.isfinite(tau) and tau >= 0):
        raise ValueError(f"tau must be a finite number >= 0, got {tau!r}")
    if not (math.isfinite(clip) and clip > 0):
        raise ValueError(f"clip must be a finite number > 0, got {clip!r}")
    in_e = mask & focus[:, None]
    base_e = base[in_e]  # row-major: row by row, left to right
    q_e = rebound_profile(u[in_e].float(), p_lo, p_hi)
    candidates = int((u[in_e] < 0).sum())
    if residual == "none":
        q_e = torch.zeros_like(q_e)
    elif residual == "random":
        q_e = q_e[torch.randperm(q_e.numel(), generator=generator)]
    std_q, std_a = _std(q_e), _std(base_e)
    kappa = tau * std_a / std_q if residual != "none" and std_q > 0 and std_a > 0 else 0.0
    adv = torch.where(mask, base, 0.0).double()
    q = torch.zeros(mask.shape, dtype=torch.float32)
    q[in_e] = q_e
    step = kappa * q_e.double()
    adv[in_e] = base_e.double() + step
    adv = torch.where(mask, adv.clamp(-clip, clip), 0.0).float()
    moved = float(step.abs().sum())
    denom = float(base_e.double().abs().sum()) + moved
    return OsolResult(
        advantages=adv,
        q=q,
        kappa=kappa,
        candidates=candidates,
        focus_tokens=int(in_e.sum()),
        residual_share=moved / denom if denom > 0 else 0.0,
    )


def step_metrics(result: OsolResult, focus: int, u_focus: Tensor | None) -> dict:
    """A step's ``osol/*`` metrics (verl-style names, as ``roundalign train`` and the TRL integration log them);
    ``u_focus`` is the footprint on the focus tokens, None on a step without one (the first): its figures are null."""
    have = u_focus is not None
    return {
        "osol/focus_domain": focus,
        "osol/focus_tokens": result.focus_tokens,
        "osol/candidates": result.candidates if have else None,
        "osol/kappa": result.kappa if have else None,
        "osol/residual_share": result.residual_share if have else None,
        "osol/footprint_mean": float(u_focus.double().mean()) if have and u_focus.numel() else None,
    }


def footprint_vs_mismatch(u: Tensor, d: Tensor, p_lo: float = 0.1, p_hi: float = 1.0) -> dict[str, float]:
    """How much of the footprint u (focus tokens) is within the trainer's mismatch d (its log-prob minus the
    sampler's at the same tokens): ``below_mismatch``, the share of candidates with |u| <= |d|; ``rank_change``, the
    share of tokens whose penalty changes when u's current side is the sampler's (u - d). Both 0 when d == 0."""
    if u.shape != d.shape or u.dim() != 1:
        raise ValueError(f"u and d must be 1-D of one shape, got {tuple(u.shape)} and {tuple(d.shape)}")
    cand = u < 0
    n_cand = int(cand.sum())
    below = float((u[cand].abs() <= d[cand].abs()).sum()) / n_cand if n_cand else 0.0
    if not u.numel():
        return {"below_mismatch": below, "rank_change": 0.0}
    changed = rebound_profile(u.float(), p_lo, p_hi) != rebound_profile((u.double() - d.double()).float(), p_lo, p_hi)
    return {"below_mismatch": below, "rank_change": float(changed.double().mean())}


def backtracking(u: Tensor, v: Tensor) -> dict[str, float | None]:
    """How much of the last update (footprint u) the current one (its realized change v, same tokens) undoes:
    ``ratio`` = -<u, v> / <u, u> (1: undone exactly; None when u is 0), ``token_frac``: share of tokens with u v < 0."""
    if u.shape != v.shape or u.dim() != 1:
        raise ValueError(f"u and v must be 1-D of one shape, got {tuple(u.shape)} and {tuple(v.shape)}")
    uu = float((u.double() ** 2).sum())
    ratio = -float((u.double() * v.double()).sum()) / uu if uu > 0 else None
    frac = float((u.double() * v.double() < 0).double().mean()) if u.numel() else 0.0
    return {"ratio": ratio, "token_frac": frac}
