"""roundalign compare: grid parsing and planning, the runner (with a fake train command), summary numbers, plots.

The runner tests inject a tiny stdlib-only script in place of ``roundalign train``: it writes the config.json and
metrics.jsonl a run would, prints its thread setting, and fails on request, so the process handling is tested in a
second or two. Summary numbers are checked against averages worked out by hand from the synthetic metrics.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from roundalign.errors import ExitStatus
from roundalign.rl import compare
from roundalign.rl.compare import Cell, GridError, load_runs, parse_grid, plan, run_grid, summarize
from roundalign.rl.compare_plan import train_config

FAKE_TRAIN = r"""
import argparse, json, os, sys, time
p = argparse.ArgumentParser()
p.add_argument("--out"); p.add_argument("--steps", type=int, default=60); p.add_argument("--seed", type=int, default=0)
p.add_argument("--quiet", action="store_true")
args, rest = p.parse_known_args()
with open(os.environ["FAKE_TRAIN_CALLS"], "a") as f:
    f.write(f"{args.out} {time.time()}\n")
print("threads", os.environ.get("OMP_NUM_THREADS"), os.environ.get("MKL_NUM_THREADS"), "rest", rest)
if str(args.seed) in os.environ.get("FAKE_TRAIN_FAIL_SEEDS", "").split(","):
    print("boom: loss is nan at step 2", file=sys.stderr)
    sys.exit(3)
time.sleep(float(os.environ.get("FAKE_TRAIN_SLEEP", "0")))
with open(os.path.join(args.out, "ended"), "w") as f:
    f.write(str(time.time()))
with open(os.path.join(args.out, "config.json"), "w") as f:
    json.dump({"steps": args.steps, "seed": args.seed}, f)
with open(os.path.join(args.out, "metrics.jsonl"), "w") as f:
    f.write(json.dumps({"step": 0, "eval/accuracy": 0.1}) + "\n")
    for s in range(1, args.steps + 1):
        f.write(json.dumps({"step": s, "reward/mean": 0.1 * args.seed + 0.01 * s}) + "\n")
"""


@pytest.fixture
def fake_train(tmp_path, monkeypatch):
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    calls = tmp_path / "calls.txt"
    calls.write_text("")
    monkeypatch.setenv("FAKE_TRAIN_CALLS", str(calls))
    monkeypatch.delenv("FAKE_TRAIN_FAIL_SEEDS", raising=False)
    return [sys.executable, str(script)], calls


def _calls(calls: Path) -> list[str]:
    return [line.split()[0] for line in calls.read_text().splitlines()]


# ---------------------------------------------------------------------------------------------------------------
# Grid parsing and planning


def test_parse_grid_aliases_and_field_names():
    grid = parse_grid(
        ["trainer=hf,aligned", "engine=sglang", "is=token-tis", "loss-type=grpo,reinforce", "clip_eps=0.1", "seed=0,1"]
    )
    assert grid == {
        "trainer_profile": ["hf", "aligned"],
        "engine_profile": ["sglang"],
        "rollout_is": ["token-tis"],
        "loss_type": ["grpo", "reinforce"],
        "clip_eps": ["0.1"],
        "seed": ["0", "1"],
    }
    assert list(grid) == ["trainer_profile", "engine_profile", "rollout_is", "loss_type", "clip_eps", "seed"]


@pytest.mark.parametrize(
    "items, message",
    [
        (["colour=red"], "unknown grid key 'colour'"),
        (["seed="], "empty value"),
        (["seed=0,,1"], "empty value"),
        (["trainer=hf", "trainer_profile=aligned"], "given twice"),
        (["seed=0,0"], "repeats ['0']"),
        (["sync"], "is not KEY=V1,V2"),
        (["betas=0.9,0.99"], "holds a comma"),
        (["out=x"], "cannot be a grid key"),
        ([], "the grid is empty"),
    ],
)
def test_parse_grid_errors(items, message):
    with pytest.raises(ValueError) as info:
        parse_grid(items)
    assert message in str(info.value)


def test_parse_grid_unknown_key_lists_the_valid_keys():
    with pytest.raises(ValueError, match="valid keys: trainer, engine, is, .*sync") as info:
        parse_grid(["trainr=hf"])
    assert "seed" in str(info.value) and "loss_on_served" in str(info.value)


def test_plan_is_the_cartesian_product_with_seed_last():
    cells = plan(parse_grid(["trainer=hf,aligned", "seed=0,1", "sync=rne,stochastic"]), ["--steps", "3"])
    assert [c.name for c in cells] == [
        f"trainer-{t}_sync-{s}_seed-{seed}"
        for t in ("hf", "aligned")
        for s in ("rne", "stochastic")
        for seed in ("0", "1")
    ]
    first = cells[0]
    assert first.settings == {"trainer_profile": "hf", "sync": "rne"} and first.seed == "0"
    assert first.label == "trainer=hf sync=rne"
    assert first.train_options() == ["--trainer-profile=hf", "--sync=rne", "--seed=0"]
    assert Cell("x", {"trainer_profile": "hf", "sync": "rne"}, "0").train_options() == first.train_options()


def test_plan_boolean_key_becomes_a_flag_and_names_are_filesystem_safe():
    cells = plan(parse_grid(["loss-on-served=true,false", "lr=1e-5"]), ["--sync", "stochastic"])
    assert [c.train_options() for c in cells] == [
        ["--loss-on-served", "--lr=1e-5"],
        ["--no-loss-on-served", "--lr=1e-5"],
    ]
    assert [c.name for c in cells] == ["loss-on-served-true_lr-1e-5", "loss-on-served-false_lr-1e-5"]
    flag_only = plan(parse_grid(["prefill-check=true,false"]), [])  # no --no-prefill-check: off is its default
    assert [c.train_options() for c in flag_only] == [["--prefill-check"], []]
    assert [train_config(c, []).prefill_check for c in flag_only] == [True, False]
    with pytest.raises(ValueError, match="--lr must be > 0, got -1e-05"):  # a negative value reaches validation
        plan(parse_grid(["lr=-1e-5"]), [])
    with pytest.raises(ValueError, match="on or off"):
        plan(parse_grid(["loss-on-served=maybe"]), ["--sync", "stochastic"])


def test_a_bad_cell_fails_the_whole_plan_before_anything_runs(tmp_path, fake_train, monkeypatch):
    command, calls = fake_train
    monkeypatch.setattr(compare, "DEFAULT_COMMAND", tuple(command))
    out = tmp_path / "grid"
    args = _cli_args("--grid", "sync=stochastic,rne", "seed=0,1", "--out", str(out), "--", "--loss-on-served")
    with pytest.raises(
        ValueError,
        match=r"grid cell sync-rne_seed-0 \(sync=rne seed=0\) is not a valid run: "
        "--loss-on-served with --sync rne",
    ):
        _run(args)
    assert _calls(calls) == [] and not out.exists()


@pytest.mark.parametrize(
    "grid, fixed, message",
    [
        (["sync=rne"], ["--sync", "stochastic"], "--sync is both a grid key and a fixed train option"),
        (["seed=0"], ["--out", "x"], "drop --out"),
        (["seed=0"], ["--stepz", "3"], "unrecognized arguments: --stepz"),
        (["seed=0"], ["--steps", "three"], "invalid int value"),
        (["seed=0"], ["--steps", "0"], "steps must be an int >= 1"),
    ],
)
def test_plan_rejects_bad_fixed_options(grid, fixed, message):
    with pytest.raises(ValueError, match=message):
        plan(parse_grid(grid), fixed)


# ---------------------------------------------------------------------------------------------------------------
# The runner


def test_run_grid_in_parallel_with_threads_split(tmp_path, fake_train, monkeypatch, capsys):
    command, calls = fake_train
    monkeypatch.setenv("FAKE_TRAIN_SLEEP", "1")
    cells = plan(parse_grid(["sync=rne,stochastic", "seed=0"]), ["--steps", "3"])
    dirs = run_grid(cells, tmp_path / "grid", ["--steps", "3"], jobs=2, command=command)
    assert dirs == [tmp_path / "grid" / c.name for c in cells]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = str(max(1, cpus // 2))
    for cell, d in zip(cells, dirs, strict=True):
        log = (d / "train.log").read_text()
        assert f"threads {threads} {threads}" in log
        assert f"rest ['--sync={cell.settings['sync']}']" in log
        assert json.loads((d / "cell.json").read_text())["settings"] == cell.settings
        assert [json.loads(line)["step"] for line in (d / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]
    # Both processes were running at once: each started before the other one finished (each sleeps 1 s).
    starts = [float(line.split()[1]) for line in calls.read_text().splitlines()]
    ends = [float((d / "ended").read_text()) for d in dirs]
    assert len(starts) == 2 and max(starts) < min(ends)


def test_run_grid_failed_cell_is_reported_and_the_others_still_run(tmp_path, fake_train, monkeypatch, capsys):
    command, calls = fake_train
    monkeypatch.setenv("FAKE_TRAIN_FAIL_SEEDS", "1")
    cells = plan(parse_grid(["seed=0,1,2"]), ["--steps", "2"])
    with pytest.raises(GridError) as info:
        run_grid(cells, tmp_path / "grid", ["--steps", "2"], jobs=2, command=command)
    assert info.value.failed == ["seed-1"]
    assert sorted(_calls(calls)) == sorted(str(tmp_path / "grid" / c.name) for c in cells)
    printed = capsys.readouterr().out
    assert "seed-1 failed (exit status 3)" in printed and "boom: loss is nan at step 2" in printed
    assert (tmp_path / "grid" / "seed-2" / "metrics.jsonl").is_file()
    assert [r.name for r in load_runs(tmp_path / "grid")] == ["seed-0", "seed-2"]


def test_finished_cells_are_skipped_unfinished_rerun_and_force_reruns_all(tmp_path, fake_train, capsys):
    command, calls = fake_train
    out = tmp_path / "grid"
    fixed = ["--steps", "3"]
    cells = plan(parse_grid(["seed=0,1"]), fixed)
    run_grid(cells, out, fixed, command=command)
    assert len(_calls(calls)) == 2

    # A grid with one more seed runs only the new cell.
    more = plan(parse_grid(["seed=0,1,2"]), fixed)
    run_grid(more, out, fixed, command=command)
    assert _calls(calls)[2:] == [str(out / "seed-2")]
    assert "seed-0: finished run found, skipped" in capsys.readouterr().out

    # An interrupted run (fewer steps than configured) starts again from a clean directory.
    metrics = out / "seed-1" / "metrics.jsonl"
    metrics.write_text("\n".join(metrics.read_text().splitlines()[:2]) + "\n")
    run_grid(more, out, fixed, command=command)
    assert _calls(calls)[3:] == [str(out / "seed-1")]
    assert len(metrics.read_text().splitlines()) == 4  # step 0..3, not appended to the old lines

    run_grid(more, out, fixed, command=command, force=True)
    assert len(_calls(calls)) == 7

    # A finished run of other settings is not silently replaced.
    with pytest.raises(ValueError, match="holds a finished run with other settings \\(steps\\)"):
        run_grid(plan(parse_grid(["seed=0"]), ["--steps", "4"]), out, ["--steps", "4"], command=command)
    assert len(_calls(calls)) == 7


def test_run_grid_rejects_bad_jobs(tmp_path):
    with pytest.raises(ValueError, match="jobs must be an int >= 1"):
        run_grid([], tmp_path, [], jobs=0)


# ---------------------------------------------------------------------------------------------------------------
# Reading runs back, the summary, the plots


def _write_run(out: Path, name: str, settings: dict, seed: int, rows: list[dict], seed_in_grid: bool = True) -> None:
    d = out / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"steps": max(r["step"] for r in rows), "seed": seed}))
    cell_seed = str(seed) if seed_in_grid else None
    (d / "cell.json").write_text(json.dumps({"name": name, "settings": settings, "seed": cell_seed}))
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _synthetic_grid(out: Path) -> None:
    """Two configurations x two seeds, 7 training steps: the last 25% is ceil(7/4) = 2 steps (6 and 7)."""
    out.mkdir(parents=True)
    grid = {
        "grid": {"trainer_profile": ["hf", "aligned"], "seed": ["0", "1"]},
        "fixed_args": ["--steps", "7"],
        "cells": [
            "trainer-hf_seed-0",
            "trainer-hf_seed-1",
            "trainer-aligned_seed-0",
            "trainer-aligned_seed-1",
            "trainer-aligned_seed-2",
        ],
    }
    (out / "grid.json").write_text(json.dumps(grid))
    k3 = {("hf", 0): 2e-3, ("hf", 1): 4e-3, ("aligned", 0): 0.0, ("aligned", 1): 0.0}
    for trainer in ("hf", "aligned"):
        for seed in (0, 1):
            base = 0.2 if trainer == "hf" else 0.4
            rows = [{"step": 0, "eval/accuracy": 0.05}]
            for s in range(1, 8):
                rows.append(
                    {
                        "step": s,
                        "reward/mean": base + 0.1 * seed + 0.01 * s,
                        "rollout_corr/k3_kl": k3[trainer, seed] / s,
                        "sync/visible_fraction": None if (s == 7 and seed == 1) else 0.5 + 0.1 * seed,
                        "sync/lag_steps": None,
                        **({"eval/accuracy": 0.1 * s + 0.05 * seed} if s % 3 == 0 else {}),
                    }
                )
            _write_run(out, f"trainer-{trainer}_seed-{seed}", {"trainer_profile": trainer}, seed, rows)


def test_summary_numbers_match_a_hand_computation(tmp_path):
    out = tmp_path / "grid"
    _synthetic_grid(out)
    runs = load_runs(out)
    assert [r.name for r in runs] == [
        "trainer-hf_seed-0",
        "trainer-hf_seed-1",
        "trainer-aligned_seed-0",
        "trainer-aligned_seed-1",
    ]
    md = summarize(runs, out)
    rows = {row["configuration"]: row for row in json.loads((out / "summary.json").read_text())["configurations"]}
    hf = rows["trainer=hf"]
    assert hf["seeds"] == ["0", "1"] and hf["steps"] == 7
    # reward, last two steps: seed 0 (0.26 + 0.27) / 2 = 0.265, seed 1 (0.36 + 0.37) / 2 = 0.365.
    reward = hf["metrics"]["reward/mean"]
    assert reward["mean"] == pytest.approx(0.315) and reward["n"] == 2
    assert reward["std"] == pytest.approx(math.sqrt(2 * 0.05**2))  # sample std (n-1) of 0.265, 0.365
    # eval accuracy at the last evaluation (step 6): 0.6 and 0.65.
    assert hf["metrics"]["eval/accuracy"]["mean"] == pytest.approx(0.625)
    # visible fraction: seed 1 has null at step 7, so its window holds step 6 only: 0.5 and 0.6.
    assert hf["metrics"]["sync/visible_fraction"]["mean"] == pytest.approx(0.55)
    # k3_kl: seed 0 (2e-3/6 + 2e-3/7) / 2, seed 1 twice that; first step 2e-3 and 4e-3.
    k3_seed0 = (2e-3 / 6 + 2e-3 / 7) / 2
    assert hf["metrics"]["rollout_corr/k3_kl"]["mean"] == pytest.approx(1.5 * k3_seed0)
    assert hf["k3_kl_first_step"]["mean"] == pytest.approx(3e-3)
    assert hf["metrics"]["sync/lag_steps"] == {"mean": None, "std": None, "n": 0}  # never defined
    assert hf["metrics"]["accuracy/train"]["n"] == 0  # never logged
    aligned = rows["trainer=aligned"]
    assert aligned["metrics"]["rollout_corr/k3_kl"] == {"mean": 0.0, "std": 0.0, "n": 2}

    text = md.read_text()
    assert "Grid: `trainer=hf,aligned seed=0,1`; fixed train options: `--steps 7`." in text
    assert "not run, or failed before logging a step): trainer-aligned_seed-2." in text
    assert "| trainer=hf | 0,1 | 7 | 0.315 ± 0.071 | – | 0.625 ± 0.035 |" in text
    assert text.count("\n| trainer=") == 2


def test_a_resumed_run_relogs_steps_and_the_later_line_wins(tmp_path):
    _write_run(
        tmp_path,
        "r",
        {},
        7,
        [
            {"step": 1, "reward/mean": 0.1},
            {"step": 2, "reward/mean": 0.2},
            {"step": 2, "reward/mean": 0.3},
            {"step": 3, "reward/mean": 0.4},
        ],
        seed_in_grid=False,
    )
    (run,) = load_runs(tmp_path)
    assert run.seed == "7"  # not a grid key: the run's own seed, from its config.json
    assert [(m["step"], m["reward/mean"]) for m in run.metrics] == [(1, 0.1), (2, 0.3), (3, 0.4)]


def test_load_runs_errors(tmp_path):
    with pytest.raises(ValueError, match="no runs in"):
        load_runs(tmp_path)
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.jsonl").write_text('{"step": 1}\n{"reward": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a metrics line"):
        load_runs(tmp_path)


def test_moving_average_is_centred_and_shrinks_at_the_ends():
    from roundalign.rl.compare_plots import moving_average

    v = np.array([1.0, 2.0, np.nan, 4.0, 8.0])
    expected = np.array([(1 + 2) / 2, (1 + 2) / 2, (2 + 4) / 2, (4 + 8) / 2, (4 + 8) / 2])
    assert np.array_equal(moving_average(v, 3), expected)
    assert np.array_equal(moving_average(v, 1), v, equal_nan=True)


@pytest.mark.parametrize(
    "steps, smooth, window", [(60, 5, 5), (60, 4, 3), (60, 9, 7), (24, 5, 3), (20, 5, 1), (3, 5, 1), (60, 1, 1)]
)
def test_smoothing_window_is_odd_and_at_most_an_eighth_of_the_run(steps, smooth, window):
    from roundalign.rl.compare_plots import smoothing_window

    run = compare.Run("r", {}, {}, [{"step": s} for s in range(steps + 1)])
    assert smoothing_window([run], smooth) == window


def test_plot_writes_one_png_per_metric_and_an_overview(tmp_path):
    from roundalign.rl.compare_plots import PANELS, plot

    out = tmp_path / "grid"
    _synthetic_grid(out)
    paths = plot(load_runs(out), out, smooth=3)
    assert [p.name for p in paths] == [f"{p.file}.png" for p in PANELS] + ["overview.png"]
    for p in paths:
        data = p.read_bytes()
        assert p.parent == out / "plots" and len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"


def _cli_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    return parser.parse_args(argv)


def _run(args: argparse.Namespace) -> int:
    """What ``roundalign compare`` does with parsed arguments: validate the config, then run it."""
    return compare.run(compare.config_from_args(args).validate())


def test_cli_runs_the_grid_then_summarizes_and_plots(tmp_path, fake_train, monkeypatch):
    command, calls = fake_train
    monkeypatch.setattr(compare, "DEFAULT_COMMAND", tuple(command))
    out = tmp_path / "grid"
    assert _run(_cli_args("--grid", "seed=0,1", "--out", str(out), "--", "--steps", "4")) == 0
    grid = json.loads((out / "grid.json").read_text())
    assert grid == {"grid": {"seed": ["0", "1"]}, "fixed_args": ["--steps", "4"], "cells": ["seed-0", "seed-1"]}
    assert (out / "summary.md").is_file() and (out / "plots" / "overview.png").is_file()
    from roundalign.rl import compare_plots

    plotted = []
    monkeypatch.setattr(compare_plots, "plot", lambda runs, out, smooth: plotted.append(len(runs)) or [])
    # --plots-only runs nothing; a failed cell sets the exit status but the rest is still summarized.
    assert _run(_cli_args("--plots-only", "--out", str(out))) == 0
    assert len(_calls(calls)) == 2
    monkeypatch.setenv("FAKE_TRAIN_FAIL_SEEDS", "2")
    args = _cli_args("--grid", "seed=0,1,2", "--out", str(out), "--", "--steps", "4")
    assert _run(args) == ExitStatus.RUNS_FAILED
    assert "seed-2" in (out / "summary.md").read_text() and plotted == [2, 2]
    with pytest.raises(ValueError, match="--jobs must be >= 1"):
        _run(_cli_args("--grid", "seed=5", "--jobs", "0", "--out", str(tmp_path / "other")))
    assert not (tmp_path / "other").exists()
    with pytest.raises(ValueError, match="--grid is required"):
        _run(_cli_args("--out", str(out)))


def test_without_matplotlib_the_grid_is_summarized_and_says_how_to_plot_later(tmp_path, monkeypatch, capsys):
    """An environment without the plotting extra (an engine's venv, where train --engine vllm runs): the finished
    runs are summarized, and the message names the command that draws the plots once matplotlib is there."""
    import importlib.util

    out = tmp_path / "grid"
    _synthetic_grid(out)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a)
    )
    assert _run(_cli_args("--plots-only", "--out", str(out))) == 0
    said = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
    assert "no plots: matplotlib is not installed here (roundalign's [cli] extra)" in said
    assert f"roundalign compare --plots-only --out {out}" in said
    assert (out / "summary.md").is_file() and not (out / "plots").exists()


def test_prefill_check_metrics_get_a_column_and_a_plot_only_when_logged(tmp_path):
    from roundalign.rl.compare_plots import PANELS, plot

    out = tmp_path / "grid"
    _synthetic_grid(out)
    runs = load_runs(out)
    assert "prefill k3_kl" not in summarize(runs, out).read_text()
    # the same grid, now with one run that logged --prefill-check metrics (0 and 1.0 for an aligned trainer)
    path = out / "trainer-aligned_seed-0" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows[1:]:
        r |= {"prefill/k3_kl": 0.0, "prefill/bitwise_equal_frac": 1.0}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs = load_runs(out)
    summarize(runs, out)
    table = {row["configuration"]: row for row in json.loads((out / "summary.json").read_text())["configurations"]}
    assert table["trainer=aligned"]["metrics"]["prefill/bitwise_equal_frac"]["mean"] == 1.0
    assert table["trainer=hf"]["metrics"]["prefill/k3_kl"]["mean"] is None  # not logged by those runs
    names = [p.name for p in plot(runs, out, smooth=1)]
    assert names == [f"{p.file}.png" for p in PANELS] + ["prefill_k3_kl.png", "overview.png"]


def test_a_finished_cell_named_by_an_alias_is_skipped(tmp_path):
    """A run writes its resolved names (``--trainer-profile quantization-aligned`` as the profile it stands for,
    the reference engine's profile with ``--quantization``'s scheme); re-running the grid recognises the cell."""
    from roundalign.rl.compare_plan import train_config
    from roundalign.rl.compare_run import _decide
    from roundalign.rl.loop import resolved

    fixed = ["--quantization", "w8a8-int8", "--engine-profile", "vllm-reference-kernels", "--steps", "2"]
    (cell,) = plan(parse_grid(["trainer=quantization-aligned"]), fixed)
    written = resolved(train_config(cell, fixed)).to_dict()
    assert written["trainer_profile"] == "vllm+quantization=w8a8-int8"
    assert written["engine_profile"] == "vllm-reference-kernels+quantization=w8a8-int8"
    run_dir = tmp_path / cell.name
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(written))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(3)))
    assert _decide(cell, tmp_path, fixed, force=False) == "skip"
