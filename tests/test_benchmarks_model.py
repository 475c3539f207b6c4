"""Smoke and invariant tests for benchmarks/model_step.py and benchmarks/report.py. No timing assertions.

The memory methods are checked against values known exactly from what a pass allocates or saves: RMSNorm under a
round-once rule saves only x and the weight; a residual add saves nothing; two float32 buffers of 1 MiB elements
peak at exactly 8 MiB.
"""

from __future__ import annotations

import json

import pytest
import torch

from roundalign import ops
from tests.benchmark_scripts import load

model_step = load("model_step")
report = load("report")


def _check_suite(result: dict, modes: set[str]) -> None:
    assert result["suite"] == "model"
    assert {"cpu", "logical_cpus", "torch_threads", "torch", "date"} <= set(result["machine"])
    rows = result["results"]
    assert {r["mode"] for r in rows} == modes
    stock = {(r["name"], r["mode"], r["pass"], r["shape"]): r for r in rows if r["variant"] == "stock"}
    for r in rows:
        for key in report.REQUIRED + ("saved_bytes", "peak_bytes", "step_peak_bytes", "compile_s"):
            assert key in r, key
        assert r["pass"] == "train step"
        s = stock[(r["name"], r["mode"], r["pass"], r["shape"])]  # every row has its stock row
        assert r["time_ratio"] == r["time_ms"] / s["time_ms"]
        assert r["saved_ratio"] == r["saved_bytes"] / s["saved_bytes"]
        assert r["peak_ratio"] == r["peak_bytes"] / s["peak_bytes"]
        assert r["saved_bytes"] > 0 and r["saved_param_bytes"] > 0 and r["peak_bytes"] > 0
        assert r["step_peak_bytes"] >= r["peak_bytes"]
        assert (r["compile_s"] is not None) == (r["mode"] == "compiled")
        assert r["time_band"][0] <= r["time_band"][1]
    for r in stock.values():
        assert r["time_ratio"] == r["saved_ratio"] == r["peak_ratio"] == 1.0 and r["time_band"] == [1.0, 1.0]
    assert {r["variant"] for r in rows} == set(model_step.VARIANTS)


def test_quick_eager_run_writes_a_consistent_json(tmp_path):
    out = tmp_path / "model.json"
    result = model_step.main(["--quick", "--modes", "eager", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    _check_suite(result, {"eager"})

    # The report renders it: one table row per result row, between the model markers only.
    page = tmp_path / "benchmarks.md"
    page.write_text("intro\n<!-- bench:ops -->\nold ops\n<!-- /bench:ops -->\n<!-- bench:model -->\nold\n"
                    "<!-- /bench:model -->\nend\n")  # fmt: skip
    report.main(["--model", str(out), "--out", str(page)])
    text = page.read_text()
    assert "old ops" in text and "\nold\n" not in text and text.endswith("end\n")
    eager_rows = [line for line in text.splitlines() if line.startswith("| 2x32 | train step | eager |")]
    assert len(eager_rows) == len(model_step.VARIANTS)
    assert json.loads((tmp_path / "benchmarks" / "model.json").read_text()) == result


@pytest.mark.slow
def test_quick_compiled_run(tmp_path):
    _check_suite(model_step.main(["--quick", "--modes", "compiled"]), {"compiled"})


def test_saved_bytes_of_rms_norm_round_once_are_x_and_weight():
    x = torch.randn(4, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(64, dtype=torch.bfloat16, requires_grad=True)
    for rule in ("round_before_weight", "round_after_weight"):
        out, saved, excluded = model_step.measure_saved(lambda rule=rule: ops.rms_norm(x, w, 1e-6, rule))
        assert (saved, excluded) == (4 * 8 * 64 * 2 + 64 * 2, 0)
        _, saved, excluded = model_step.measure_saved(
            lambda rule=rule: ops.rms_norm(x, w, 1e-6, rule), {model_step.storage_key(w)}
        )
        assert (saved, excluded) == (4 * 8 * 64 * 2, 64 * 2)
        out.float().sum().backward()  # the saved tensors are the ones backward reads


def test_saved_bytes_count_a_storage_once_and_a_residual_add_saves_nothing():
    a = torch.randn(3, 5, dtype=torch.bfloat16, requires_grad=True)
    h = torch.randn(3, 5, dtype=torch.bfloat16, requires_grad=True)
    _, saved, _ = model_step.measure_saved(lambda: ops.residual_add(a, h, "normalize_rounded_sum"))
    assert saved == 0
    # a * a saves a twice (as self and other); a[0] * a[1] saves two views of one storage: both count it once.
    _, saved, _ = model_step.measure_saved(lambda: (a * a, a[0] * a[1]))
    assert saved == 3 * 5 * 2


def test_peak_is_the_running_sum_of_allocations():
    def two_buffers():
        first = torch.empty(2**20, dtype=torch.float32)
        second = torch.empty(2**20, dtype=torch.float32)
        del first, second
        third = torch.empty(2**19, dtype=torch.float32)
        return third

    third, peak, net = model_step.measure_peak(two_buffers)
    assert peak == 8 * 2**20
    assert net == third.untyped_storage().nbytes() == 2 * 2**20


def test_report_marks_misses_against_each_target():
    rows = [
        {"name": "m", "variant": "stock", "mode": "compiled", "pass": "train step", "shape": "1x8", "time_ms": 10.0,
         "time_ratio": 1.0, "saved_bytes": 100, "saved_ratio": 1.0, "peak_bytes": 200, "peak_ratio": 1.0},
        {"name": "m", "variant": "aligned", "mode": "compiled", "pass": "train step", "shape": "1x8",
         "time_ms": 10.4, "time_ratio": 1.04, "saved_bytes": 100, "saved_ratio": 1.0, "peak_bytes": 202,
         "peak_ratio": 1.01},
        {"name": "m", "variant": "aligned", "mode": "eager", "pass": "forward", "shape": "1x8", "time_ms": 10.4,
         "time_ratio": 1.04, "saved_bytes": None, "saved_ratio": None, "peak_bytes": 200, "peak_ratio": 1.0},
    ]  # fmt: skip
    lines, misses, checked = report.table(rows)
    assert (misses, checked) == (2, 5)  # compiled time 1.04 > 1.00 and peak 1.01 > 1.00; eager 1.04 <= 1.05
    assert "1.040 (≤ 1.00) **miss**" in lines[3] and "1.040 (≤ 1.05) |" in lines[4]

    # With its noise band (the quartiles of the per-round ratios): a band reaching the target is a tie.
    rows[1]["time_band"] = [0.99, 1.08]
    lines, misses, checked = report.table(rows)
    assert (misses, checked) == (1, 5) and "1.040 [0.99-1.08] (≤ 1.00) tie" in lines[3]
    rows[1]["time_band"] = [1.01, 1.08]
    lines, misses, checked = report.table(rows)
    assert (misses, checked) == (2, 5) and "1.040 [1.01-1.08] (≤ 1.00) **miss**" in lines[3]


def test_report_holds_the_whole_tiny_model_to_its_own_eager_target_and_the_opt_out_to_none():
    def row(name, variant, mode, ratio, band):
        return {"name": name, "variant": variant, "mode": mode, "pass": "train step", "shape": "1x8",
                "time_ms": 10 * ratio, "time_ratio": ratio, "time_band": band, "saved_bytes": 100,
                "saved_ratio": 1.01, "peak_bytes": 200, "peak_ratio": 1.02}  # fmt: skip

    lines, misses, checked = report.table([row("tiny-qwen3", "aligned", "eager", 1.08, [1.07, 1.09])])
    assert "1.080 [1.07-1.09] (≤ 1.10) |" in lines[2] and (misses, checked) == (2, 3)  # saved and peak miss
    lines, misses, checked = report.table([row("qwen3-0.6b-2l-v4k", "aligned", "eager", 1.08, [1.07, 1.09])])
    assert "1.080 [1.07-1.09] (≤ 1.05) **miss**" in lines[2] and (misses, checked) == (3, 3)
    op_row = {**row("rms_norm", "aligned", "eager", 1.08, [1.07, 1.09]), "model": "tiny-qwen3"}
    assert "(≤ 1.05) **miss**" in report.table([op_row])[0][2]  # an op's row keeps the per-op target
    lines, misses, checked = report.table([row("tiny-qwen3", "aligned+eager_ops", "eager", 1.3, [1.2, 1.4])])
    assert "1.300 [1.20-1.40] (opt-out, no target)" in lines[2] and "1.010 (opt-out, no target)" in lines[2]
    assert (misses, checked) == (0, 0)


def test_exact_report_checks_targeted_passes_and_shows_the_first_recompute_without_a_target():
    def row(variant, pass_, ratio, band=None, peak=None):
        return {"name": "m", "shape": "2x8", "pass": pass_, "variant": variant, "profile": "p", "time_ms": 10 * ratio,
                "time_ratio": ratio, "time_band": band, "peak_bytes": peak and 2**20,
                "peak_ratio": peak}  # fmt: skip

    rows = [row("stock", "train step", 1.0, [1.0, 1.0], 1.0), row("exact", "train step", 1.25, [1.21, 1.3], 0.9),
            row("stock", "first recompute", 1.0, [1.0, 1.0]), row("exact", "first recompute", 1.6, [1.5, 1.7]),
            row("stock", "recompute", 1.0, [1.0, 1.0]), row("exact", "recompute", 1.25, [1.1, 1.3])]  # fmt: skip
    block = report.exact_section({"results": rows})
    lines = block.splitlines()
    assert "1.250 [1.21-1.30] (≤ 1.20) **miss**" in lines[5]  # train step: time missed, peak met
    assert "1.600 [1.50-1.70] (once per weight change, no target)" in lines[7]  # not a miss, not counted
    assert "1.250 [1.10-1.30] (≤ 1.20) tie" in lines[9]  # its band reaches the target
    assert lines[-1] == "Targets missed: 1 of 3 ratios checked."


def test_ratio_band_is_the_quartiles_of_the_per_round_ratios():
    assert model_step.ratio_band([2.0, 4.0, 6.0, 8.0, 10.0], [2.0] * 5) == [2.0, 4.0]
    assert model_step.ratio_band([3.0], [2.0]) == [1.5, 1.5]  # one timed round: no spread to give


def test_report_names_what_is_wrong(tmp_path):
    bad = tmp_path / "ops.json"
    bad.write_text(json.dumps({"suite": "ops", "machine": {}, "results": []}))
    with pytest.raises(ValueError, match="--model"):
        report.load(bad, "model")
    with pytest.raises(ValueError, match="no results"):
        report.load(bad, "ops")
    with pytest.raises(ValueError, match="bench:model"):
        report.fill("no markers here", "model", "table")
