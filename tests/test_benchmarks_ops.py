"""Smoke tests of benchmarks/ops.py: its --quick run writes the agreed JSON, and the memory it measures is right.

No timing is asserted (the machine is shared); what is checked cannot be flaky: the row format that
benchmarks/report.py reads, stock rows at ratio 1.0, a stock row for every other row, and the bytes saved for
backward, which for these ops follow exactly from the shapes (computed here from what each formula saves).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmark_scripts import load

bench = load("ops")

ROW_KEYS = {
    "name",
    "variant",
    "mode",
    "pass",
    "shape",
    "time_ms",
    "time_ratio",
    "saved_bytes",
    "saved_ratio",
    "peak_bytes",
    "peak_ratio",
}
_RULES = {
    "rms_norm": {"round_before_weight", "round_after_weight"},
    "add_rms_norm": {
        "round_before_weight/normalize_rounded_sum",
        "round_after_weight/normalize_rounded_sum",
        "round_after_weight/normalize_fp32_sum",
        "round_after_weight/round_at_attention",
        "round_after_weight/never_round",
    },
    "rope": {"bf16/per_op", "bf16/once", "bf16/truncate", "fp32/per_op", "fp32/once"},
    "swiglu": {"round_silu", "once"},
}
# stock, every rule, and every rule's Inductor-fused variant (compiled=True)
VARIANTS = {op: {"stock"} | rules | {f"{r}+compile_ops" for r in rules} for op, rules in _RULES.items()}
BF16, FP32 = 2, 4


def _run(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "ops.json"
    bench.main(["--quick", *args, "--json", str(out)])
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def eager(tmp_path_factory) -> dict:
    return _run(tmp_path_factory.mktemp("ops"), "--modes", "eager")


def _check_structure(data: dict, modes: set[str], ops: set[str]) -> None:
    assert data["suite"] == "ops"
    assert {"cpu", "logical_cpus", "torch_threads", "torch", "date"} <= set(data["machine"])
    rows = data["results"]
    assert rows
    stock = {(r["name"], r["mode"], r["pass"], r["shape"]): r for r in rows if r["variant"] == "stock"}
    for r in rows:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["mode"] in modes and r["pass"] in ("forward", "forward+backward")
        assert r["time_ms"] > 0 and r["peak_bytes"] > 0
        key = (r["name"], r["mode"], r["pass"], r["shape"])
        assert key in stock, f"no stock row for {key}"
        if r["variant"] == "stock":
            assert r["time_ratio"] == 1.0 and r["peak_ratio"] == 1.0
        if r["pass"] == "forward":
            assert r["saved_bytes"] is None and r["saved_ratio"] is None
        else:
            assert r["saved_bytes"] > 0
            assert r["saved_ratio"] == r["saved_bytes"] / stock[key]["saved_bytes"]
            if r["variant"] == "stock":
                assert r["saved_ratio"] == 1.0
    # Every case has every variant: 2 passes x the quick plan's 2 sequence lengths per op and mode.
    for op in ops:
        for mode in modes:
            for pass_ in ("forward", "forward+backward"):
                shapes = {r["shape"] for r in rows if (r["name"], r["mode"], r["pass"]) == (op, mode, pass_)}
                assert len(shapes) == 2
                for shape in shapes:
                    got = {
                        r["variant"]
                        for r in rows
                        if (r["name"], r["mode"], r["pass"], r["shape"]) == (op, mode, pass_, shape)
                    }
                    assert got == VARIANTS[op]


def _expected_saved(op: str, variant: str, seq: int) -> int | None:
    """Bytes saved for backward, from what each formula keeps (inputs are leaves; weight is bf16)."""
    hidden, inter, _, _, head_dim = bench.MODELS["tiny"]
    t, h, i, d = seq, hidden, inter, head_dim
    variant = variant.removesuffix("+compile_ops")  # the fused variant saves what the eager op saves
    if op == "rms_norm":
        if variant == "stock":
            # HF: x.to(fp32) kept by pow and mul; rsqrt's fp32 result (one per row); w and the bf16 normed x.
            return FP32 * t * h + FP32 * t + BF16 * h + BF16 * t * h
        return BF16 * t * h + BF16 * h  # the custom op saves x and weight only
    if op == "add_rms_norm" and variant != "stock":
        residual_rule = variant.split("/")[1]
        x = BF16 if residual_rule == "normalize_rounded_sum" else FP32  # the norm reads R (bf16) or S (fp32)
        return x * t * h + BF16 * h  # the adds save nothing
    if op == "rope":
        if variant == "stock":
            return BF16 * 2 * t * d  # q*cos and rotate_half(q)*sin keep only cos and sin (q and k share them)
        return (BF16 if variant.startswith("bf16") else FP32) * 2 * t * d  # cos and sin, never x
    if op == "swiglu":
        if variant == "stock":
            return 3 * BF16 * t * i  # silu keeps gate; the product keeps silu(gate) and up
        return 2 * BF16 * t * i  # gate and up
    return None


def test_quick_eager_writes_the_agreed_rows(eager):
    _check_structure(eager, {"eager"}, set(bench.OPS))


def test_saved_bytes_match_the_formulas(eager):
    checked = 0
    for r in eager["results"]:
        if r["pass"] != "forward+backward":
            continue
        want = _expected_saved(r["name"], r["variant"], r["seq"])
        if want is not None:
            assert r["saved_bytes"] == want, (r["name"], r["variant"], r["shape"])
            checked += 1
    assert checked == 2 * (5 + 10 + 11 + 5)  # 2 seqs x every variant but stock add_rms_norm


def test_peak_counts_each_allocation_once(eager):
    """SwiGLU forward: stock HF allocates silu(gate) and the product; the fused op allocates its output only. The
    peak must say exactly that (a profiler reading that repeats an allocation in every enclosing op would not)."""
    _, inter, _, _, _ = bench.MODELS["tiny"]
    t = max(r["seq"] for r in eager["results"])
    rows = {r["variant"]: r for r in eager["results"] if (r["name"], r["pass"], r["seq"]) == ("swiglu", "forward", t)}
    assert rows["stock"]["peak_bytes"] == 2 * BF16 * t * inter
    assert rows["once+compile_ops"]["peak_bytes"] == BF16 * t * inter
    assert rows["round_silu+compile_ops"]["peak_bytes"] == BF16 * t * inter


@pytest.mark.slow
def test_quick_compiled_rms_norm(tmp_path):
    data = _run(tmp_path, "--modes", "compiled", "--ops", "rms_norm")
    _check_structure(data, {"compiled"}, {"rms_norm"})
    for r in data["results"]:
        assert r["compile_s"] > 0
        if r["pass"] == "forward+backward" and r["variant"] != "stock":
            # Traced into the graph, the variance is fused tensor ops in ATen's order (ops/_cascade.py), which the
            # partitioner recomputes in the backward from the saved 16-bit x: nothing saved beyond the inputs.
            assert r["saved_bytes"] == _expected_saved("rms_norm", r["variant"], r["seq"])


def test_bad_arguments_name_the_problem(capsys):
    with pytest.raises(SystemExit, match="unknown op nope; choose from rms_norm"):
        bench.main(["--quick", "--ops", "nope"])
    with pytest.raises(SystemExit, match="--rounds must be at least 2"):
        bench.main(["--quick", "--rounds", "1"])
