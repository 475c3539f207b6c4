"""The GRPO / REINFORCE objective ``roundalign train`` minimises, written once here as formulas.

For a prompt, the rollout engine samples a group of G completions y_1..y_G and a task reward r_i for each. Then

    advantage   A_i = (r_i - mean_g r) / (std_g r + eps)            std the unbiased (n-1) std, as TRL and verl
                A_i =  r_i - mean_g r                                scale=False (Dr. GRPO, TRL scale_rewards="none")
    ratio       r_t = exp(clamp(logp_t - old_logp_t, -20, 20))       logp: the trainer now (differentiable);
                                                                     old_logp: the trainer at the rollout's weights
    grpo        l_t = -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)     PPO-clip; eps_high defaults to eps_low
    reinforce   l_t = -A logp_t                                      plain REINFORCE (gradient -A d logp_t)
    IS weight   w_t from roundalign.numerics.correction (TIS / MIS between the engine's and old log-probs; 1 without)
    loss        L = sum over valid tokens of w_t l_t  /  N           N = number of valid tokens ("token-mean")

"token-mean" is verl's default ``loss_agg_mode``. When the loop splits a batch into micro-batches it passes the
whole batch's valid-token count as N, so the micro-batch losses (and gradients) sum to the batch's token mean.
The log-ratio clamp is verl's (``compute_policy_loss_vanilla`` clamps to [-20, 20] before exp); it only matters
for ratios beyond e^20, which it keeps finite. verl's dual clip (clip_ratio_c) is not part of this objective.

The gradient of a valid token's loss with respect to logp_t is -A r_t w_t / N where PPO-clip's unclipped term
binds, 0 where the clipped term binds (the ratio left [1 - eps_low, 1 + eps_high] on the side A pushes it), and
-A w_t / N for REINFORCE. With one inner epoch logp == old_logp, r_t = 1 exactly, and GRPO's gradient is
REINFORCE's, bit for bit (tests/test_rl_objective.py checks it).

Statistics use verl's names: actor/pg_loss (the returned loss), actor/pg_clipfrac (fraction of valid tokens where
the clipped term binds), actor/ppo_kl (mean of old_logp - logp), actor/ratio_mean (mean r_t), over this call's
valid tokens, in float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from roundalign.numerics.correction import SAFETY_BOUND

LOSS_TYPES = ("grpo", "reinforce")


def group_advantages(rewards: Tensor, group_size: int, eps: float = 1e-6, scale: bool = True) -> Tensor:
    """rewards (B,) fp32, consecutive groups of `group_size` completions of the same prompt (B % group_size == 0,
    else ValueError). A_i = (r_i - mean_g) / (std_g + eps) with std the unbiased (n-1) std as TRL and verl compute
    it; scale=False gives r_i - mean_g (Dr. GRPO / TRL scale_rewards="none"). group_size 1 -> ValueError (GRPO needs
    groups of >= 2)."""
    if not isinstance(rewards, Tensor):
        raise TypeError(f"rewards must be a torch.Tensor of shape (B,), got {type(rewards).__name__}")
    if rewards.dtype != torch.float32:
        raise TypeError(f"rewards must be float32, got {rewards.dtype}; pass rewards.float()")
    if rewards.dim() != 1 or rewards.numel() == 0:
        raise ValueError(f"rewards must have shape (B,) with B >= 1, got {tuple(rewards.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (GRPO compares completions of one prompt), got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of {group_size}; pass group_size completions "
            "per prompt, consecutively"
        )
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite positive float, got {eps!r}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf; every completion needs a finite reward")
    groups = rewards.view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


@dataclass
class PolicyLoss:
    """What ``policy_loss`` returns: the scalar loss to backpropagate and verl-named statistics."""

    loss: Tensor
    stats: dict[str, float] = field(default_factory=dict)


def _check_token_tensor(name: str, t: Tensor, mask: Tensor) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {t.dtype}; pass {name}.float()")
    if t.shape != mask.shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)} but mask has {tuple(mask.shape)}; they must match")
    bad = int((~torch.isfinite(t.detach()) & mask).sum())
    if bad:
        raise ValueError(f"{name} is not finite at {bad} completion tokens")


def _resolve_normalizer(normalizer: float | int | Tensor | None, mask: Tensor) -> float:
    if normalizer is None:
        return float(mask.sum())
    if isinstance(normalizer, Tensor):
        if normalizer.numel() != 1:
            raise ValueError(f"normalizer must be a scalar, got shape {tuple(normalizer.shape)}")
        normalizer = normalizer.item()
    if isinstance(normalizer, bool) or not isinstance(normalizer, (int, float)):
        raise TypeError(f"normalizer must be a number (the batch's valid-token count), got {type(normalizer).__name__}")
    if not math.isfinite(normalizer) or normalizer <= 0:
        raise ValueError(f"normalizer must be a finite positive token count, got {normalizer!r}")
    return float(normalizer)


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss_type: str = "grpo",
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    is_weights: Tensor | None = None,
    normalizer: float | int | Tensor | None = None,
) -> PolicyLoss:
    """grpo: PPO-clip per token, r_t = exp(logp - old_logp),
       l_t = -min(r_t * A, clip(r_t, 1 - clip_eps, 1 + clip_eps_high or clip_eps) * A)
       reinforce: l_t = -A * logp_t   (plain REINFORCE; old_logp unused except for ppo_kl stat)
       times the IS weight w_t (detached; None = 1) from correction.py,
       aggregated "token-mean" as verl's default loss_agg_mode: sum over valid tokens / normalizer, where normalizer
       defaults to mask.sum() (the loop passes the whole batch's valid token count when it splits the batch into
       micro-batches, so that the micro-batch losses sum to the batch's token mean).

    logp (B, T) float32 is differentiable; old_logp (B, T) float32 and is_weights (B, T) float32 >= 0 are detached;
    advantages is (B,) (one per completion) or (B, T) (per token); mask (B, T) bool. Padding never reaches the loss,
    its gradient or the statistics, whatever it holds.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; choose one of {', '.join(LOSS_TYPES)}")
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
        raise TypeError("mask must be a (B, T) bool tensor, True on completion tokens; use mask.bool()")
    empty = (~mask.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"rows {empty} of mask have no completion token; every completion needs at least one")
    _check_token_tensor("logp", logp, mask)
    _check_token_tensor("old_logp", old_logp, mask)
    for name, value in (("clip_eps", clip_eps), ("clip_eps_high", clip_eps_high)):
        if value is None and name == "clip_eps_high":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a finite positive float, got {value!r}")
    if clip_eps >= 1:
        raise ValueError(f"clip_eps must be below 1 (1 - clip_eps is the lower clip bound), got {clip_eps}")
    if not isinstance(advantages, Tensor) or advantages.dtype != torch.float32:
        raise TypeError("advantages must be a float32 tensor of shape (B,) or (B, T)")
    if advantages.shape == mask.shape[:1]:
        if not torch.isfinite(advantages).all():
            raise ValueError("advantages contain NaN or inf")
        adv = advantages.detach()[:, None]
    else:
        _check_token_tensor("advantages", advantages, mask)
        adv = advantages.detach()
    if is_weights is not None:
        _check_token_tensor("is_weights", is_weights, mask)
        if bool(((is_weights.detach() < 0) & mask).any()):
            raise ValueError("is_weights must be >= 0 at completion tokens (importance weights are ratios)")
        w = is_weights.detach()
    else:
        w = torch.ones_like(logp, dtype=torch.float32)
    n = _resolve_normalizer(normalizer, mask)
    high = clip_eps if clip_eps_high is None else clip_eps_high

    # Padding is replaced before any arithmetic, so huge or NaN values there cannot overflow into the sum (0 * inf)
    # and torch.where sends them no gradient.
    neg_adv = torch.where(mask, -adv, 0.0)
    w = torch.where(mask, w, 0.0)
    log_ratio = torch.where(mask, logp - old_logp.detach(), 0.0).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    ratio = torch.exp(log_ratio)
    if loss_type == "grpo":
        unclipped = neg_adv * ratio
        clipped = neg_adv * ratio.clamp(1.0 - clip_eps, 1.0 + high)
        # -min(rA, clip(r)A) = max(-rA, -clip(r)A); where() gives the whole gradient to the binding term.
        binds = clipped > unclipped  # verl's pg_clipfrac: torch.gt(pg_losses2, pg_losses1)
        per_token = torch.where(binds, clipped, unclipped)
    else:
        binds = torch.zeros_like(mask)
        per_token = neg_adv * torch.where(mask, logp, 0.0)
    loss = (per_token * w).sum() / n

    with torch.no_grad():
        valid = mask.sum().double()
        stats = {
            "actor/pg_loss": float(loss.detach()),
            "actor/pg_clipfrac": float((binds & mask).sum().double() / valid),
            "actor/ppo_kl": float(-log_ratio.double().sum() / valid),
            "actor/ratio_mean": float(ratio.double()[mask].sum() / valid),
        }
    return PolicyLoss(loss=loss, stats=stats)
