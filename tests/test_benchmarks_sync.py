"""Fair Cast's export benchmark (benchmarks/sync_export.py) and its block in docs/benchmarks.md (report.py --sync).

The benchmark changes the process's allocator for its warm-page rounds, so it runs in a subprocess here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.benchmark_scripts import BENCHMARKS, load

report = load("report")


def test_quick_run_times_both_page_states_and_the_report_fills_its_block(tmp_path):
    out = tmp_path / "sync.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["--sets", "tiny", "--dtypes", "bf16,fp16", "--threads", "1", "--repeats", "2", "--no-tracker"]
    done = subprocess.run([sys.executable, str(BENCHMARKS / "sync_export.py"), *args, "--json", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["suite"] == "sync" and data["machine"]["sync_kernels"] == "compiled"
    assert list(data["results"]) == ["tiny/bf16/fresh/1t", "tiny/fp16/fresh/1t", "tiny/bf16/warm/1t",
                                     "tiny/fp16/warm/1t"]  # fmt: skip
    for r in data["results"].values():
        times = r["export_s"]
        assert all(len(times[mode]) == 2 for mode in ("rne", "stochastic", "error-feedback"))  # warm-up left out
        for mode in times:
            assert r["ratio"][mode] == r["median_s"][mode] / r["median_s"]["rne"]
            per_round = sorted(t / s for t, s in zip(times[mode], times["rne"], strict=True))
            assert r["band"][mode][0] >= per_round[0] - 1e-12 and r["band"][mode][1] <= per_round[-1] + 1e-12
        assert r["gb_per_s"]["error-feedback"] == 14 * r["parameters"] / r["median_s"]["error-feedback"] / 1e9
    page = tmp_path / "benchmarks.md"
    page.write_text("intro\n<!-- bench:sync -->\nold\n<!-- /bench:sync -->\nend\n")
    report.main(["--sync", str(out), "--out", str(page)])
    text = page.read_text()
    assert "old" not in text and text.count("| tiny (3.3M) |") == 4 and "Targets missed:" in text
    assert json.loads((tmp_path / "benchmarks" / "sync.json").read_text()) == data


def test_sync_report_marks_misses_and_ties_against_the_cast():
    def result(pages, sr, ef, ef_band):
        return {"set": "0.5b", "dtype": "fp16", "pages": pages, "threads": 2, "parameters": 494_000_000,
                "median_s": {"rne": 0.1, "stochastic": 0.1 * sr, "error-feedback": 0.1 * ef},
                "ratio": {"rne": 1.0, "stochastic": sr, "error-feedback": ef},
                "band": {"rne": [1.0, 1.0], "stochastic": [sr, sr], "error-feedback": ef_band},
                "gb_per_s": {"rne": 29.6, "stochastic": 20.0, "error-feedback": 40.0}}  # fmt: skip

    block = report.sync_section({"results": {"a": result("fresh", 1.2, 1.6, [1.55, 1.7]),
                                             "b": result("warm", 1.7, 1.6, [1.45, 1.7])}})  # fmt: skip
    lines = block.splitlines()
    assert "| 0.5b (494.0M) | fp16 | fresh | 2 | 0.1000 | 29.6 | 1.200 [1.20-1.20] (≤ 1.50) | " in lines[4]
    assert "1.600 [1.55-1.70] (≤ 1.50) **miss** | 40.0 |" in lines[4]
    assert "1.700 [1.70-1.70] (≤ 1.50) **miss** | 1.600 [1.45-1.70] (≤ 1.50) tie |" in lines[5]
    assert lines[-1] == "Targets missed: 2 of 4 ratios checked."
