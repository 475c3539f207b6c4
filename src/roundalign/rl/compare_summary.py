"""Reading a grid's runs back, and its summary table (``summary.md``, ``summary.json``).

Part of ``roundalign compare`` (rl/compare_plan.py plans the grid, rl/compare_run.py runs it, rl/compare.py is
the command, rl/compare_plots.py draws it). A run is a cell's directory: its ``cell.json`` settings, ``config.json``
and ``metrics.jsonl``. Runs that differ only in ``seed`` form one configuration, summarized as mean +- std across
seeds of each metric's average over the last quarter of the run's steps (the last evaluation for eval accuracy).
Runs with ``--domains`` are summarized per domain instead, by rl/compare_multidomain.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from roundalign import durable
from roundalign.errors import UserError
from roundalign.rl.logbook import read_metrics

GRID_ALIASES = {"trainer": "trainer_profile", "engine": "engine_profile", "is": "rollout_is"}
SHORT_NAMES = {v: k for k, v in GRID_ALIASES.items()}  # TrainConfig field -> its grid alias


def short_name(key: str) -> str:
    """How a grid key is written in labels and cell names: its alias, or the field as an option (``loss-type``)."""
    return SHORT_NAMES.get(key, key.replace("_", "-"))


def config_label(settings: dict[str, str]) -> str:
    return " ".join(f"{short_name(k)}={v}" for k, v in settings.items()) or "(no grid keys)"


# (metric, column header) in table order; eval/accuracy is read at the last evaluation, the rest averaged.
SUMMARY_METRICS = (
    ("reward/mean", "reward"),
    ("accuracy/train", "train acc"),
    ("eval/accuracy", "eval acc (last)"),
    ("rollout_corr/k3_kl", "k3_kl"),
    ("rollout_corr/raw_is_std", "IS-ratio spread"),
    ("mismatch/log_ratio_rms", "log-ratio RMS"),
    ("mismatch/bitwise_equal_frac", "bitwise equal"),
    ("sync/visible_fraction", "update visible"),
    ("sync/update_transfer", "update transfer"),
    ("sync/relative_drift", "relative drift"),
    ("sync/lag_steps", "lag (steps)"),
    ("actor/grad_norm", "grad norm"),
    ("timing_s/step", "s/step"),
)
TAIL = 0.25  # the summary averages each metric over this last fraction of a run's training steps


@dataclass
class Run:
    """One finished (or partly finished) run directory."""

    name: str
    settings: dict[str, str]  # non-seed grid settings; {} for a run compare did not start
    config: dict
    metrics: list[dict]  # one dict per logged step, sorted by step; step 0 holds the initial evaluation
    seed: str | None = None
    path: Path | None = None

    @property
    def label(self) -> str:
        return config_label(self.settings)

    @property
    def train_steps(self) -> list[dict]:
        return [m for m in self.metrics if m["step"] >= 1]


def load_runs(out: Path) -> list[Run]:
    """Every run directory under ``out`` with a metrics.jsonl, in grid order (grid.json) then by name."""
    out = Path(out)
    dirs = sorted(p.parent for p in out.glob("*/metrics.jsonl"))
    if not dirs:
        raise UserError(f"no runs in {out}: no {out}/<cell>/metrics.jsonl; run the grid first (drop --plots-only)")
    grid_file = out / "grid.json"
    order = json.loads(grid_file.read_text()).get("cells", []) if grid_file.is_file() else []
    dirs.sort(key=lambda d: (order.index(d.name) if d.name in order else len(order), d.name))
    runs = []
    for d in dirs:
        config = json.loads((d / "config.json").read_text()) if (d / "config.json").is_file() else {}
        cell = json.loads((d / "cell.json").read_text()) if (d / "cell.json").is_file() else {}
        settings = cell.get("settings", config.get("extra") or {})
        seed = cell.get("seed")  # None when seed was not a grid key: the run's own (fixed or default) seed
        seed = seed if seed is not None or "seed" not in config else str(config["seed"])
        runs.append(Run(d.name, dict(settings), config, read_metrics(d / "metrics.jsonl"), seed, d))
    return runs


def group_runs(runs: list[Run]) -> dict[str, list[Run]]:
    """Configuration label -> its runs (one per seed), in first-appearance order."""
    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(r.label, []).append(r)
    return groups


def _number(v) -> float | None:
    return None if v is None or isinstance(v, bool) else float(v)


def tail_mean(run: Run, key: str) -> float | None:
    """Mean of ``key`` over the last ``TAIL`` of the run's training steps (nulls left out); eval: the last one."""
    if key == "eval/accuracy":
        evals = [_number(m.get(key)) for m in run.metrics if m.get(key) is not None]
        return evals[-1] if evals else None
    steps = run.train_steps
    window = steps[len(steps) - math.ceil(TAIL * len(steps)) :] if steps else []
    values = [_number(m[key]) for m in window if m.get(key) is not None]
    return sum(values) / len(values) if values else None


def first_step(run: Run, key: str) -> float | None:
    steps = run.train_steps
    return _number(steps[0].get(key)) if steps else None


def across_seeds(values: list[float | None]) -> dict:
    """mean, sample std (n-1; None for one value) and n over the runs that have a value."""
    v = [x for x in values if x is not None]
    if not v:
        return {"mean": None, "std": None, "n": 0}
    mean = sum(v) / len(v)
    std = math.sqrt(sum((x - mean) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else None
    return {"mean": mean, "std": std, "n": len(v)}


def fmt_stat(stat: dict, seeds: int) -> str:
    """``across_seeds``' stat as a table cell: ``mean ± std``, and how many seeds had a value when not all."""
    if stat["mean"] is None:
        return "–"
    text = f"{stat['mean']:.3g}" + ("" if stat["std"] is None else f" ± {stat['std']:.2g}")
    return text + ("" if stat["n"] == seeds else f" ({stat['n']} of {seeds} seeds)")


# Logged only by runs with --prefill-check: in the table when some run of the grid has them.
OPTIONAL_SUMMARY_METRICS = (("prefill/k3_kl", "prefill k3_kl"), ("prefill/bitwise_equal_frac", "prefill bitwise equal"))


def summary_metrics(runs: list[Run]) -> tuple[tuple[str, str], ...]:
    """SUMMARY_METRICS, plus each optional metric that at least one run logged."""
    logged = {k for r in runs for row in r.metrics for k in row}
    return SUMMARY_METRICS + tuple(m for m in OPTIONAL_SUMMARY_METRICS if m[0] in logged)


def read_grid(out: Path) -> dict:
    """The grid.json compare wrote into ``out`` ({} for a directory of runs compare did not plan)."""
    grid_file = Path(out) / "grid.json"
    return json.loads(grid_file.read_text()) if grid_file.is_file() else {}


def grid_lines(grid: dict, runs: list[Run]) -> list[str]:
    """summary.md's lines on the grid: its keys and fixed options, and the planned cells that have no run."""
    if not grid:
        return []
    spec = " ".join(f"{SHORT_NAMES.get(k, k)}={','.join(v)}" for k, v in grid.get("grid", {}).items())
    lines = [f"Grid: `{spec}`; fixed train options: `{' '.join(grid.get('fixed_args', [])) or '(none)'}`."]
    missing = [c for c in grid.get("cells", []) if c not in {r.name for r in runs}]
    if missing:
        lines += ["", f"Not in the table (not run, or failed before logging a step): {', '.join(missing)}."]
    return [*lines, ""]


def summarize(runs: list[Run], out: Path) -> Path:
    """Write out/summary.md (a table, one row per configuration) and out/summary.json; return the .md path."""
    if not runs:
        raise UserError("no runs to summarize")
    out = Path(out)
    grid = read_grid(out)
    metrics = summary_metrics(runs)
    rows = []
    for label, group in group_runs(runs).items():
        last = sorted({r.train_steps[-1]["step"] if r.train_steps else 0 for r in group})
        rows.append(
            {
                "configuration": label,
                "settings": group[0].settings,
                "runs": [r.name for r in group],
                "seeds": [r.seed for r in group],
                "steps": last[0] if len(last) == 1 else last,
                "metrics": {k: across_seeds([tail_mean(r, k) for r in group]) for k, _ in metrics},
                "k3_kl_first_step": across_seeds([first_step(r, "rollout_corr/k3_kl") for r in group]),
            }
        )
    how = (
        f"Each metric is averaged over the last {TAIL:.0%} of a run's training steps (rounded up; null steps left "
        "out), eval accuracy is the run's last evaluation, and k3_kl@1 is the first training step's value. Cells "
        "show mean ± sample std (n-1) across the seeds of a configuration; a single seed has no ± part."
    )
    lines = ["# roundalign compare", "", *grid_lines(grid, runs), how, ""]
    header = ["configuration", "seeds", "steps", *(h for _, h in metrics), "k3_kl@1"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        n = len(row["seeds"])
        steps = row["steps"] if isinstance(row["steps"], int) else f"{row['steps'][0]}–{row['steps'][-1]}"
        cells = [
            row["configuration"],
            ",".join(str(s) for s in row["seeds"]),
            str(steps),
            *(fmt_stat(row["metrics"][k], n) for k, _ in metrics),
            fmt_stat(row["k3_kl_first_step"], n),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    path = out / "summary.md"
    durable.write_text(path, "\n".join(lines) + "\n")
    data = {
        "grid": grid.get("grid"),
        "fixed_args": grid.get("fixed_args"),
        "aggregation": how,
        "tail": TAIL,
        "configurations": rows,
    }
    durable.write_text(out / "summary.json", json.dumps(data, indent=2) + "\n")
    return path
