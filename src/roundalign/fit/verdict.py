"""The verdict of a fit: per region, whether the dump decides its rule; the margin over the runner-up; the profile.

All evidence is the sign test (``sign_test``): on how many tokens is one candidate's log-prob closer to the engine's
than another's, and the reverse. Ties (both equal, or equally far) carry no evidence. Under the hypothesis that the
two candidates are equally good, each differing token is a coin flip, so ``z = (wins - losses) / sqrt(wins + losses)``
is about standard normal; ``z >= 3`` is a clear majority, and on a prefill dump, where the right rules are exact,
z is the square root of the number of tokens the two disagree on.
"""

from __future__ import annotations

import math

import torch

from roundalign.fit.space import Candidate, Space

# The ranking's metrics, in order (verl's and the probe's names).
KEYS = ("mismatch/bitwise_equal_frac", "rollout_corr/k3_kl", "mismatch/log_ratio_rms")


def sign_test(a: torch.Tensor, b: torch.Tensor, data: torch.Tensor) -> tuple[int, int, float]:
    """Tokens where ``a`` is closer to ``data`` than ``b``, the reverse, and the sign test's z (0 if none differ)."""
    da, db = (a.double() - data.double()).abs(), (b.double() - data.double()).abs()
    wins, losses = int((da < db).sum()), int((db < da).sum())
    n = wins + losses
    return wins, losses, (wins - losses) / math.sqrt(n) if n else 0.0


def regions_verdict(space: Space, survivors: list, equivalents, idxs, data, pruned, decide_z: float) -> dict:
    """Per searched region: the best's rule, and whether the data decides it against the region's other rules.

    ``identical``: a candidate with another rule here gives the best's log-probs bit for bit. ``determined``: the
    best beats the best candidate with another rule here on a clear majority of the tokens where they differ
    (z >= decide_z), or every other rule was dropped at screening. ``unclear``: neither; more tokens, or a prefill
    dump (docs/fit.md), would decide it.
    """
    best = survivors[0]
    ref = best.cat(idxs)
    out = {}
    for region in space.regions:
        rule = best.candidate.rule(region)
        same = sorted({c.rule(region) for c in equivalents} - {rule})
        alt = next((e for e in survivors if e.candidate.rule(region) not in {rule, *same}), None)
        if same:
            why = f"{rule} and {', '.join(same)} give bitwise-identical log-probs on this dump"
            if alt is not None:
                wins, losses, z = sign_test(ref, alt.cat(idxs), data)
                why += f"; vs {alt.candidate.rule(region)}: closer on {wins} tokens, farther on {losses} (z {z:.1f})"
            out[region] = {"rule": rule, "status": "identical", "alternatives": same, "why": why}
            continue
        if alt is None:
            zs = [d["z"] for d in pruned if d["region"] == region and d["dropped"]]
            out[region] = {
                "rule": rule,
                "status": "determined",
                "z": min(zs) if zs else None,
                "why": f"every other rule dropped at screening (z >= {min(zs):.1f})" if zs else "",
            }
            continue
        wins, losses, z = sign_test(ref, alt.cat(idxs), data)
        status = "determined" if z >= decide_z else "unclear"
        out[region] = {
            "rule": rule,
            "status": status,
            "z": z,
            "vs": alt.candidate.rule(region),
            "tokens_closer_with_best": wins,
            "tokens_closer_with_other": losses,
            "why": f"{rule} vs {alt.candidate.rule(region)}: closer on {wins} tokens, farther on {losses} "
            f"(z {z:.1f}{'' if status == 'determined' else f' < {decide_z:g}'})",
        }
    return out


def margin(best, runner_up, idxs, data: torch.Tensor, decide_z: float) -> dict:
    if runner_up is None:
        return {"runner_up": None}
    wins, losses, z = sign_test(best.cat(idxs), runner_up.cat(idxs), data)
    b, r = best.metrics, runner_up.metrics
    return {
        "runner_up": runner_up.candidate.label(),
        "decided": z >= decide_z,
        "bitwise_equal_frac_gap": b[KEYS[0]] - r[KEYS[0]],
        "k3_kl_ratio": r[KEYS[1]] / b[KEYS[1]] if b[KEYS[1]] > 0 else math.inf,
        "tokens_closer_with_best": wins,
        "tokens_closer_with_runner_up": losses,
        "z": z,
    }


def fitted_profile(space: Space, best: Candidate, named_matches, regions: dict, stats):
    """The profile file's content: the best candidate, preferring a built-in profile's rules within its class."""
    named = space.named()
    chosen = next((named[n] for n in named_matches), best)
    fill = named_matches[0] if named_matches else space.nearest_named(chosen)

    def listed(status: str) -> str:
        return ", ".join(r for r, d in regions.items() if d["status"] == status) or "none"

    source = (
        f"roundalign fit on {stats['tokens']} tokens ({stats['sequences']} sequences), model_type "
        f"{space.model_type}, head_dim {space.head_dim} (rope fitted for this head_dim only). Determined: "
        f"{listed('determined')}; identical on the dump to other rules: {listed('identical')}; unclear: "
        f"{listed('unclear')}; not exercised, filled from {fill}: {', '.join(space.idle) or 'none'}"
    )
    engines = (
        ("fit: bitwise identical on the dump to " + ", ".join(named_matches))
        if named_matches
        else f"fit: no built-in profile matches; nearest {fill}"
    )
    return space.profile(
        chosen, name=f"fit-{named_matches[0]}" if named_matches else "fit", fill=fill, engines=engines, source=source
    )
