"""PNG plots of a probe run: per-token log-ratio histograms, per-layer agreement, region attribution.

matplotlib is the optional ``[cli]`` extra, so it is imported inside each function, with the non-interactive Agg
backend (the probe runs on headless machines). Each function writes one PNG and returns its path.

Two properties of the data shape the plots. Log-ratios span many decades (an fp32 ulp of a log-prob is ~1e-7,
a bf16 rounding flip ~1e-2), so the x axis is symmetric-log. And exact zeros are common (an aligned profile
often matches most tokens bit for bit), which a histogram cannot show on a log axis: they get their own hatched
bar at 0 and their count in the legend, so a run that is all zeros still reads as a bar, not an empty panel.
Attribution shares, by contrast, go on a fixed linear axis (``SHARE_AXIS``), with the rare share beyond it marked.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import Tensor

from roundalign import durable
from roundalign.probe.table import NA, fmt_pct

BINS_PER_DECADE = 8
# The attribution plot's share axis, in percent (plot_attribution says why it is fixed).
SHARE_AXIS = (-100.0, 200.0)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    durable.write_with(path, lambda tmp: fig.savefig(tmp, dpi=110, bbox_inches="tight"))
    _pyplot().close(fig)
    return path


def _symlog_edges(values: list[Tensor]) -> tuple[float, list[float]]:
    """linthresh below the smallest nonzero |value| and log-spaced bin edges mirrored around 0."""
    nonzero = torch.cat([v[v != 0].abs() for v in values])
    if nonzero.numel() == 0:
        lo, hi = 1e-7, 1e-3  # all exact zeros: a plausible range, so the zero bar has axes to sit in
    else:
        lo, hi = float(nonzero.min()), float(nonzero.max())
    lo_exp = math.floor(math.log10(lo))
    hi_exp = max(math.ceil(math.log10(hi)), lo_exp + 1)
    n = (hi_exp - lo_exp) * BINS_PER_DECADE
    positive = [10 ** (lo_exp + k / BINS_PER_DECADE) for k in range(n + 1)]
    return 10.0**lo_exp, [-e for e in reversed(positive)] + positive


def _decade_ticks(top: float, linthresh: float) -> tuple[list[float], list[str]]:
    """0 and a few symmetric decades, so the labels never crowd (the decades next to 0 are left out)."""
    lo, hi = round(math.log10(linthresh)), round(math.log10(top))
    step = max(1, math.ceil((hi - lo) / 4))
    exps = list(range(hi, lo, -step))
    ticks = [-(10.0**e) for e in exps] + [0.0] + [10.0**e for e in reversed(exps)]
    labels = [f"$-10^{{{e}}}$" for e in exps] + ["0"] + [f"$10^{{{e}}}$" for e in reversed(exps)]
    return ticks, labels


def plot_log_ratio_hist(log_ratios: dict[str, Tensor], path: str | Path, *, title: str | None = None) -> Path:
    """One panel per label ("trainer profile vs reference"): histogram of delta = logp_train - logp_rollout."""
    if not log_ratios:
        raise ValueError("no log-ratios to plot; pass {label: tensor of per-token log-ratios}")
    values = {}
    for label, v in log_ratios.items():
        v = torch.as_tensor(v).detach().double().flatten()
        if v.numel() == 0:
            raise ValueError(f"{label!r}: no tokens")
        if not torch.isfinite(v).all():
            raise ValueError(f"{label!r}: log-ratios must be finite")
        values[label] = v
    linthresh, edges = _symlog_edges(list(values.values()))
    bins = torch.tensor(edges, dtype=torch.float64)

    plt = _pyplot()
    n = len(values)
    fig, axes = plt.subplots(n, 1, sharex=True, figsize=(9, 1.0 + 2.0 * n), squeeze=False, layout="constrained")
    for i, (ax, (label, v)) in enumerate(zip(axes[:, 0], values.items(), strict=True)):
        color = f"C{i % 10}"
        nonzero = v[v != 0]
        zeros = v.numel() - nonzero.numel()
        rms = float(v.square().mean().sqrt())
        ax.hist(
            nonzero.numpy(),
            bins=edges,
            histtype="stepfilled",
            color=color,
            alpha=0.55,
            edgecolor=color,
            label=f"{label}: {v.numel():,} tokens, RMS {rms:.2g} nats",
        )
        ax.bar(
            0.0,
            zeros,
            width=linthresh,
            color="0.85",
            edgecolor="0.3",
            hatch="//",
            label=f"exactly 0: {zeros:,} ({fmt_pct(zeros / v.numel())})",
        )
        ax.set_xscale("symlog", linthresh=linthresh, linscale=0.5)
        ax.set_yscale("log")
        # Headroom above the tallest bar keeps the legend clear of the data.
        tallest = max(zeros, int(torch.histogram(nonzero, bins=bins).hist.max()) if nonzero.numel() else 0)
        ax.set_ylim(0.7, max(tallest, 1) * 40)
        ax.set_ylabel("tokens")
        ax.axvline(0.0, color="0.3", linewidth=0.6)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(loc="upper left", fontsize=8, framealpha=0.9)
    axes[-1, 0].set_xlabel(
        f"δ = logp_train − logp_rollout per token (nats, symmetric log scale, linear below {linthresh:.0e})"
    )
    axes[-1, 0].set_xlim(edges[0], edges[-1])
    ticks, labels = _decade_ticks(edges[-1], linthresh)
    axes[-1, 0].set_xticks(ticks, labels)
    fig.suptitle(title or "Per-token log-ratio: trainer vs engine reference")
    return _save(fig, path)


def plot_layer_agreement(report: dict, path: str | Path) -> Path:
    """Equal-bits fraction and max ulp distance per decoder layer, one line per trainer profile and backend."""
    entries = report["layers"]
    if not entries:
        raise ValueError("the report has no per-layer data to plot (see its notes for why)")
    plt = _pyplot()
    from matplotlib import ticker

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6.5), layout="constrained")
    markers = "osD^v<>p"
    layers_seen: set[int] = set()
    max_ulp = max(r["max_ulp"] for e in entries for r in e["layers"]) if any(e["layers"] for e in entries) else 0
    for i, e in enumerate(entries):
        rows = sorted(e["layers"], key=lambda r: r["layer"])
        xs = [r["layer"] for r in rows]
        layers_seen.update(xs)
        label = f"{e['trainer_profile']} ({e['backend']})"
        style = {"marker": markers[i % len(markers)], "color": f"C{i % 10}", "label": label}
        top.plot(xs, [100 * r["equal_frac"] for r in rows], **style)
        bottom.plot(xs, [r["max_ulp"] for r in rows], **style)
    top.set_ylabel("elements with equal bits (%)")
    top.set_ylim(-3, 103)
    top.set_title("Trainer vs engine hidden states after each decoder layer (prefill)")
    bottom.set_ylabel("max distance (ulp of the larger value)")
    # Ulps (whole numbers within a binade): a linear axis while they stay small, symmetric-log (0 stays visible) once
    # they spread.
    if max_ulp > 16:
        bottom.set_yscale("symlog", linthresh=1)
        bottom.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _: f"{y:g}"))
    else:
        bottom.yaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    bottom.set_ylim(bottom=-0.5 if max_ulp <= 16 else 0)
    bottom.set_xlabel("decoder layer")
    bottom.set_xticks(sorted(layers_seen))
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    top.legend(fontsize=8, loc="best")
    return _save(fig, path)


def share_bar(share: float | None, undefined: str | None) -> tuple[float | None, str, bool]:
    """How plot_attribution draws one share: (bar length in %, None for no bar; its label; clipped to SHARE_AXIS)."""
    if undefined:
        return None, f"n/a: {undefined}", False
    if share is None:
        return None, NA, False
    x = 100 * share
    shown = min(max(x, SHARE_AXIS[0]), SHARE_AXIS[1])
    return shown, f"{x:.0f}%" + ("" if shown == x else " (off axis)"), shown != x


def plot_attribution(report: dict, path: str | Path) -> Path:
    """Per region, two bars: the share of the trainer-to-engine gap that switching it alone closes, and the share of
    the mismatch it causes alone (every other region already at the engine's rule). One panel per attribution.

    Shares live on a fixed axis, SHARE_AXIS: a share far outside it is interaction or noise, and letting one
    stretch the axis (to 3000%, say) would flatten every meaningful bar. Such a bar stops at the edge, hatched,
    with its value written next to it. An entry whose gap is not there (``share_undefined``) gets no switch bars,
    only a note saying why.
    """
    from matplotlib.patches import Patch

    from roundalign.numerics.attribution import entry_share_undefined

    entries = report["attribution"]
    if not entries:
        raise ValueError("the report has no attribution to plot (see its notes for why)")
    plt = _pyplot()
    lo, hi = SHARE_AXIS
    heights = [1.4 + 0.6 * max(1, len(e["regions"])) for e in entries]
    # A shared x axis keeps panels comparable: 100% means the same thing in each.
    fig, axes = plt.subplots(
        len(entries),
        1,
        sharex=True,
        figsize=(9, sum(heights)),
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
        layout="constrained",
    )
    kinds = (
        ("share", "share of the gap switching it alone closes", "C0"),
        ("alone_share", "mismatch it causes alone, as a share of base", "C1"),
    )
    for ax, e in zip(axes[:, 0], entries, strict=True):
        regions, why = e["regions"], entry_share_undefined(e)
        ys = list(range(len(regions)))
        for j, (key, _, color) in enumerate(kinds):
            pos = [y + (j - 0.5) * 0.36 for y in ys]
            for y, r in zip(pos, regions, strict=True):
                x, text, clipped = share_bar(r.get(key), why if key == "share" else None)
                if x is not None:
                    hatch = {"hatch": "////", "edgecolor": "0.2"} if clipped else {"edgecolor": color}
                    ax.barh(y, x, color=color, height=0.34, **hatch)
                grey = {"color": "0.35", "style": "italic"} if x is None else {}
                ax.annotate(f" {text}", (max(x or 0.0, 0.0), y), va="center", fontsize=7, **grey)
        ax.set_yticks(ys, [r["region"] for r in regions])
        # Inverted (first region on top), with room for a note where a region has no bar to hold the axis open.
        ax.set_ylim(len(regions) - 0.4, -0.6)
        ax.axvline(0, color="0.3", linewidth=0.8)
        ax.axvline(100, color="0.3", linewidth=0.8, linestyle="--")
        # Room right of the axis edge for the value of a bar that stops there.
        ax.set_xlim(lo - 5, hi + 45)
        base = "n/a" if e["base"] is None else f"{e['base']:.3g}"
        target = "n/a" if e["target"] is None else f"{e['target']:.3g}"
        ax.set_title(
            f"{e['trainer_profile']} → {e['engine_profile']} ({e['backend']}, {e['reference']}): "
            f"{e['metric']} {base} (trainer) → {target} (engine profile)",
            fontsize=10,
        )
        ax.grid(True, axis="x", alpha=0.3)
    handles = [Patch(color=color, label=label) for _, label, color in kinds]
    handles.append(Patch(facecolor="white", edgecolor="0.2", hatch="////", label="beyond the axis: value written"))
    fig.legend(handles=handles, loc="outside upper center", ncols=3, fontsize=8)
    axes[-1, 0].set_xticks(range(int(lo), int(hi) + 1, 50))
    axes[-1, 0].set_xlabel(f"share of the trainer-vs-engine mismatch (%), axis {lo:.0f}% to {hi:.0f}%")
    return _save(fig, path)
