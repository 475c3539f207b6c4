"""The probe's terminal tables at any console width, and attribution shares where there is no gap to share.

OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_probe_table.py

The width tests print the real ``table.render`` output into consoles of several widths and a pipe, and check what a
reader needs: every line fits, every row keeps its label, every number of the wide layout is there whole (from the
report itself, formatted by the table's own formatters), and rich never had to cut anything ('…').
"""

from __future__ import annotations

import io
from collections import Counter

import pytest

from roundalign.numerics.attribution import (
    SHARE_METRIC,
    RegionSwitch,
    attribution_entry,
    entry_share_undefined,
    share_undefined,
)
from roundalign.numerics.metrics import layer_agreement
from roundalign.probe.report import validate_report
from roundalign.profiles import get_profile
from tests.test_probe_report import _hidden, sample_report

WIDTHS = (200, 120, 80, 40, 24)
REGIONS = ("rms_norm", "qk_norm", "residual", "rope", "swiglu")


def _entry(backend: str, reference: str, base: float, target: float, values: tuple, alones: tuple) -> dict:
    """An attribution entry built by the probe's own attribution_entry, from the share metric's values alone."""
    hf, vllm = get_profile("hf"), get_profile("vllm")
    switches = [RegionSwitch(r, str(getattr(hf, r)), str(getattr(vllm, r)), vllm, vllm) for r in REGIONS]
    return attribution_entry(
        base=hf,
        engine=vllm,
        backend=backend,
        reference=reference,
        base_metrics={SHARE_METRIC: base},
        target_metrics={SHARE_METRIC: target},
        switches=switches,
        switch_metrics={r: {SHARE_METRIC: v} for r, v in zip(REGIONS, values, strict=True)},
        alone_metrics={r: {SHARE_METRIC: a} for r, a in zip(REGIONS, alones, strict=True)},
    )


# The decode entry is the case: the engine profile is no closer to the decode log-probs than stock HF, so
# (base - value) / (base - target) divides by -1e-5 and reads -15100%.
WORSE = _entry("kernels", "decode", 0.00481, 0.00482, (0.0033, 0.0051, 0.0047, 0.0048, 0.0049), (0.003,) * 5)
BETTER = _entry("kernels", "prefill", 0.0123, 0.0009, (0.006, 0.0101, 0.0119, 0.0123, 0.0098), (0.009,) * 5)
TINY = _entry("inductor", "decode", 0.0100, 0.0095, (0.008, 0.0101, 0.0099, 0.0097, 0.0102), (0.007,) * 5)
CLOSER = _entry("inductor", "prefill", 0.00434, 0.00159, (0.004, 0.0041, 0.0042, 0.003, 0.0043), (0.002,) * 5)


@pytest.fixture(scope="module")
def report() -> dict:
    """The sample report with what a default run has: four attribution entries and four per-layer entries."""
    layers = [
        {"trainer_profile": p, "backend": b, "layers": layer_agreement(*_hidden(7 + i, flip))}
        for i, (p, b, flip) in enumerate(
            (("hf", "kernels", 0.6), ("vllm", "kernels", 0.05), ("hf", "inductor", 0.6), ("vllm", "inductor", 0.1))
        )
    ]
    rep, _ = sample_report(attribution=[WORSE, BETTER, TINY, CLOSER], layers=layers)
    return rep


def _print(rep: dict, console) -> str:
    from roundalign.probe.table import render

    for renderable in render(rep):
        console.print(renderable)
    return console.file.getvalue()


def _console(width: int | None = None):
    from rich.console import Console

    return Console(width=width, file=io.StringIO(), force_terminal=False)


def _expected_cells(rep: dict) -> list[str]:
    """Every value cell of every table, formatted with the table's own formatters."""
    from roundalign.probe.table import DECODE_SHAPE_KEYS, MAIN_COLUMNS, fmt_pct, fmt_ulps

    cells = [fmt(c["metrics"].get(key)) for c in rep["comparisons"] for _, key, fmt in MAIN_COLUMNS]
    columns = [c for c in MAIN_COLUMNS if c[1] in DECODE_SHAPE_KEYS]
    cells += [fmt(v["metrics"].get(key)) for v in rep["decode_shapes"]["variants"] for _, key, fmt in columns]
    for e in rep["attribution"]:
        for r in e["regions"]:
            if not entry_share_undefined(e):
                cells.append(f"{100 * r['share']:.0f}%")
            cells.append(f"{100 * r['alone_share']:.0f}%")
    for e in rep["layers"]:
        for row in e["layers"]:
            cells += [fmt_pct(row["equal_frac"]), str(row["differ"]), fmt_ulps(row["max_ulp"])]
    return cells


def _check_readable(text: str, width: int, rep: dict) -> None:
    from rich.cells import cell_len

    lines = text.splitlines()
    too_wide = [line for line in lines if cell_len(line) > width]
    assert not too_wide, too_wide[:3]
    assert "…" not in text
    words = Counter(text.split())
    for c in rep["comparisons"]:
        for label in (c["trainer_profile"], c["backend"], c["reference"]):
            assert words[label] > 0, label
    for e in rep["attribution"]:
        for r in e["regions"]:
            assert words[r["region"]] > 0 and words[r["trainer_rule"]] > 0 and words[r["engine_rule"]] > 0
    # Each number whole, as often as the report has it (a cell lost in one layout would lower a count).
    missing = Counter(_expected_cells(rep)) - words
    assert not missing, missing


@pytest.mark.parametrize("width", WIDTHS)
def test_every_table_is_whole_at_any_width(report, width):
    text = _print(report, _console(width))
    _check_readable(text, width, report)


@pytest.mark.parametrize("columns", [None, "100"])
def test_piped_console_honours_columns(report, monkeypatch, columns):
    # A pipe has no terminal size: rich takes COLUMNS when it is set, else 80.
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    console = _console()
    assert not console.is_terminal and console.width == int(columns or 80)
    _check_readable(_print(report, console), console.width, report)


def test_layout_follows_the_width(report):
    """Wide: one row per comparison with all metrics; 120: the same rows over two tables; 80: metrics as rows,
    one block per trainer profile. The same render() output gives each."""
    from roundalign.probe.table import render

    out = render(report)
    texts = {}
    for width in (200, 120, 80):
        console = _console(width)
        for renderable in out:
            console.print(renderable)
        texts[width] = console.file.getvalue()
    header = [line for line in texts[200].splitlines() if "k3_kl" in line and "ρ err" in line]
    assert len(header) == 1  # every metric column in one table
    assert not any("k3_kl" in line and "ρ err" in line for line in texts[120].splitlines())
    assert sum(line.split()[:2] == ["backend", "ref"] for line in texts[120].splitlines()) == 2  # two column groups
    blocks = [w[1:] for w in map(str.split, texts[80].splitlines()) if w[:1] == ["trainer"] and w[1] != "rule"]
    assert blocks == [["hf"] * 4, ["vllm"] * 4]
    assert any(line.split()[:2] == ["bitwise", "equal"] for line in texts[80].splitlines())


def test_narrowest_layout_is_one_line_per_cell():
    from roundalign.probe.table import fmt_num, render

    rep, _ = sample_report(attribution=[], layers=[], decode_shapes=None, notes=[])
    console = _console(24)
    for renderable in render(rep):
        console.print(renderable)
    text = console.file.getvalue()
    assert "…" not in text
    c = rep["comparisons"][0]
    assert f"  k3_kl: {fmt_num(c['metrics']['rollout_corr/k3_kl'])}" in text.splitlines()


# -----------------------------------------------------------------------------
# attribution shares when the target is not closer


def test_share_undefined():
    assert share_undefined(0.0123, 0.0009) is None
    assert share_undefined(0.01, 0.0089) is None  # a gap of 11% of base
    assert share_undefined(0.00481, 0.00482) == "target not closer"
    assert share_undefined(0.01, 0.01) == "target not closer"
    assert share_undefined(0.0, 0.0) == "target not closer"
    assert share_undefined(0.01, 0.0095) == "gap < 10% of base"
    assert share_undefined(None, 0.01) == "metric undefined"


def test_entry_where_the_target_is_worse_flags_the_shares():
    assert WORSE["share_undefined"] == "target not closer"
    rms_norm = WORSE["regions"][0]
    # The raw ratio stays in the report for whoever wants it; it is the -15100% the flag keeps out of view.
    assert rms_norm["share"] == pytest.approx((0.00481 - 0.0033) / (0.00481 - 0.00482))
    assert round(100 * rms_norm["share"]) == -15100
    assert rms_norm["alone_share"] == 0.003 / 0.00481  # a fraction of base, still meaningful
    assert TINY["share_undefined"] == "gap < 10% of base"


def test_entry_where_the_target_is_better_keeps_the_shares():
    assert BETTER["share_undefined"] is None
    assert [r["share"] for r in BETTER["regions"]] == [
        (0.0123 - v) / (0.0123 - 0.0009) for v in (0.006, 0.0101, 0.0119, 0.0123, 0.0098)
    ]
    assert [f"{100 * r['share']:.0f}%" for r in BETTER["regions"]] == ["55%", "19%", "4%", "0%", "22%"]


def test_entry_without_the_field_is_judged_from_base_and_target():
    old = {k: v for k, v in WORSE.items() if k != "share_undefined"}
    assert entry_share_undefined(old) == "target not closer"
    assert entry_share_undefined({**WORSE, "share_undefined": None}) is None  # the report's word wins


def test_table_prints_no_share_where_the_target_is_not_closer():
    rep, _ = sample_report(attribution=[WORSE, BETTER])
    validate_report(rep)
    text = _print(rep, _console(200))
    lines = text.splitlines()
    (row,) = [line for line in lines if line.split()[:1] == ["rms_norm"]]
    # Columns: kernels decode switch, alone; kernels prefill switch, alone.
    assert row.split()[3:] == ["n/a", "(target", "not", "closer)", "62%", "55%", "73%"]
    assert "-15100%" not in text and "15100" not in text


def test_plot_bars_are_clipped_and_undefined_shares_left_out(tmp_path):
    from roundalign.probe.plots import SHARE_AXIS, plot_attribution, share_bar

    assert SHARE_AXIS == (-100.0, 200.0)
    assert share_bar(0.5526, None) == (pytest.approx(55.26), "55%", False)
    assert share_bar(32.94, None) == (200.0, "3294% (off axis)", True)
    assert share_bar(-10.69, None) == (-100.0, "-1069% (off axis)", True)
    assert share_bar(-151.0, "target not closer") == (None, "n/a: target not closer", False)
    assert share_bar(None, None) == (None, "n/a", False)
    rep, _ = sample_report(attribution=[WORSE, BETTER, TINY, CLOSER])
    path = plot_attribution(rep, tmp_path / "attribution.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
