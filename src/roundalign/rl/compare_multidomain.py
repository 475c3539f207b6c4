"""The summary and plots of a multi-domain ``roundalign compare`` grid (runs with ``--domains``).

Part of ``roundalign compare`` (rl/compare.py calls ``summarize_domains`` and ``plot_domains`` instead of the
single-domain ``summarize`` and ``plot`` when the grid's runs have ``--domains``). What matters there is each
domain's held-out reward, so the table and the plots are per domain:

- held-out reward per domain (``eval/<domain>/reward``, greedy) at the last evaluation, and their macro average
  over the grid's domains (``eval/accuracy``: None for a seed that misses a domain, rather than an average of fewer);
- OSOL's metrics (``osol/kappa``, ``osol/residual_share``, ``osol/backtracking``, ``osol/footprint_below_mismatch``,
  ``osol/rank_change_frac``), the trainer's mismatch (``rollout_corr/k3_kl``, ``mismatch/log_ratio_rms``,
  ``mismatch/bitwise_equal_frac``) and ``timing_s/step``, each averaged over the last 25% of the steps;

each as mean +- sample std across the seeds of a configuration. A configuration may hold several runs per seed:
``method=alone`` (rl/compare_methods.py) trains each domain in a run of its own, so its seed's held-out reward of a
domain comes from that domain's run, and its macro average from those. To treat every configuration alike, the runs
of one (configuration, seed) are first merged into one ``SeedRun``: per step, each metric is the mean over the runs
that logged it (a domain's held-out reward is logged by one run only: it is that run's value), and the macro average
is recomputed from the merged per-domain rewards.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from roundalign import durable
from roundalign.errors import UserError
from roundalign.rl.compare_summary import (
    TAIL,
    Run,
    across_seeds,
    fmt_stat,
    grid_lines,
    group_runs,
    read_grid,
    tail_mean,
)

EVAL_KEY = re.compile(r"eval/([a-z][a-z0-9_]*)/reward")  # a domain's name: tasks.gym's _NAME
MACRO = "eval/accuracy"  # with --domains, the run's macro average of eval/<domain>/reward
OSOL_METRICS = (
    ("osol/kappa", "kappa"),
    ("osol/residual_share", "residual share"),
    ("osol/backtracking", "backtracking"),
    ("osol/footprint_below_mismatch", "footprint < mismatch"),
    ("osol/rank_change_frac", "rank change"),
)
MISMATCH_METRICS = (
    ("rollout_corr/k3_kl", "k3_kl"),
    ("mismatch/log_ratio_rms", "log-ratio RMS"),
    ("mismatch/bitwise_equal_frac", "bitwise equal"),
    ("timing_s/step", "s/step"),
)


def eval_key(domain: str) -> str:
    return f"eval/{domain}/reward"


def domain_names(runs: list[Run]) -> list[str]:
    """The domains whose held-out reward some run logged, in the order first logged (the --domains order)."""
    names: dict[str, None] = {}
    for r in runs:
        for row in r.metrics:
            for key in row:
                m = EVAL_KEY.fullmatch(key)
                if m:
                    names.setdefault(m.group(1))
    return list(names)


def is_multidomain(runs: list[Run]) -> bool:
    """True when some run trained with --domains (its config.json says so, or it logged a domain's reward)."""
    return any(r.config.get("domains") for r in runs) or bool(domain_names(runs))


@dataclass
class SeedRun(Run):
    """The runs of one configuration and seed, merged (one run but for ``method=alone``); ``members``: their
    names."""

    members: tuple[str, ...] = ()
    last_steps: tuple[int, ...] = ()  # each member's last training step


def _number(v) -> float | None:
    return None if v is None or isinstance(v, bool) or not isinstance(v, int | float) else float(v)


def merge_seeds(runs: list[Run], domains: list[str]) -> list[SeedRun]:
    """One ``SeedRun`` per (configuration, seed), in first-appearance order (see the module's docstring)."""
    groups: dict[tuple[str, str | None], list[Run]] = {}
    for r in runs:
        groups.setdefault((r.label, r.seed), []).append(r)
    merged = []
    for (_, seed), members in groups.items():
        tables = [{m["step"]: m for m in r.metrics} for r in members]
        rows = []
        for step in sorted({s for t in tables for s in t}):
            values: dict[str, list[float]] = {}
            for table in tables:
                for key, v in table.get(step, {}).items():
                    if key != "step":
                        values.setdefault(key, [])
                        if _number(v) is not None:
                            values[key].append(float(v))
            row = {"step": step, **{k: sum(v) / len(v) if v else None for k, v in values.items()}}
            evals = [row.get(eval_key(d)) for d in domains]
            if MACRO in row or any(v is not None for v in evals):
                row[MACRO] = sum(evals) / len(evals) if evals and None not in evals else None
            rows.append(row)
        first = members[0]
        last_steps = tuple(r.train_steps[-1]["step"] if r.train_steps else 0 for r in members)
        name = first.name if len(members) == 1 else f"{first.label} seed {seed}"
        merged.append(
            SeedRun(name, first.settings, first.config, rows, seed, None, tuple(r.name for r in members), last_steps)
        )
    return merged


def last_value(run: Run, key: str) -> float | None:
    """``key`` at the run's last step that has it (its last evaluation, for a held-out reward)."""
    values = [_number(m.get(key)) for m in run.metrics if _number(m.get(key)) is not None]
    return values[-1] if values else None


def macro(run: Run, domains: list[str]) -> float | None:
    """Mean over ``domains`` of each one's last held-out reward; None when one has none."""
    last = [last_value(run, eval_key(d)) for d in domains]
    return sum(last) / len(last) if last and None not in last else None


def configurations(runs: list[Run]) -> tuple[list[str], list[dict]]:
    """(the domains, one summary row per configuration): summary.json's ``configurations``."""
    domains = domain_names(runs)
    rows = []
    for label, group in group_runs(merge_seeds(runs, domains)).items():
        metrics = {eval_key(d): across_seeds([last_value(r, eval_key(d)) for r in group]) for d in domains}
        metrics[MACRO] = across_seeds([macro(r, domains) for r in group])
        for key, _ in (*OSOL_METRICS, *MISMATCH_METRICS):
            metrics[key] = across_seeds([tail_mean(r, key) for r in group])
        last = sorted({s for r in group for s in r.last_steps})
        rows.append(
            {
                "configuration": label,
                "settings": group[0].settings,
                "runs": [m for r in group for m in r.members],
                "seeds": [r.seed for r in group],
                "steps": last[0] if len(last) == 1 else last,
                "metrics": metrics,
            }
        )
    return domains, rows


def summarize_domains(runs: list[Run], out: Path) -> Path:
    """Write out/summary.md (three tables, one row per configuration) and out/summary.json; return the .md path."""
    if not runs:
        raise UserError("no runs to summarize")
    out = Path(out)
    grid = read_grid(out)
    domains, rows = configurations(runs)
    how = (
        "Held-out reward: each domain's greedy reward (eval/<domain>/reward) at the run's last evaluation; macro: "
        "their mean over the domains (eval/accuracy). A configuration with one run per domain and seed "
        "(method=alone) takes each domain's reward from the run trained on it alone, and its other metrics as the "
        f"mean over its runs at each step. The other metrics are averaged over the last {TAIL:.0%} of a run's "
        "training steps (rounded up; null steps left out). Cells show mean ± sample std (n-1) across the seeds of a "
        "configuration; a single seed has no ± part."
    )
    lines = ["# roundalign compare: multi-domain", "", *grid_lines(grid, runs), how, ""]
    lines += [f"Domains: {', '.join(domains) or '(none evaluated)'}.", ""]

    def table(title: str, columns: list[tuple[str, str]], steps: bool = False) -> None:
        nonlocal lines
        header = ["configuration", "seeds", *(["steps"] if steps else []), *(h for _, h in columns)]
        lines += [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for row in rows:
            n = len(row["seeds"])
            s = row["steps"] if isinstance(row["steps"], int) else f"{row['steps'][0]}–{row['steps'][-1]}"
            cells = [row["configuration"], ",".join(str(x) for x in row["seeds"]), *([str(s)] if steps else [])]
            lines.append("| " + " | ".join([*cells, *(fmt_stat(row["metrics"][k], n) for k, _ in columns)]) + " |")
        lines.append("")

    table("Held-out reward (last evaluation)", [(eval_key(d), d) for d in domains] + [(MACRO, "macro")], steps=True)
    table(f"OSOL (last {TAIL:.0%} of steps)", list(OSOL_METRICS))
    table(f"Mismatch and speed (last {TAIL:.0%} of steps)", list(MISMATCH_METRICS))
    path = out / "summary.md"
    durable.write_text(path, "\n".join(lines))
    data = {
        "grid": grid.get("grid"),
        "fixed_args": grid.get("fixed_args"),
        "aggregation": how,
        "tail": TAIL,
        "domains": domains,
        "configurations": rows,
    }
    durable.write_text(out / "summary.json", json.dumps(data, indent=2) + "\n")
    return path


def plot_domains(runs: list[Run], out: Path, smooth: int = 5) -> list[Path]:
    """out/plots/: held_out_reward.png (a panel per domain, and the macro average), held_out_macro.png and
    osol_backtracking.png; each line a configuration, mean across seeds with a min..max band (rl/compare_plots)."""
    from roundalign.rl import compare_plots as cp

    if not runs:
        raise UserError("no runs to plot")
    if isinstance(smooth, bool) or not isinstance(smooth, int) or smooth < 1:
        raise UserError(f"smooth is a window of steps, an int >= 1 (1: no smoothing), got {smooth!r}")
    domains = domain_names(runs)
    merged = merge_seeds(runs, domains)
    window = cp.smoothing_window(merged, smooth)
    style = cp.styles(merged)
    plt = cp._pyplot()
    folder = Path(out) / "plots"
    folder.mkdir(parents=True, exist_ok=True)
    ylabel = "greedy reward on held-out items"
    panels = [cp.Panel(eval_key(d), "", f"Held-out reward: {d}", ylabel, smooth=False) for d in domains]
    macro_panel = cp.Panel(MACRO, "held_out_macro", "Held-out reward: macro average over domains", ylabel, smooth=False)
    panels.append(macro_panel)
    back = cp.Panel(
        "osol/backtracking", "osol_backtracking", "OSOL backtracking", "share of the last update undone: -<u,v>/<u,u>"
    )
    band = "mean across seeds, band min..max"

    cols = min(len(panels), 3)
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4.25 * rows), layout="constrained", squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        cp.draw(ax, merged, panel, window, style)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    handles, labels = cp._legend_entries(axes)
    fig.suptitle(f"roundalign compare: held-out reward per domain (greedy, at each evaluation); {band}", fontsize=12)
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 3), frameon=False)
    paths = [cp._save(plt, fig, folder / "held_out_reward.png")]
    for panel in (macro_panel, back):
        fig, ax = plt.subplots(figsize=(9, 4.5), layout="constrained")
        cp.draw(ax, merged, panel, window, style)
        note = cp._smoothing_note(window if panel.smooth else 1)
        ax.set_title(f"{panel.title}\n{panel.key}; {note}; {band}", fontsize=10)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        paths.append(cp._save(plt, fig, folder / f"{panel.file}.png"))
    return paths
