"""Probe report schema, terminal tables and plots: .venv/bin/python -m pytest -q tests/test_probe_report.py

The sample report is built the way the probe builds one: synthetic log-probs through the real mismatch_metrics and
layer_agreement, with the numbers a bf16 mismatch produces (stock HF far off, an aligned profile mostly bitwise
equal), so the table and the plots are exercised on realistic shapes and magnitudes.
"""

import copy
import io
import json
import math
import subprocess
import sys

import pytest
import torch

from roundalign.numerics.attribution import region_share
from roundalign.numerics.metrics import layer_agreement, log_ratios, mismatch_metrics
from roundalign.probe.report import (
    SCHEMA,
    build_report,
    load_report,
    validate_report,
    write_report,
)
from roundalign.profiles import get_profile


def _sides(seed: int, flip: float):
    """Engine log-probs, and a trainer's that differ on a fraction `flip` of tokens by bf16-sized amounts."""
    g = torch.Generator().manual_seed(seed)
    engine, trainer, fp32 = [], [], []
    for n in (37, 52, 18, 64, 41, 29, 55, 33):
        e = (-torch.rand(n, generator=g).pow(3) * 6).float()
        differs = torch.rand(n, generator=g) < flip
        noise = torch.randn(n, generator=g) * 10 ** (-3 * torch.rand(n, generator=g) - 1)
        engine.append(e)
        trainer.append(torch.where(differs, e + noise.float(), e))
        fp32.append(e + (torch.randn(n, generator=g) * 3e-3).float())
    return trainer, engine, fp32


def _hidden(seed: int, flip: float, layers: int = 4):
    g = torch.Generator().manual_seed(seed)
    trainer, engine = [], []
    for i in range(layers):
        h = torch.randn(8, 64, generator=g).to(torch.bfloat16)
        bits = h.view(torch.int16).clone()
        changed = torch.rand(h.shape, generator=g) < flip * (i + 1) / layers
        # Mostly 1-ulp flips; the worst element drifts further in deeper layers the more the sides disagree.
        bits[changed] += 1
        bits.view(-1)[0] += round(i * flip * 5)
        trainer.append(bits.view(torch.bfloat16))
        engine.append(h)
    return trainer, engine


def sample_report(**overrides) -> tuple[dict, dict]:
    """A validated report, and the per-token log-ratios behind its histogram ({label: tensor})."""
    comparisons, hists = [], {}
    for k, (profile, flip) in enumerate((("hf", 0.9), ("vllm", 0.08))):
        for backend in ("kernels", "inductor"):
            for j, reference in enumerate(("decode", "prefill")):
                train, engine, fp32 = _sides(100 * k + 10 * j + (backend == "inductor"), flip)
                comparisons.append(
                    {
                        "trainer_profile": profile,
                        "backend": backend,
                        "reference": reference,
                        "metrics": mismatch_metrics(train, engine, fp32),
                    }
                )
                if backend == "kernels":
                    hists[f"{profile} vs {reference}"] = log_ratios(train, engine)
    base, target = 0.0123, 0.0009
    values = {"rms_norm": 0.006, "qk_norm": 0.0101, "residual": 0.0119, "rope": 0.0123, "swiglu": 0.0098}
    vllm = get_profile("vllm")
    attribution = [
        {
            "trainer_profile": "hf",
            "engine_profile": "vllm",
            "backend": "kernels",
            "reference": "prefill",
            "metric": "mismatch/log_ratio_rms",
            "base": base,
            "target": target,
            "regions": [
                {
                    "region": region,
                    "trainer_rule": str(getattr(get_profile("hf"), region)),
                    "engine_rule": str(getattr(vllm, region)),
                    "value": value,
                    "share": region_share(base, value, target),
                }
                for region, value in values.items()
            ],
        }
    ]
    layers = [
        {"trainer_profile": p, "backend": "kernels", "layers": layer_agreement(*_hidden(7 + i, flip))}
        for i, (p, flip) in enumerate((("hf", 0.6), ("vllm", 0.05)))
    ]
    fields = {
        "model": {
            "path": "/models/tiny-qwen3",
            "model_type": "qwen3",
            "num_layers": 4,
            "vocab_size": 300,
            "parameters": 123456,
        },
        "engine": {
            "source": "roundalign.engine",
            "profile": vllm.to_dict(),
            "backends": ["kernels", "inductor"],
            "sampling": {"temperature": 1.0, "top_p": 1.0, "seed": 0},
            "jsonl": None,
        },
        "tokens": {
            "sequences": 8,
            "prompt_tokens": 256,
            "completion_tokens": 329,
            "mean_entropy_nats": 0.41,
            "log_vocab": math.log(300),
        },
        "comparisons": comparisons,
        "attribution": attribution,
        "layers": layers,
        "decode_shapes": {
            "backend": "kernels",
            "trainer_profile": "vllm",
            "variants": [
                {"prefill_shaped": [], "metrics": comparisons[4]["metrics"]},
                {"prefill_shaped": ["attention"], "metrics": comparisons[5]["metrics"]},
            ],
        },
        "notes": ["fp32 reference forward ran on the CPU", "engine hidden states were captured in prefill only"],
        "plots": {"log_ratio_hist": "log_ratio_hist.png"},
        "created": "2026-01-01T00:00:00+00:00",
    }
    fields.update(overrides)
    return build_report(**fields), hists


@pytest.fixture(scope="module")
def report():
    return sample_report()


# -----------------------------------------------------------------------------
# schema


def test_build_fills_header_and_validates(report):
    rep, _ = report
    assert rep["schema"] == SCHEMA == "roundalign.probe.report/2"
    assert rep["created"] == "2026-01-01T00:00:00+00:00"
    assert rep["torch_version"] == torch.__version__
    validate_report(rep)


def test_write_load_round_trip_is_exact(report, tmp_path):
    rep, _ = report
    path = write_report(rep, tmp_path / "out")
    assert path == tmp_path / "out" / "report.json"
    assert load_report(path) == rep
    assert load_report(tmp_path / "out") == rep  # the folder works too
    assert "NaN" not in path.read_text() and "Infinity" not in path.read_text()


def test_region_share():
    assert region_share(0.01, 0.004, 0.0) == (0.01 - 0.004) / 0.01
    assert region_share(2.0, 3.0, 1.0) == -1.0  # a region can widen the gap
    assert region_share(0.5, 0.1, 0.5) is None


def _broken(rep, mutate):
    bad = copy.deepcopy(rep)
    mutate(bad)
    return bad


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: r.update(schema="roundalign.probe.report/1"), "schema"),
        (lambda r: r.pop("tokens"), "missing field(s) ['tokens']"),
        (lambda r: r["model"].update(num_layers=-1), "model.num_layers"),
        (lambda r: r["model"].update(vocab_size=True), "model.vocab_size"),
        (lambda r: r["engine"].update(source="vllm"), "engine.source"),
        (lambda r: r["engine"].update(jsonl="dump.jsonl"), "engine.jsonl"),
        (lambda r: r.update(comparisons=[]), "comparisons: empty"),
        (lambda r: r["comparisons"][0].update(reference="sampled"), "comparisons[0].reference"),
        (lambda r: r["comparisons"][1]["metrics"].pop("rollout_corr/k3_kl"), "comparisons[1].metrics"),
        (lambda r: r["comparisons"][2]["metrics"].update({"rollout_corr/kl": float("nan")}), "not a finite"),
        (lambda r: r["comparisons"][2]["metrics"].update({"rollout_corr/kl": "0.1"}), "expected a number"),
        (lambda r: r["attribution"][0]["regions"][0].pop("share"), "attribution[0].regions[0]"),
        (lambda r: r["layers"][0]["layers"][1].update(equal_frac=1.5), "layers[0].layers[1].equal_frac"),
        (lambda r: r["layers"][1]["layers"][0].update(max_ulp=-0.5), "layers[1].layers[0].max_ulp"),
        (lambda r: r["layers"][1]["layers"][0].update(differ=0.5), "layers[1].layers[0].differ"),
        (lambda r: r["decode_shapes"]["variants"][1].update(prefill_shaped="attention"), "prefill_shaped"),
        (lambda r: r["notes"].append(3), "notes[2]"),
        (lambda r: r["plots"].update(hist="/tmp/x.png"), "plots.hist"),
    ],
)
def test_validate_rejects_malformed(report, mutate, message):
    rep, _ = report
    with pytest.raises(ValueError, match="malformed probe report") as err:
        validate_report(_broken(rep, mutate))
    assert message in str(err.value)


def test_optional_sections_may_be_empty():
    rep, _ = sample_report(attribution=[], layers=[], decode_shapes=None, notes=[], plots={})
    validate_report(rep)


def test_jsonl_source_needs_the_dump_path():
    engine = {"source": "jsonl", "profile": None, "backends": [], "sampling": None, "jsonl": "dump.jsonl"}
    rep, _ = sample_report(engine=engine)
    assert rep["engine"]["jsonl"] == "dump.jsonl"
    with pytest.raises(ValueError, match="engine.jsonl"):
        sample_report(engine=engine | {"jsonl": None})


def test_load_rejects_invalid_json(tmp_path):
    (tmp_path / "report.json").write_text('{"schema": NaN')
    with pytest.raises(ValueError, match="not valid JSON"):
        load_report(tmp_path)


def test_write_refuses_non_finite(report, tmp_path):
    rep, _ = report
    bad = _broken(rep, lambda r: r["tokens"].update(mean_entropy_nats=float("inf")))
    with pytest.raises(ValueError, match="tokens.mean_entropy_nats"):
        write_report(bad, tmp_path)
    assert not (tmp_path / "report.json").exists()


# -----------------------------------------------------------------------------
# terminal tables


def test_formatters():
    from roundalign.probe.table import fmt_num, fmt_pct, fmt_ratio

    assert fmt_num(0.0) == "0" and fmt_num(0) == "0" and fmt_num(None) == "n/a"
    assert fmt_num(1.2e-05) == "1.2e-05" and fmt_num(-3.456e-7) == "-3.5e-07"
    assert fmt_num(0.01234) == "0.0123" and fmt_num(12345.0) == "1.2e+04" and fmt_num(329) == "329"
    assert fmt_ratio(1.0) == "1" and fmt_ratio(1.00002) == "1+2.0e-05" and fmt_ratio(0.99969) == "1-3.1e-04"
    assert fmt_ratio(0.5) == "0.5" and fmt_ratio(1.0 - 2**-52) != "1"
    assert fmt_pct(1.0) == "100%" and fmt_pct(0.0) == "0%" and fmt_pct(0.12345) == "12.35%"
    assert fmt_pct(0.99999) == ">99.99%" and fmt_pct(1e-6) == "<0.01%"


def _render_text(rep, width=150) -> str:
    from rich.console import Console

    from roundalign.probe.table import render

    console = Console(record=True, width=width, file=io.StringIO())
    for renderable in render(rep):
        console.print(renderable)
    return console.export_text()


def test_render_shows_every_comparison_and_key_numbers(report):
    from roundalign.probe.table import fmt_num, fmt_pct, fmt_ratio

    rep, _ = report
    text = _render_text(rep)
    assert max(len(line) for line in text.splitlines()) <= 150
    lines = text.splitlines()
    for c in rep["comparisons"]:
        m = c["metrics"]
        # The label cell is two lines: the profile (on the numbers' line), then "backend reference".
        (row,) = [
            line
            for line, below in zip(lines, lines[1:], strict=False)
            if line.split()[:1] == [c["trainer_profile"]] and below.split() == [c["backend"], c["reference"]]
        ]
        # Each headline number sits whole on its row: no column was squeezed into folding it.
        for needle in (
            fmt_pct(m["mismatch/bitwise_equal_frac"]),
            fmt_num(m["rollout_corr/k3_kl"]),
            fmt_num(m["training/rollout_probs_diff_max"]),
            fmt_num(m["mismatch/log_ratio_rms"]),
            fmt_ratio(m["mismatch/is_token_raw_min"]),
            fmt_ratio(m["mismatch/error_corr_rho"]),
        ):
            assert needle in row.split(), (needle, row)
    for r in rep["attribution"][0]["regions"]:
        assert f"{100 * r['share']:.0f}%" in text and r["region"] in text
    for entry in rep["layers"]:
        for row in entry["layers"]:
            assert fmt_pct(row["equal_frac"]) in text
    assert "rollout_corr" in text and "fp32 reference forward ran on the CPU" in text
    assert "Decode shapes" in text and "none (all decode-shaped)" in text


def test_render_without_optional_sections():
    rep, _ = sample_report(attribution=[], layers=[], decode_shapes=None, notes=[])
    text = _render_text(rep)
    assert "Attribution" not in text and "Per-layer" not in text and "notes" not in text
    assert "k3_kl" in text


# -----------------------------------------------------------------------------
# plots: files are written, are PNGs of a sensible size, and are not blank


def _check_png(path, min_px=(600, 300)):
    import matplotlib.image as mpimg

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000
    img = mpimg.imread(path)
    height, width = img.shape[:2]
    assert width >= min_px[0] and height >= min_px[1]
    assert width <= 2000 and height <= 4000
    assert float(img[..., :3].std()) > 0.05  # not a blank canvas


def test_plot_log_ratio_hist(report, tmp_path):
    from roundalign.probe.plots import plot_log_ratio_hist

    _, hists = report
    path = plot_log_ratio_hist(hists, tmp_path / "log_ratio_hist.png")
    _check_png(path, min_px=(700, 800))


def test_plot_log_ratio_hist_all_zero(tmp_path):
    from roundalign.probe.plots import plot_log_ratio_hist

    path = plot_log_ratio_hist({"vllm vs prefill": torch.zeros(500)}, tmp_path / "zeros.png")
    _check_png(path)


def test_plot_log_ratio_hist_rejects_bad_input(tmp_path):
    from roundalign.probe.plots import plot_log_ratio_hist

    with pytest.raises(ValueError, match="no log-ratios"):
        plot_log_ratio_hist({}, tmp_path / "x.png")
    with pytest.raises(ValueError, match="finite"):
        plot_log_ratio_hist({"a": torch.tensor([0.0, float("nan")])}, tmp_path / "x.png")


def test_plot_layer_agreement_and_attribution(report, tmp_path):
    from roundalign.probe.plots import plot_attribution, plot_layer_agreement

    rep, _ = report
    _check_png(plot_layer_agreement(rep, tmp_path / "layers.png"))
    _check_png(plot_attribution(rep, tmp_path / "attribution.png"), min_px=(600, 150))


def test_plots_refuse_missing_sections(tmp_path):
    from roundalign.probe.plots import plot_attribution, plot_layer_agreement

    rep, _ = sample_report(attribution=[], layers=[])
    with pytest.raises(ValueError, match="no per-layer data"):
        plot_layer_agreement(rep, tmp_path / "l.png")
    with pytest.raises(ValueError, match="no attribution"):
        plot_attribution(rep, tmp_path / "a.png")


def test_core_imports_need_neither_rich_nor_matplotlib():
    # rich and matplotlib are the [cli] extra: importing the probe's modules must not pull them in.
    code = (
        "import sys, roundalign.probe, roundalign.probe.table, roundalign.probe.plots; "
        "print(sorted(m for m in ('rich', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_report_json_is_plain_json(report, tmp_path):
    rep, _ = report
    text = write_report(rep, tmp_path).read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
