"""roundalign compare over --domains: the ``method`` grid key (baselines and OSOL's ablations), the per-domain summary
and plots.

Planning is checked on the exact train options of each method value; the summary against numbers worked out by hand
from hand-made run directories (``method=alone`` assembled from its per-domain runs); the command end to end with a
tiny stdlib-only script in place of ``roundalign train`` that writes the metrics a multi-domain run would.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pytest

from roundalign.rl import compare
from roundalign.rl.compare import load_runs, parse_grid, plan
from roundalign.rl.compare_multidomain import plot_domains, summarize_domains
from roundalign.rl.compare_plan import train_config, without

DOMAINS = ["--domains", "arithmetic,counting"]
FIXED = [*DOMAINS, "--steps", "2", "--model", "tiny-llama-chars"]


def _cells(grid: list[str], fixed: list[str] = FIXED) -> dict:
    return {c.name: c for c in plan(parse_grid(grid), fixed)}


# ---------------------------------------------------------------------------------------------------------------
# Planning


def test_each_method_value_expands_into_its_train_options():
    methods = "grpo,osol,osol-no-residual,osol-random-residual,osol-equal-weights"
    cells = _cells([f"method={methods}"])
    assert {name: c.train_options() for name, c in cells.items()} == {
        "method-grpo": ["--adv-estimator=grpo"],
        "method-osol": ["--adv-estimator=osol"],
        "method-osol-no-residual": ["--adv-estimator=osol", "--osol-residual=none"],
        "method-osol-random-residual": ["--adv-estimator=osol", "--osol-residual=random"],
        "method-osol-equal-weights": ["--adv-estimator=osol", "--osol-other-weight=1.0"],
    }
    for cell in cells.values():
        assert cell.argv(FIXED) == [*FIXED, *cell.train_options()]  # the fixed options kept whole
        assert cell.settings == {"method": cell.name.removeprefix("method-")}
    config = {name: train_config(c, FIXED) for name, c in cells.items()}
    assert config["method-grpo"].adv_estimator == "grpo" and config["method-grpo"].domains == "arithmetic,counting"
    assert config["method-osol-no-residual"].osol_residual == "none"
    assert config["method-osol-random-residual"].osol_residual == "random"
    equal = config["method-osol-equal-weights"]
    assert equal.osol_other_weight == equal.osol_focus_weight == 1.0


def test_equal_weights_follow_the_fixed_focus_weight_and_grpo_runs_without_osol_options():
    fixed = [*FIXED, "--osol-focus-weight", "2", "--osol-tau=0.05"]
    cells = _cells(["method=grpo,alone,osol-equal-weights"], fixed)
    equal = cells["method-osol-equal-weights"]
    assert equal.train_options() == ["--adv-estimator=osol", "--osol-other-weight=2.0"]
    config = train_config(equal, fixed)
    assert (config.osol_focus_weight, config.osol_other_weight, config.osol_tau) == (2.0, 2.0, 0.05)
    # GRPO refuses OSOL's options: its cells leave the fixed ones out (the OSOL cells keep them).
    assert cells["method-grpo"].argv(fixed) == [*FIXED, "--adv-estimator=grpo"]
    assert cells["method-alone+counting"].argv(fixed) == [
        "--steps",
        "2",
        "--model",
        "tiny-llama-chars",
        "--domains=counting",
        "--adv-estimator=grpo",
    ]
    assert equal.argv(fixed) == [*fixed, *equal.train_options()]


def test_alone_is_one_cell_per_domain_and_one_configuration():
    fixed = [
        "--engine",
        "vllm",
        "--model",
        "tiny-llama-chars",
        "--domains",
        "arithmetic,words=spell_backward+word_sorting",
    ]
    cells = plan(parse_grid(["method=alone,osol", "trainer=hf,engine", "seed=0,1"]), fixed)
    assert [c.name for c in cells] == [
        *(
            f"method-alone+{d}_trainer-{t}_seed-{s}"
            for t in ("hf", "engine")
            for s in ("0", "1")
            for d in ("arithmetic", "words")
        ),
        *(f"method-osol_trainer-{t}_seed-{s}" for t in ("hf", "engine") for s in ("0", "1")),
    ]
    alone = [c for c in cells if c.settings["method"] == "alone"]
    assert {c.label for c in alone if c.settings["trainer_profile"] == "hf"} == {"method=alone trainer=hf"}
    assert [(c.domain, c.seed) for c in alone[:4]] == [
        ("arithmetic", "0"),
        ("words", "0"),
        ("arithmetic", "1"),
        ("words", "1"),
    ]
    words = alone[1]
    assert words.train_options() == [
        "--domains=words=spell_backward+word_sorting",  # Domain.spec(): what parse_domains reads back
        "--adv-estimator=grpo",
        "--trainer-profile=hf",
        "--seed=0",
    ]
    assert words.argv(fixed) == ["--engine", "vllm", "--model", "tiny-llama-chars", *words.train_options()]
    config = train_config(words, fixed)
    assert config.domains == "words=spell_backward+word_sorting" and config.adv_estimator == "grpo"
    assert config.prompts_per_step == 8  # the same batch as a mixed run: the domain alone gets all of it
    assert train_config(alone[0], fixed).domains == "arithmetic"
    osol = train_config(cells[-1], fixed)
    assert (osol.adv_estimator, osol.trainer_profile, osol.seed, osol.engine) == ("osol", "engine", 1, "vllm")


@pytest.mark.parametrize(
    "grid, fixed, message",
    [
        (["method=grpo,ppo"], FIXED, "unknown method(s) ['ppo'] in the grid; method is one of: grpo, alone, osol"),
        (["method=grpo"], ["--steps", "2"], "give --domains with at least two domains in the fixed train options"),
        (["method=grpo"], ["--domains", "counting"], "has one domain; give at least two"),
        (
            ["method=grpo", "adv-estimator=grpo,osol"],
            FIXED,
            "--adv-estimator is a grid key next to the grid key method",
        ),
        (["method=osol"], [*FIXED, "--adv-estimator", "osol"], "drop --adv-estimator from the fixed options"),
        (["method=osol"], [*FIXED, "--osol-residual=none"], "--osol-residual is a fixed train option"),
        (["method=osol"], [*FIXED, "--osol-other-weight", "0.2"], "--osol-other-weight is a fixed train option"),
        (["method=osol", "osol-residual=none"], FIXED, "--osol-residual is a grid key"),
        (["method=alone", "domains=arithmetic,counting"], FIXED, "--domains is a grid key"),
        (["method=grpo,osol", "osol-tau=0.01,0.1"], FIXED, "osol-tau vary OSOL's settings, which the grpo and alone"),
        (["method=grpo"], ["--domains", "arithmetic,nosuch"], "unknown domain 'nosuch'"),
    ],
)
def test_method_validation_errors(grid, fixed, message):
    with pytest.raises(ValueError) as info:
        plan(parse_grid(grid), fixed)
    assert message in str(info.value)


def test_osol_keys_may_vary_next_to_osol_methods_only():
    cells = _cells(["method=osol,osol-equal-weights", "osol-focus-weight=1,2"])
    assert cells["method-osol-equal-weights_osol-focus-weight-2"].train_options() == [
        "--adv-estimator=osol",
        "--osol-other-weight=2.0",
        "--osol-focus-weight=2",
    ]


def test_without_takes_an_option_out_however_it_is_spelt():
    argv = ["--osol-tau", "0.1", "--lr=-1e-5", "--enforce-eager", "--osol-clip=2", "--osol-p-l", "0.2", "--steps", "3"]
    assert without(argv, ("osol_tau", "osol_clip", "osol_p_lo")) == ["--lr=-1e-5", "--enforce-eager", "--steps", "3"]
    assert without(argv, ()) == argv


# ---------------------------------------------------------------------------------------------------------------
# The summary and plots, from hand-made runs


def _write_run(out: Path, name: str, method: str, seed: int, domains: str, rows: list[dict], domain=None) -> None:
    d = out / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"steps": 8, "seed": seed, "domains": domains}))
    cell = {"name": name, "settings": {"method": method}, "seed": str(seed), **({"domain": domain} if domain else {})}
    (d / "cell.json").write_text(json.dumps(cell))
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _rows(evals: dict[int, dict[str, float]], train) -> list[dict]:
    """Steps 0..8; ``evals``: step -> {domain: held-out reward}, with eval/accuracy their mean as a run logs it;
    ``train(step)``: that step's other metrics."""
    rows = []
    for step in range(9):
        row = {"step": step, **(train(step) if step else {})}
        if step in evals:
            row |= {f"eval/{d}/reward": v for d, v in evals[step].items()}
            row["eval/accuracy"] = sum(evals[step].values()) / len(evals[step])
        rows.append(row)
    return rows


def _synthetic_grid(out: Path) -> None:
    """method=grpo,alone,osol x seed=0,1 over arithmetic,counting; 8 steps (the last 25%: steps 7 and 8), evaluations
    at steps 0, 4 and 8."""
    out.mkdir(parents=True)
    cells = []
    for seed in (0, 1):
        name = f"method-grpo_seed-{seed}"
        evals = {0: {"arithmetic": 0.0, "counting": 0.0}, 4: {"arithmetic": 0.9, "counting": 0.9}}
        evals[8] = {"arithmetic": 0.5 + 0.1 * seed, "counting": 0.3 + 0.1 * seed}
        train = lambda s, seed=seed: {"rollout_corr/k3_kl": 1e-3 * (1 + seed), "timing_s/step": 2.0 + 0.5 * seed}  # noqa: E731
        _write_run(out, name, "grpo", seed, "arithmetic,counting", _rows(evals, train))
        cells.append(name)
    for seed in (0, 1):
        for domain, final, k3, secs in (
            ("arithmetic", 0.7 + 0.1 * seed, 1e-3, 1.0),
            ("counting", 0.2 + 0.05 * seed, 3e-3, 3.0),
        ):
            name = f"method-alone+{domain}_seed-{seed}"
            evals = {0: {domain: 0.0}, 4: {domain: 0.95}, 8: {domain: final}}
            train = lambda s, k3=k3, secs=secs: {"rollout_corr/k3_kl": k3, "timing_s/step": secs}  # noqa: E731
            _write_run(out, name, "alone", seed, domain, _rows(evals, train), domain=domain)
            cells.append(name)
    for seed in (0, 1):
        name = f"method-osol_seed-{seed}"
        evals = {
            0: {"arithmetic": 0.0, "counting": 0.0},
            8: {"arithmetic": 0.6 + 0.1 * seed, "counting": 0.4 + 0.1 * seed},
        }

        def train(s, seed=seed):
            return {
                "osol/focus_domain": "arithmetic",
                "osol/kappa": None if s == 1 else 0.1 * s + seed,
                "osol/backtracking": None if (s == 8 and seed == 1) else 0.01 * s,
                "mismatch/bitwise_equal_frac": 1.0,
            }

        _write_run(out, name, "osol", seed, "arithmetic,counting", _rows(evals, train))
        cells.append(name)
    grid = {"grid": {"method": ["grpo", "alone", "osol"], "seed": ["0", "1"]}, "fixed_args": FIXED, "cells": cells}
    (out / "grid.json").write_text(json.dumps(grid))


def _sample_std(a: float, b: float) -> float:
    return abs(a - b) / math.sqrt(2)


def test_summary_per_domain_and_macro_match_a_hand_computation(tmp_path):
    out = tmp_path / "grid"
    _synthetic_grid(out)
    md = summarize_domains(load_runs(out), out)
    data = json.loads((out / "summary.json").read_text())
    assert data["domains"] == ["arithmetic", "counting"]
    rows = {row["configuration"]: row for row in data["configurations"]}
    assert list(rows) == ["method=grpo", "method=alone", "method=osol"]

    grpo = rows["method=grpo"]["metrics"]
    # the last evaluation (step 8), not the better one at step 4
    assert grpo["eval/arithmetic/reward"]["mean"] == pytest.approx(0.55)
    assert grpo["eval/arithmetic/reward"]["std"] == pytest.approx(_sample_std(0.5, 0.6))
    assert grpo["eval/counting/reward"]["mean"] == pytest.approx(0.35)
    assert grpo["eval/accuracy"]["mean"] == pytest.approx(((0.5 + 0.3) / 2 + (0.6 + 0.4) / 2) / 2)
    assert grpo["rollout_corr/k3_kl"]["mean"] == pytest.approx(1.5e-3)
    assert grpo["timing_s/step"]["mean"] == pytest.approx(2.25)
    assert grpo["osol/kappa"] == {"mean": None, "std": None, "n": 0}

    alone = rows["method=alone"]
    assert alone["seeds"] == ["0", "1"] and alone["steps"] == 8
    assert alone["runs"] == [f"method-alone+{d}_seed-{s}" for s in (0, 1) for d in ("arithmetic", "counting")]
    m = alone["metrics"]
    # each domain's reward from the run trained on it alone
    assert m["eval/arithmetic/reward"]["mean"] == pytest.approx(0.75)
    assert m["eval/counting/reward"]["mean"] == pytest.approx(0.225)
    assert m["eval/counting/reward"]["std"] == pytest.approx(_sample_std(0.2, 0.25))
    macro0, macro1 = (0.7 + 0.2) / 2, (0.8 + 0.25) / 2
    assert m["eval/accuracy"]["mean"] == pytest.approx((macro0 + macro1) / 2)
    assert m["eval/accuracy"]["std"] == pytest.approx(_sample_std(macro0, macro1))
    # the train metrics: the mean over the seed's domain runs
    assert m["rollout_corr/k3_kl"]["mean"] == pytest.approx(2e-3) and m["timing_s/step"]["mean"] == pytest.approx(2.0)

    osol = rows["method=osol"]["metrics"]
    assert osol["eval/accuracy"]["mean"] == pytest.approx(((0.6 + 0.4) / 2 + (0.7 + 0.5) / 2) / 2)
    assert osol["osol/kappa"]["mean"] == pytest.approx(((0.7 + 0.8) / 2 + (1.7 + 1.8) / 2) / 2)
    # seed 1's backtracking is null at step 8: its window holds step 7 only
    assert osol["osol/backtracking"]["mean"] == pytest.approx(((0.07 + 0.08) / 2 + 0.07) / 2)
    assert osol["mismatch/bitwise_equal_frac"] == {"mean": 1.0, "std": 0.0, "n": 2}

    text = md.read_text()
    assert text.startswith("# roundalign compare: multi-domain")
    assert "| configuration | seeds | steps | arithmetic | counting | macro |" in text
    assert "| method=alone | 0,1 | 8 | 0.75 ± 0.071 | 0.225 ± 0.035 |" in text
    assert (
        "| configuration | seeds | kappa | residual share | backtracking | footprint < mismatch | rank change |" in text
    )
    assert "| configuration | seeds | k3_kl | log-ratio RMS | bitwise equal | s/step |" in text


def test_alone_seed_missing_a_domain_has_no_macro(tmp_path):
    out = tmp_path / "grid"
    _synthetic_grid(out)
    for f in (out / "method-alone+counting_seed-1").iterdir():
        f.unlink()
    (out / "method-alone+counting_seed-1").rmdir()
    md = summarize_domains(load_runs(out), out)
    rows = {row["configuration"]: row for row in json.loads((out / "summary.json").read_text())["configurations"]}
    m = rows["method=alone"]["metrics"]
    assert m["eval/accuracy"] == {"mean": pytest.approx((0.7 + 0.2) / 2), "std": None, "n": 1}
    assert m["eval/counting/reward"]["n"] == 1 and m["eval/arithmetic/reward"]["n"] == 2
    assert "method-alone+counting_seed-1." in md.read_text()  # named as missing


def test_plot_domains_writes_the_per_domain_macro_and_backtracking_plots(tmp_path):
    out = tmp_path / "grid"
    _synthetic_grid(out)
    paths = plot_domains(load_runs(out), out, smooth=3)
    assert [p.name for p in paths] == ["held_out_reward.png", "held_out_macro.png", "osol_backtracking.png"]
    for p in paths:
        data = p.read_bytes()
        assert p.parent == out / "plots" and len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------------------------
# The command end to end, with a fake train

FAKE_TRAIN = r"""
import argparse, json, os
p = argparse.ArgumentParser()
for o in ("--out", "--domains", "--adv-estimator", "--osol-residual"):
    p.add_argument(o)
p.add_argument("--steps", type=int); p.add_argument("--seed", type=int, default=0)
p.add_argument("--quiet", action="store_true")
args, rest = p.parse_known_args()
domains = args.domains.split(",")
with open(os.path.join(args.out, "config.json"), "w") as f:
    json.dump({"steps": args.steps, "seed": args.seed, "domains": args.domains}, f)
with open(os.path.join(args.out, "metrics.jsonl"), "w") as f:
    for s in range(args.steps + 1):
        row = {"step": s, **{f"eval/{d}/reward": 0.1 * s + 0.01 * i for i, d in enumerate(domains)}}
        if s and args.adv_estimator == "osol":
            row["osol/backtracking"] = 0.1 * args.seed
        f.write(json.dumps(row) + "\n")
"""


def test_compare_runs_a_method_grid_and_plots_only_redoes_it(tmp_path, monkeypatch):
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    monkeypatch.setattr(compare, "DEFAULT_COMMAND", (sys.executable, str(script)))
    out = tmp_path / "grid"
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)

    def run(*argv: str) -> int:
        return compare.run(compare.config_from_args(parser.parse_args(argv)).validate())

    assert run("--grid", "method=grpo,alone,osol-no-residual", "seed=0,1", "--out", str(out), "--", *FIXED) == 0
    cell = json.loads((out / "method-alone+counting_seed-1" / "cell.json").read_text())
    assert cell["settings"] == {"method": "alone"} and cell["domain"] == "counting" and cell["seed"] == "1"
    assert "--domains=counting" in cell["argv"] and "arithmetic,counting" not in cell["argv"]
    assert json.loads((out / "method-osol-no-residual_seed-0" / "config.json").read_text())["domains"] == (
        "arithmetic,counting"
    )
    rows = json.loads((out / "summary.json").read_text())["configurations"]
    assert [r["configuration"] for r in rows] == ["method=grpo", "method=alone", "method=osol-no-residual"]
    alone = rows[1]["metrics"]  # each domain alone logs its reward as domain 0: 0.1 * 2 at the last step
    assert alone["eval/arithmetic/reward"]["mean"] == alone["eval/counting/reward"]["mean"] == pytest.approx(0.2)
    assert rows[0]["metrics"]["eval/counting/reward"]["mean"] == pytest.approx(0.21)
    assert rows[2]["metrics"]["osol/backtracking"]["mean"] == pytest.approx(0.05)
    names = {"held_out_reward.png", "held_out_macro.png", "osol_backtracking.png"}
    assert {p.name for p in (out / "plots").iterdir()} == names
    for p in [out / "summary.md", out / "summary.json", *(out / "plots").iterdir()]:
        p.unlink()
    assert run("--plots-only", "--out", str(out)) == 0
    assert (out / "summary.md").read_text().startswith("# roundalign compare: multi-domain")
    assert {p.name for p in (out / "plots").iterdir()} == names
