"""Smoke test for benchmarks/osol_cost.py and its section of benchmarks/report.py. No timing assertions.

One ``--quick`` run (4 prompts x 2 completions of 4 tokens, 2 rounds): the JSON has a GRPO and an OSOL row per
trainer that ran (the exact trainer only where vLLM's ops load; elsewhere it is listed as skipped, with the reason),
positive times and memory, ratios against the GRPO row of the same trainer, OSOL's kept weights, and the report fills
the osol markers alone.
"""

from __future__ import annotations

import json
import statistics

import pytest

from tests.benchmark_scripts import load

pytest.importorskip("reasoning_gym")

osol_cost = load("osol_cost")
report = load("report")


def test_quick_run_writes_the_agreed_rows_and_the_report_fills_its_section(tmp_path):
    out = tmp_path / "osol.json"
    result = osol_cost.main(["--quick", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["suite"] == "osol" and result["target"] == osol_cost.TARGET == report.OSOL_TARGET
    assert {"cpu", "logical_cpus", "torch_threads", "torch", "date"} <= set(result["machine"])
    rows = result["results"]
    trainers = list(dict.fromkeys(r["trainer"] for r in rows))
    assert "stock" in trainers and set(trainers) | set(result["skipped"]) == set(osol_cost.TRAINERS)
    assert [(r["trainer"], r["variant"]) for r in rows] == [(t, v) for t in trainers for v in osol_cost.VARIANTS]
    assert result["rollout_ms"] > 0 and result["completion_tokens"] > 0 and result["weights_16bit_bytes"] > 0
    assert result["shape"]["completions"] == 8 and result["rollout_same_batch"]
    for r in rows:
        grpo = next(g for g in rows if g["trainer"] == r["trainer"] and g["variant"] == "grpo")
        assert r["time_ms"] > 0 and r["whole_ms"] > r["time_ms"]
        assert r["peak_bytes"] == r["held_bytes"] + r["step_peak_bytes"] and r["step_peak_bytes"] > 0
        assert r["time_ratio"] == pytest.approx(r["time_ms"] / grpo["time_ms"])
        assert r["peak_ratio"] == r["peak_bytes"] / grpo["peak_bytes"]
        assert r["time_band"][0] <= r["time_band"][1] and r["whole_band"][0] <= r["whole_band"][1]
        assert r["phases_ms"]["recompute"] > 0 and r["phases_ms"]["sync"] > 0
        if r["variant"] == "grpo":
            assert r["time_ratio"] == 1.0 and r["osol_held_bytes"] == 0 and "extra_ms" not in r
            assert r["additions_ratio"] == 1.0  # GRPO's step has no OSOL phase
        else:  # the previous weights: one 16-bit copy (the current ones are the run's kept export, under rne)
            assert r["osol_held_bytes"] == result["weights_16bit_bytes"]
            assert r["focus_rows"] == 2 and r["phases_ms"]["osol"] > 0
            assert len(r["copies_ms"]) == 3  # to the previous weights, back, and the sync's
            added = [g + o for g, o in zip(grpo["times_ms"][1:], r["phases_ms_rounds"]["osol"][1:], strict=True)]
            assert r["additions_ratio"] == pytest.approx(
                statistics.median(added) / statistics.median(grpo["times_ms"][1:])
            )
            assert 1.0 < r["additions_ratio"] and r["additions_band"][0] <= r["additions_band"][1]
        if r["variant"] == "osol":
            assert r["extra_ms"]["footprint_forwards"] > 0 and r["extra_ms"]["backtracking_forwards"] > 0
            extra = r["extra_ms"]
            assert extra["extra_trained"] == r["phases_ms"]["update"] - grpo["phases_ms"]["update"]
            parts = ("footprint_forwards", "backtracking_forwards", "weight_copies", "extra_trained", "rest")
            assert sum(extra[k] for k in parts) == pytest.approx(extra["total"])
        if r["variant"] == "osol-lean":  # --osol-backtracking-every 0: the footprint's forwards only
            assert "backtracking_ms" not in r["calls_ms"] and "extra_ms" not in r

    page = tmp_path / "benchmarks.md"
    page.write_text("intro\n<!-- bench:quant -->\nold quant\n<!-- /bench:quant -->\n<!-- bench:osol -->\nold\n"
                    "<!-- /bench:osol -->\nend\n")  # fmt: skip
    report.main(["--osol", str(out), "--out", str(page)])
    text = page.read_text()
    assert "old quant" in text and "\nold\n" not in text and text.endswith("end\n")
    table = [line for line in text.splitlines() if line.startswith("| stock (`hf`) |")]
    assert [line.split(" | ")[1] for line in table] == ["grpo", "osol", "osol-lean"]
    assert "Targets missed: {} of {} ratios checked.".format(*osol_cost.verdict(rows)) in text
    assert json.loads((tmp_path / "benchmarks" / "osol.json").read_text()) == result


def test_report_judges_osol_against_its_target_with_the_band():
    def row(variant, ratio, band):  # the whole step 1.4x: no target, only what OSOL adds is judged
        return {"trainer": "stock", "variant": variant, "profile": "hf", "time_ms": 140, "time_ratio": 1.4,
                "time_band": [1.3, 1.5], "additions_ratio": ratio, "additions_band": band,
                "whole_ms": 200, "whole_ratio": 1.0, "whole_band": [1.0, 1.0],
                "trained_sequence_frac": 0.5, "peak_bytes": 2**20, "peak_ratio": 1.0, "osol_held_bytes": 0,
                "focus_rows": 16}  # fmt: skip

    data = {"model": "m", "domains": "a,b", "rounds": 3, "rollout_ms": 50.0, "completion_tokens": 10,
            "weights_16bit_bytes": 2**20, "shape": {"completions": 4, "prompts_per_step": 2, "group_size": 2,
                                                    "max_tokens": 4}}  # fmt: skip
    lines = report.osol_section(data | {"results": [row("grpo", 1.0, [1.0, 1.0]), row("osol", 1.2, [1.17, 1.3])]})
    assert "1.200 [1.17-1.30] (≤ 1.15) **miss**" in lines and lines.endswith("Targets missed: 1 of 1 ratios checked.")
    lines = report.osol_section(data | {"results": [row("grpo", 1.0, [1.0, 1.0]), row("osol", 1.2, [1.1, 1.3])]})
    assert "1.200 [1.10-1.30] (≤ 1.15) tie" in lines and lines.endswith("Targets missed: 0 of 1 ratios checked.")
