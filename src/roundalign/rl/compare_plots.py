"""PNG plots of a ``roundalign compare`` grid: one per metric, plus an overview figure for the docs.

Each plot has x = training step and one line per configuration (the runs that differ only in seed): the mean
across seeds, with a shaded band from the lowest to the highest seed. Lines are lightly smoothed (a centred moving
average over a few steps, said in the title) because one step's batch is small and noisy; a run too short for that
is drawn unsmoothed, and so is evaluation accuracy, at its own steps. A configuration keeps its colour and line
style in every plot: the sync mode (when it is in the grid) picks the line style, the other grid settings the colour.

``rollout_corr/k3_kl`` spans decades and is exactly 0 on bitwise-aligned steps, which a log axis cannot show: zeros
(and anything below the floor) are drawn at a floor one decade under the smallest nonzero value, marked by a
dotted line, and the axis label says so. matplotlib is the optional ``[cli]`` extra: it is imported inside the
functions, with the non-interactive Agg backend.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from roundalign import durable
from roundalign.errors import UserError
from roundalign.rl.compare_summary import Run, group_runs


@dataclass(frozen=True)
class Panel:
    key: str  # the metric in metrics.jsonl
    file: str
    title: str
    ylabel: str
    log: bool = False  # log y axis with a floor for zeros
    smooth: bool = True  # eval points are drawn as they are


PANELS = (
    Panel("reward/mean", "reward", "Reward", "mean reward per completion"),
    Panel("eval/accuracy", "eval_accuracy", "Held-out accuracy (greedy)", "accuracy (fraction correct)", smooth=False),
    Panel(
        "rollout_corr/k3_kl", "k3_kl", "Rollout/trainer mismatch: K3 KL", "K3 KL estimate (nats per token)", log=True
    ),
    Panel(
        "rollout_corr/raw_is_std", "is_ratio_spread", "IS-ratio spread", "std of raw token IS ratio π_train/π_rollout"
    ),
    # The sync metrics' definitions are roundalign.sync.visibility's (docs/sync.md).
    Panel(
        "sync/visible_fraction",
        "update_visibility",
        "Update visibility",
        "served weights whose bits changed (fraction)",
    ),
    Panel(
        "sync/update_transfer",
        "update_transfer",
        "Update transfer",
        "⟨Δserved, Δmaster⟩ / ‖Δmaster‖² (share of the update)",
    ),
    Panel("sync/lag_steps", "lag_steps", "Served-weight lag", "steps since the master the served copy is nearest"),
    Panel("sync/relative_drift", "relative_drift", "Served-weight drift", "‖served − master‖ / ‖master‖ (relative)"),
)
# Logged only by runs with --prefill-check; plotted when some run has it.
OPTIONAL_PANELS = (
    Panel(
        "prefill/k3_kl",
        "prefill_k3_kl",
        "K3 KL vs the engine's prefill (rounding only)",
        "K3 KL estimate (nats per token)",
        log=True,
    ),
)
LINE_STYLES = ("-", "--", ":", "-.")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Centred moving average over ``window`` positions, NaN-aware; the window shrinks at both ends."""
    if window <= 1:
        return values.copy()
    half = window // 2
    out = np.full(values.shape, np.nan)
    for i in range(len(values)):
        chunk = values[max(0, i - half) : i + half + 1]
        if np.isfinite(chunk).any():
            out[i] = np.nanmean(chunk)
    return out


def series(runs: list[Run], key: str, window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(steps, mean, min, max) across the runs (seeds) of one configuration; NaN where no seed logged a value."""
    rows = [{m["step"]: float(m[key]) for m in r.metrics if m.get(key) is not None} for r in runs]
    steps = np.array(sorted(set().union(*rows)), dtype=float)
    if steps.size == 0:
        return steps, steps, steps, steps
    table = np.array([moving_average(np.array([row.get(s, np.nan) for s in steps]), window) for row in rows])
    with warnings.catch_warnings():  # a step no seed logged is NaN, on purpose
        warnings.simplefilter("ignore", RuntimeWarning)
        return steps, np.nanmean(table, axis=0), np.nanmin(table, axis=0), np.nanmax(table, axis=0)


def styles(runs: list[Run]) -> dict[str, dict]:
    """Configuration label -> matplotlib line style: sync picks the line style, the other settings the colour."""
    keys = list(dict.fromkeys(k for r in runs for k in r.settings))
    dash_key = "sync" if "sync" in keys and len(keys) > 1 else (keys[1] if len(keys) > 1 else None)
    hues: dict[tuple, int] = {}
    dashes: dict[str, int] = {}
    out = {}
    for label, group in group_runs(runs).items():
        s = group[0].settings
        hue = tuple(s.get(k) for k in keys if k != dash_key)
        hues.setdefault(hue, len(hues))
        dash = dashes.setdefault(s.get(dash_key), len(dashes)) if dash_key else 0
        out[label] = {"color": f"C{hues[hue] % 10}", "linestyle": LINE_STYLES[dash % len(LINE_STYLES)]}
    return out


def _log_floor(curves: list[np.ndarray]) -> float:
    """One decade under the smallest positive value, so exact zeros sit visibly apart from every real value."""
    values = np.concatenate([c[np.isfinite(c)] for c in curves]) if curves else np.array([])
    positive = values[values > 0]
    return 10.0 ** (math.floor(math.log10(positive.min())) - 1) if positive.size else 1e-10


def draw(ax, runs: list[Run], panel: Panel, window: int, style: dict[str, dict]) -> bool:
    """Draw one panel on ``ax``; False (and a note on the axes) when no run logged the metric."""
    from matplotlib.ticker import MaxNLocator

    window = window if panel.smooth else 1
    data = {label: series(group, panel.key, window) for label, group in group_runs(runs).items()}
    data = {label: d for label, d in data.items() if np.isfinite(d[1]).any()}
    if not data:
        ax.text(
            0.5,
            0.5,
            f"{panel.key}: no values\n(absent or null in every run)",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
        ax.set_title(panel.title)
        return False
    floor = _log_floor([c for d in data.values() for c in d[1:]]) if panel.log else None
    for label, (steps, mean, lo, hi) in data.items():
        if floor is not None:
            mean, lo, hi = (np.where(np.isfinite(c), np.maximum(c, floor), np.nan) for c in (mean, lo, hi))
        n = len(group_runs(runs)[label])
        kw = dict(marker="o", markersize=3) if not panel.smooth else {}
        ax.plot(steps, mean, label=f"{label} ({n} seed{'s' * (n != 1)})", linewidth=1.6, **style[label], **kw)
        if n > 1:
            ax.fill_between(steps, lo, hi, color=style[label]["color"], alpha=0.15, linewidth=0)
    ylabel = panel.ylabel
    if floor is not None:
        ax.set_yscale("log")
        ax.axhline(floor, color="0.5", linestyle=(0, (1, 3)), linewidth=0.8)
        ylabel += f"\nlog scale; 0 and values < {floor:.0e} drawn at {floor:.0e} (dotted)"
    ax.set_title(panel.title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("training step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return True


def smoothing_window(runs: list[Run], smooth: int) -> int:
    """The moving-average window actually used: ``smooth`` steps, at most an eighth of the longest run (odd, so it
    stays centred), and none below 3, so a short run is drawn as it is rather than flattened."""
    longest = max((len(r.train_steps) for r in runs), default=0)
    window = min(smooth, longest // 8)
    window -= 1 - window % 2
    return window if window >= 3 else 1


def _smoothing_note(window: int) -> str:
    return f"lines: centred moving average over {window} steps" if window > 1 else "lines: unsmoothed"


def plot(runs: list[Run], out: Path, smooth: int = 5) -> list[Path]:
    """One PNG per metric in ``out/plots/`` and ``overview.png`` (all panels); return their paths."""
    if not runs:
        raise UserError("no runs to plot")
    if isinstance(smooth, bool) or not isinstance(smooth, int) or smooth < 1:
        raise UserError(f"smooth is a window of steps, an int >= 1 (1: no smoothing), got {smooth!r}")
    smooth = smoothing_window(runs, smooth)
    plt = _pyplot()
    folder = Path(out) / "plots"
    folder.mkdir(parents=True, exist_ok=True)
    style = styles(runs)
    logged = {k for r in runs for row in r.metrics for k in row}
    panels = PANELS + tuple(p for p in OPTIONAL_PANELS if p.key in logged)
    paths = []
    for panel in panels:
        fig, ax = plt.subplots(figsize=(9, 4.5), layout="constrained")
        draw(ax, runs, panel, smooth, style)
        note = _smoothing_note(smooth if panel.smooth else 1)
        ax.set_title(f"{panel.title}\n{panel.key}; {note}; band: min..max across seeds", fontsize=10)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        paths.append(_save(plt, fig, folder / f"{panel.file}.png"))

    rows = 2 if len(panels) <= 8 else 3
    cols = math.ceil(len(panels) / rows)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4.25 * rows), layout="constrained")
    for ax, panel in zip(list(axes.flat)[: len(panels)], panels, strict=True):
        draw(ax, runs, panel, smooth, style)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    handles, labels = _legend_entries(axes)
    fig.suptitle(
        f"roundalign compare: mean across seeds, band min..max; {_smoothing_note(smooth)} (eval accuracy unsmoothed)",
        fontsize=12,
    )
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 4), frameon=False)
    paths.append(_save(plt, fig, folder / "overview.png"))
    return paths


def _legend_entries(axes):
    """Each configuration once, from whichever panel drew it first."""
    entries = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            entries.setdefault(label, h)
    return list(entries.values()), list(entries)


def _save(plt, fig, path: Path) -> Path:
    durable.write_with(path, lambda tmp: fig.savefig(tmp, dpi=110))
    plt.close(fig)
    return path
