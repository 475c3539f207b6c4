"""Terminal view of a probe report: rich tables that fit about 150 columns.

``render(report)`` returns renderables to print in order: a one-paragraph summary (model, engine, token counts),
the main table (one row per trainer profile x backend x reference, the headline metrics under short headers that
map to the dashboard names in the caption), the decode-shape variants, one attribution table per attribution
entry, the per-layer agreement table, and the notes. rich is the optional ``[cli]`` extra, so it is imported
inside the functions.

Numbers are formatted so that the eye can trust them: ``0`` and ``1`` appear only when exact; a ratio or a
correlation within 1% of 1 is written as its distance from 1 (``1-3.1e-04``), since three significant digits
would print ``1`` for a ratio that is not; percentages never round to 100% or 0% when they are not.
"""

from __future__ import annotations

NA = "n/a"
WIDTH = 150


def fmt_num(x: float | int | None) -> str:
    """Compact: ints as is, exact zero as ``0``, 3 significant digits in [1e-3, 1e4), else ``1.2e-05``."""
    if x is None:
        return NA
    if isinstance(x, int):
        return str(x)
    if x == 0:
        return "0"
    return f"{x:.3g}" if 1e-3 <= abs(x) < 1e4 else f"{x:.2g}"


def fmt_ratio(x: float | None) -> str:
    """For quantities whose ideal is 1 (importance ratios, correlations): ``1`` only when exact."""
    if x is None:
        return NA
    if x == 1:
        return "1"
    if abs(x - 1) < 1e-2:
        return f"1{x - 1:+.1e}"
    return fmt_num(x)


def fmt_pct(frac: float | None) -> str:
    """A fraction as a percentage; ``100%`` and ``0%`` only when exact."""
    if frac is None:
        return NA
    if frac == 1:
        return "100%"
    if frac == 0:
        return "0%"
    pct = 100 * frac
    if pct >= 99.995:
        return ">99.99%"
    if pct < 0.005:
        return "<0.01%"
    return f"{pct:.2f}%"


# (header, metric key, formatter) of the main table, in column order. Headers stay short; the caption maps them.
MAIN_COLUMNS = (
    ("bitwise\nequal", "mismatch/bitwise_equal_frac", fmt_pct),
    ("k3_kl", "rollout_corr/k3_kl", fmt_num),
    ("kl", "rollout_corr/kl", fmt_num),
    ("chi2\ntoken", "rollout_corr/chi2_token", fmt_num),
    ("log ppl\nabs diff", "rollout_corr/log_ppl_abs_diff", fmt_num),
    ("p diff\nmean", "training/rollout_probs_diff_mean", fmt_num),
    ("p diff\nmax", "training/rollout_probs_diff_max", fmt_num),
    ("logp\ndiff max", "sampling/sampling_logp_difference/max", fmt_num),
    ("RMS δ\nnats", "mismatch/log_ratio_rms", fmt_num),
    ("tok IS\nmin", "mismatch/is_token_raw_min", fmt_ratio),
    ("tok IS\nmax", "mismatch/is_token_raw_max", fmt_ratio),
    ("tok IS\nout", "mismatch/is_token_raw_frac_outside", fmt_pct),
    ("seq IS\nout", "mismatch/is_seq_raw_frac_outside", fmt_pct),
    ("ρ err", "mismatch/error_corr_rho", fmt_ratio),
)

# The decode-shape variants show a few of the main columns.
DECODE_SHAPE_KEYS = (
    "mismatch/bitwise_equal_frac",
    "rollout_corr/k3_kl",
    "sampling/sampling_logp_difference/max",
    "mismatch/log_ratio_rms",
)

MAIN_CAPTION = (
    "δ = logp_train − logp_rollout per token. k3_kl, kl, chi2 token, log ppl abs diff: verl rollout_corr/*; "
    "p diff: verl training/rollout_probs_diff_* (|p_train − p_rollout|, probability space); logp diff max: TRL "
    "sampling/sampling_logp_difference/max; IS: raw importance ratios exp(δ) per token and exp(Σδ) per sequence, "
    "never truncated, 'out' = outside [0.5, 2]; ρ err: correlation of the two sides' errors against an fp32 "
    "forward (1 = they round alike). Definitions: docs/probe-report.md."
)


def _summary(report: dict):
    from rich.text import Text

    model, engine, tokens = report["model"], report["engine"], report["tokens"]
    profile = engine["profile"]["name"] if engine["profile"] else "unknown profile"
    source = f"JSONL dump {engine['jsonl']}" if engine["source"] == "jsonl" else engine["source"]
    text = Text()
    text.append("model ", style="bold")
    text.append(f"{model['path']} ({model['model_type']}, {model['num_layers']} layers, vocab {model['vocab_size']}, ")
    text.append(f"{model['parameters']:,} parameters)\n")
    text.append("engine ", style="bold")
    text.append(f"{profile} via {source}; backends {', '.join(engine['backends']) or NA}")
    if engine["sampling"]:
        text.append("; sampling " + ", ".join(f"{k}={v}" for k, v in engine["sampling"].items()))
    text.append("\ntokens ", style="bold")
    text.append(
        f"{tokens['sequences']} sequences, {tokens['prompt_tokens']:,} prompt + "
        f"{tokens['completion_tokens']:,} completion tokens"
    )
    if tokens.get("mean_entropy_nats") is not None:
        text.append(f"; mean entropy {fmt_num(tokens['mean_entropy_nats'])} nats")
        if tokens.get("log_vocab") is not None:
            text.append(f" (uniform: log V = {fmt_num(tokens['log_vocab'])})")
    return text


def _main_table(report: dict):
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(
        title="Trainer vs engine reference, per completion token",
        caption=MAIN_CAPTION,
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        pad_edge=False,
        collapse_padding=True,
    )
    # One label column on two lines (profile, then backend and reference) keeps 14 metric columns in 150.
    table.add_column("trainer\nbackend ref", overflow="fold", min_width=16, max_width=20)
    for header, _, _ in MAIN_COLUMNS:
        table.add_column(header, justify="right", no_wrap=True)
    comparisons = report["comparisons"]
    for i, c in enumerate(comparisons):
        m = c["metrics"]
        label = Text(c["trainer_profile"], style="bold")
        label.append(f"\n{c['backend']} {c['reference']}", style="dim")
        # A rule under each trainer profile's last row groups its backends and references.
        last = i + 1 == len(comparisons) or comparisons[i + 1]["trainer_profile"] != c["trainer_profile"]
        table.add_row(label, *[fmt(m.get(key)) for _, key, fmt in MAIN_COLUMNS], end_section=last)
    return table


def _decode_shapes_table(report: dict):
    from rich import box
    from rich.table import Table

    shapes = report["decode_shapes"]
    table = Table(
        title=f"Decode shapes: trainer {shapes['trainer_profile']} vs decode log-probs ({shapes['backend']})",
        caption="Each row replaces the listed regions' decode-shaped engine kernels by prefill-shaped ones.",
        caption_justify="left",
        box=box.SIMPLE_HEAD,
    )
    table.add_column("prefill-shaped regions", overflow="fold")
    columns = [c for c in MAIN_COLUMNS if c[1] in DECODE_SHAPE_KEYS]
    for header, _, _ in columns:
        table.add_column(header, justify="right", no_wrap=True)
    for v in shapes["variants"]:
        cells = [fmt(v["metrics"].get(key)) for _, key, fmt in columns]
        table.add_row(", ".join(v["prefill_shaped"]) or "none (all decode-shaped)", *cells)
    return table


def _attribution_tables(report: dict) -> list:
    """One table per (trainer profile, engine profile): a row per region, a share column per backend/reference."""
    from rich import box
    from rich.table import Table

    groups: dict[tuple[str, str], list[dict]] = {}
    for entry in report["attribution"]:
        groups.setdefault((entry["trainer_profile"], entry["engine_profile"]), []).append(entry)
    tables = []
    for (trainer, engine), entries in groups.items():
        metric = entries[0]["metric"]
        ranges = "; ".join(
            f"{e['backend']} {e['reference']}: {fmt_num(e['base'])} → {fmt_num(e['target'])}" for e in entries
        )
        table = Table(
            title=f"Which region: {metric}, trainer {trainer} → engine {engine}",
            caption=(
                f"base → target ({ranges}). switch: share of the gap closed by switching only that region to the "
                "engine's rule, (base − value) / (base − target). alone: mismatch left when only that region keeps "
                "the trainer's rule, as a share of base. Regions interact, so neither column adds up to 100%."
            ),
            caption_justify="left",
            box=box.SIMPLE_HEAD,
        )
        table.add_column("region")
        table.add_column("trainer rule", overflow="fold", max_width=24)
        table.add_column("engine rule", overflow="fold", max_width=24)
        for e in entries:
            for kind in ("switch", "alone"):
                table.add_column(f"{e['backend']}\n{e['reference']}\n{kind}", justify="right", no_wrap=True)
        for i, r in enumerate(entries[0]["regions"]):
            cells = []
            for e in entries:
                row = e["regions"][i]
                for x in (row["share"], row.get("alone_share")):
                    cells.append(NA if x is None else f"{100 * x:.0f}%")
            table.add_row(r["region"], r["trainer_rule"], r["engine_rule"], *cells)
        tables.append(table)
    return tables


def _layers_table(report: dict):
    from rich import box
    from rich.table import Table

    entries = report["layers"]
    table = Table(
        title="Per-layer agreement of prefill hidden states (after each decoder layer)",
        caption="equal: elements with identical bf16 bits; max ulp: largest distance in bf16 units in the last place.",
        caption_justify="left",
        box=box.SIMPLE_HEAD,
    )
    table.add_column("layer", justify="right")
    for e in entries:
        label = f"{e['trainer_profile']} ({e['backend']})"
        table.add_column(f"{label}\nequal", justify="right", no_wrap=True)
        table.add_column(f"{label}\nmax ulp", justify="right", no_wrap=True)
    by_layer: dict[int, list[str]] = {}
    for k, e in enumerate(entries):
        for row in e["layers"]:
            cells = by_layer.setdefault(row["layer"], ["", ""] * len(entries))
            cells[2 * k] = fmt_pct(row["equal_frac"])
            cells[2 * k + 1] = str(row["max_ulp"])
    for layer in sorted(by_layer):
        table.add_row(str(layer), *by_layer[layer])
    return table


def _notes(report: dict):
    from rich.text import Text

    text = Text()
    text.append("notes\n", style="bold")
    for note in report["notes"]:
        text.append(f"  - {note}\n")
    return text


def render(report: dict) -> list:
    """The report as rich renderables, to print one after another (``for r in render(rep): console.print(r)``)."""
    out = [_summary(report), _main_table(report)]
    if report["decode_shapes"]:
        out.append(_decode_shapes_table(report))
    out += _attribution_tables(report)
    if report["layers"]:
        out.append(_layers_table(report))
    if report["notes"]:
        out.append(_notes(report))
    return out
