"""What ``roundalign fit`` prints and writes: the verdict per region, the leading candidates, pruning, the profile.

``as_dict`` is the JSON report (``report.json``); ``render`` gives the rich renderables for the terminal. Both read
a ``FitResult`` and nothing else, so the numbers on screen and on disk are the same numbers.
"""

from __future__ import annotations

import math

from roundalign.fit.search import KEYS, DumpNotExplained, FitResult
from roundalign.fit.space import short

STATUS_STYLE = {"determined": "green", "identical": "yellow", "unclear": "red", "not exercised": "dim"}


def jsonable(obj):
    """``obj`` with non-finite floats as None: strict JSON has no Infinity (a k3_kl ratio over a best k3_kl of 0)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def as_dict(result: FitResult, top: int = 10) -> dict:
    def row(s) -> dict:
        return {"rules": s.candidate.as_dict(), **{k: s.metrics[k] for k in KEYS}}

    regions = {r: dict(d) for r, d in result.regions.items()}
    for region, why in result.space.idle.items():
        regions[region] = {"rule": None, "status": "not exercised", "why": why}
    return jsonable(
        {
            "profile": result.profile.to_dict(),
            "named_matches": result.named_matches,
            "rank_by": result.rank_by,
            "model_type": result.space.model_type,
            "head_dim": result.space.head_dim,
            "regions": regions,
            "best": row(result.best),
            "equivalents": [c.as_dict() for c in result.equivalents],
            "margin": result.margin,
            "ranking": [row(s) for s in result.ranking[:top]],
            "pruned": result.pruned,
            "excess": result.excess,
            "stats": result.stats,
        }
    )


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def render(result: FitResult, top: int = 10) -> list:
    from rich.table import Table

    out = []
    verdict = Table(title="fitted rule per region", title_justify="left")
    for col in ("region", "rule", "status", "evidence"):
        verdict.add_column(col, overflow="fold")
    for region, d in result.regions.items():
        style = STATUS_STYLE[d["status"]]
        verdict.add_row(region, d["rule"], f"[{style}]{d['status']}[/]", d["why"])
    for region, why in result.space.idle.items():
        verdict.add_row(
            region,
            f"({getattr(result.profile, region)})",
            "[dim]not exercised[/]",
            f"{why}; filled from the nearest built-in profile",
        )
    out.append(verdict)

    ranking = Table(
        title=f"leading candidates on {result.stats['tokens']} tokens (ranked by {result.rank_by})",
        title_justify="left",
    )
    ranking.add_column("#", justify="right")
    for region in result.space.regions:
        ranking.add_column(region)
    for key in KEYS:
        ranking.add_column(key.split("/")[-1], justify="right")
    best = result.best.candidate
    builtin: dict = {}
    for name, cand in result.space.named().items():
        builtin.setdefault(cand, []).append(name)
    ranking.add_column("built-in")
    for i, s in enumerate(result.ranking[:top], 1):
        c = s.candidate
        cells = [
            short(r) if r == best.rule(g) else f"[bold]{short(r)}[/]" for g, r in zip(c.regions, c.rules, strict=True)
        ]
        ranking.add_row(str(i), *cells, *(_fmt(s.metrics[k]) for k in KEYS), ", ".join(builtin.get(c, [])))
    out.append(ranking)

    m = result.margin
    lines = []
    if result.named_matches:
        lines.append(
            f"best: bitwise identical on this dump to the built-in profile(s) {', '.join(result.named_matches)}"
        )
    else:
        lines.append("best: no built-in profile gives these log-probs")
    if m.get("runner_up"):
        lines.append(
            f"runner-up ({m['runner_up']}): {m['bitwise_equal_frac_gap'] * 100:+.2f} points bitwise-equal, "
            f"k3_kl x{m['k3_kl_ratio']:.3g}; best closer on {m['tokens_closer_with_best']} tokens, runner-up "
            f"on {m['tokens_closer_with_runner_up']} (z {m['z']:.1f}"
            + (
                ")"
                if m["decided"]
                else ": not decided by this dump; more tokens or a prefill dump would decide, docs/fit.md)"
            )
        )
    else:
        lines.append("runner-up: none (every candidate scored gives the best's log-probs)")
    dropped = [d for d in result.pruned if d["dropped"]]
    st = result.stats
    pruning = (
        (
            f"; screened on {st['screen_tokens']} tokens, dropped {len(dropped)} rule(s), {st['survivors']} "
            "scored on the rest (the runner-up included)"
        )
        if st["screen_tokens"]
        else "; exhaustive"
    )
    lines.append(
        f"searched {st['candidates']} candidates, {st['forwards']} forwards in {st['seconds']:.1f} s "
        f"({st['seconds_per_forward'] * 1e3:.1f} ms each){pruning}"
    )
    e = result.excess
    kernels = (
        ""
        if e["kernel_scale"] is None
        else f" and the kernel scale {e['kernel_scale']:.3g} ({st['model_check_decode_forwards']} decode forwards)"
    )
    lines.append(
        f"model check: dump {e['distance']:.3g} from the best ({e['statistic']} over {e['tokens']} tokens), "
        f"{e['excess']:.2g}x the larger of the rounding scale {e['rounding_scale']:.3g}{kernels} "
        f"(limit {e['max_excess']:g}x)"
    )
    out.append("\n".join(lines))
    return out


def render_not_explained(exc: DumpNotExplained) -> str:
    ev = exc.evidence
    return (
        f"closest candidate: {ev['closest']}\n"
        f"  bitwise-equal {ev['metrics'][KEYS[0]]:.3g}, k3_kl {ev['metrics'][KEYS[1]]:.3g}, "
        f"RMS log-ratio {ev['metrics'][KEYS[2]]:.3g} over {ev['tokens']} tokens"
    )
