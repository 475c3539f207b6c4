"""Terminal view of a probe report: rich tables that stay readable at any console width.

``render(report)`` returns renderables to print in order: a one-paragraph summary (model, engine, token counts),
the main table (one row per trainer profile x backend x reference, the headline metrics under short headers that
map to the dashboard names in the caption), the decode-shape variants, one attribution table per trainer and engine
profile, the per-layer agreement table, and the notes. rich is the optional ``[cli]`` extra, so it is imported
inside the functions.

Width: a table is laid out when it is printed, for the width the console gives it then (``__rich_console__`` reads
``options.max_width``), so the same ``render`` output suits a wide terminal, an 80-column one and a pipe. Each
table tries its layouts from the widest down and prints the first whose natural width fits: every column in one
table; the value columns split over several tables that repeat the row labels; for the main table, metrics as rows
and comparisons as columns, a block per trainer profile where that is what fits; and, narrower than all of these,
one "header: value" line per cell. No layout squeezes a column below its content, which rich would otherwise do
with an ellipsis: a number is never cut and a row never loses its label.

Numbers are formatted so that the eye can trust them: ``0`` and ``1`` appear only when exact; a ratio or a
correlation within 1% of 1 is written as its distance from 1 (``1-3.1e-04``), since three significant digits
would print ``1`` for a ratio that is not; percentages never round to 100% or 0% when they are not.
"""

from __future__ import annotations

NA = "n/a"


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


MAIN_TITLE = "Trainer vs engine reference, per completion token"
# Wider than any console, to measure a table's natural width (every column at its content's width).
_UNBOUNDED = 100_000


def _split(items: list, k: int) -> list[list]:
    """``items`` in ``k`` consecutive runs whose lengths differ by at most one."""
    q, r = divmod(len(items), k)
    out, start = [], 0
    for j in range(k):
        out.append(items[start : start + q + (j < r)])
        start += q + (j < r)
    return out


def _label(lines):
    """A row label: its first line bold when more lines follow, the rest dim."""
    from rich.text import Text

    text = Text(lines[0], style="bold" if len(lines) > 1 else "")
    for line in lines[1:]:
        text.append(f"\n{line}", style="dim")
    return text


def _new_table(title: str | None, caption: str | None):
    from rich import box
    from rich.table import Table

    return Table(
        title=title,
        caption=caption,
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        pad_edge=False,
        collapse_padding=True,
    )


class _Grid:
    """A table's content apart from its layout, laid out at print time for the console's width (module docstring).

    ``rows`` are (label lines, formatted cells); ``headers`` name the value columns. ``unit`` value columns stay
    together when the columns are split over several tables (an attribution entry's switch and alone).
    ``label_columns`` names one column per label line for the widest layout, which otherwise stacks the lines in one
    column. ``max_parts`` column groups are tried before the grid is transposed (metrics as rows); None never
    transposes. ``sections`` are the rows a rule goes under (each trainer profile's last).
    """

    def __init__(self, title, caption, corner, headers, rows, *, unit=1, label_columns=None, max_parts=None,
                 sections=()):  # fmt: skip
        self.title, self.caption, self.corner, self.headers, self.rows = title, caption, corner, list(headers), rows
        self.unit, self.label_columns, self.max_parts, self.sections = unit, label_columns, max_parts, set(sections)

    def __rich_console__(self, console, options):
        from rich.measure import Measurement

        wide = options.update_width(_UNBOUNDED)
        for tables in self._layouts():
            if all(Measurement.get(console, wide, t).maximum <= options.max_width for t in tables):
                yield from tables
                return
        yield self._listing()

    def _layouts(self):
        """Candidate layouts, widest first; each a list of tables printed one after another."""
        n = len(self.headers)
        if self.label_columns is not None:
            yield [self._table(list(range(n)), True, True, split_labels=True)]
        units = [list(range(i, min(i + self.unit, n))) for i in range(0, n, self.unit)]
        parts = len(units) if self.max_parts is None else min(self.max_parts, len(units))
        for k in range(1, parts + 1):
            groups = [sum(run, []) for run in _split(units, k)]
            yield [self._table(cols, i == 0, i == k - 1) for i, cols in enumerate(groups)]
        if self.max_parts is None:
            return
        seen = set()
        for m in range(len(self.rows), 0, -1):
            chunks = self._chunks(m)
            if (key := str(chunks)) not in seen:
                seen.add(key)
                yield [self._transposed(ch, i == 0, i == len(chunks) - 1) for i, ch in enumerate(chunks)]

    def _table(self, cols: list[int], first: bool, last: bool, split_labels: bool = False):
        table = _new_table(self.title if first else None, self.caption if last else None)
        for header in self.label_columns if split_labels else [self.corner]:
            table.add_column(header, no_wrap=True)
        for j in cols:
            table.add_column(self.headers[j], justify="right", no_wrap=True)
        for i, (label, cells) in enumerate(self.rows):
            labels = list(label) if split_labels else [_label(label)]
            table.add_row(*labels, *[cells[j] for j in cols], end_section=i in self.sections)
        return table

    def _chunks(self, m: int) -> list[list[int]]:
        """Row indices in runs of at most ``m``, cut at section ends first: a block per trainer profile if one fits."""
        sections, start = [], 0
        for i in range(len(self.rows)):
            if i in self.sections or i == len(self.rows) - 1:
                sections.append(list(range(start, i + 1)))
                start = i + 1
        chunks: list[list[int]] = []
        for section in sections:
            for piece in _split(section, -(-len(section) // m)):
                if chunks and len(chunks[-1]) + len(piece) <= m:
                    chunks[-1] += piece
                else:
                    chunks.append(piece)
        return chunks

    def _transposed(self, rows: list[int], first: bool, last: bool):
        table = _new_table(self.title if first else None, self.caption if last else None)
        table.add_column("\n".join(self.corner.split()), no_wrap=True)
        for i in rows:
            table.add_column(_label([w for line in self.rows[i][0] for w in line.split()]), justify="right",
                             no_wrap=True)  # fmt: skip
        for j, header in enumerate(self.headers):
            table.add_row(" ".join(header.split()), *[self.rows[i][1][j] for i in rows])
        return table

    def _listing(self):
        """Narrower than every table: one "header: value" line per cell, which wraps only between words."""
        from rich.text import Text

        text = Text()
        if self.title:
            text.append(f"{self.title}\n", style="bold")
        for label, cells in self.rows:
            text.append(" · ".join(label) + "\n", style="bold")
            for header, cell in zip(self.headers, cells, strict=True):
                text.append(f"  {' '.join(header.split())}: {cell}\n")
        if self.caption:
            text.append(self.caption)
        return text


def _main_grid(report: dict) -> _Grid:
    comparisons = report["comparisons"]
    rows = [
        (
            (c["trainer_profile"], f"{c['backend']} {c['reference']}"),
            [fmt(c["metrics"].get(key)) for _, key, fmt in MAIN_COLUMNS],
        )
        for c in comparisons
    ]
    # A rule under each trainer profile's last row groups its backends and references.
    ends = [
        i
        for i, c in enumerate(comparisons)
        if i + 1 == len(comparisons) or comparisons[i + 1]["trainer_profile"] != c["trainer_profile"]
    ]
    headers = [h for h, _, _ in MAIN_COLUMNS]
    # Two column groups still read as the wide table; narrower, metrics as rows read better than three or more.
    return _Grid(MAIN_TITLE, MAIN_CAPTION, "trainer\nbackend ref", headers, rows, max_parts=2, sections=ends)


def _decode_shapes_grid(report: dict) -> _Grid:
    shapes = report["decode_shapes"]
    columns = [c for c in MAIN_COLUMNS if c[1] in DECODE_SHAPE_KEYS]
    rows = [
        (
            (", ".join(v["prefill_shaped"]) or "none (all decode-shaped)",),
            [fmt(v["metrics"].get(k)) for _, k, fmt in columns],
        )
        for v in shapes["variants"]
    ]
    return _Grid(
        f"Decode shapes: trainer {shapes['trainer_profile']} vs decode log-probs ({shapes['backend']})",
        "Each row replaces the listed regions' decode-shaped engine kernels by prefill-shaped ones.",
        "prefill-shaped regions",
        [h for h, _, _ in columns],
        rows,
    )


def _attribution_grids(report: dict) -> list[_Grid]:
    """One grid per (trainer profile, engine profile): a row per region, switch and alone per backend/reference."""
    from roundalign.numerics.attribution import entry_share_undefined

    groups: dict[tuple[str, str], list[dict]] = {}
    for entry in report["attribution"]:
        groups.setdefault((entry["trainer_profile"], entry["engine_profile"]), []).append(entry)
    grids = []
    for (trainer, engine), entries in groups.items():
        undefined = [entry_share_undefined(e) for e in entries]
        headers = [f"{e['backend']}\n{e['reference']}\n{kind}" for e in entries for kind in ("switch", "alone")]
        rows = []
        for i, r in enumerate(entries[0]["regions"]):
            cells = []
            for e, why in zip(entries, undefined, strict=True):
                row = e["regions"][i]
                # With no gap to close, a share of it is not small or large but meaningless: say why instead.
                cells.append(f"{NA} ({why})" if why else _pct0(row["share"]))
                cells.append(_pct0(row.get("alone_share")))
            rows.append(((r["region"], r["trainer_rule"], r["engine_rule"]), cells))
        ranges = "; ".join(
            f"{e['backend']} {e['reference']}: {fmt_num(e['base'])} → {fmt_num(e['target'])}" for e in entries
        )
        caption = (
            f"base → target ({ranges}). switch: share of the gap closed by switching only that region to the "
            "engine's rule, (base − value) / (base − target); n/a where the engine profile does not bring the "
            "metric meaningfully closer than the trainer's, so there is no gap to share. alone: mismatch left when "
            "only that region keeps the trainer's rule, as a share of base. Regions interact, so neither column "
            "adds up to 100%."
        )
        grids.append(
            _Grid(
                f"Which region: {entries[0]['metric']}, trainer {trainer} → engine {engine}",
                caption,
                "region\ntrainer rule\nengine rule",
                headers,
                rows,
                unit=2,
                label_columns=("region", "trainer rule", "engine rule"),
            )
        )
    return grids


def _pct0(x: float | None) -> str:
    return NA if x is None else f"{100 * x:.0f}%"


def _layers_grid(report: dict) -> _Grid:
    entries = report["layers"]
    headers = []
    for e in entries:
        label = f"{e['trainer_profile']} ({e['backend']})"
        headers += [f"{label}\nequal", f"{label}\ndiffer", f"{label}\nmax ulp"]
    by_layer: dict[int, list[str]] = {}
    for k, e in enumerate(entries):
        for row in e["layers"]:
            cells = by_layer.setdefault(row["layer"], ["", "", ""] * len(entries))
            cells[3 * k] = fmt_pct(row["equal_frac"])
            cells[3 * k + 1] = str(row["differ"])
            cells[3 * k + 2] = fmt_ulps(row["max_ulp"])
    return _Grid(
        "Per-layer agreement of prefill hidden states (after each decoder layer)",
        "equal: elements with identical bf16 bits; differ: how many elements differ; max ulp: the largest "
        "difference in units in the last place of the larger of the two values (a sign flip near zero counts its "
        "size, not the numbers between).",
        "layer",
        headers,
        [((str(layer),), by_layer[layer]) for layer in sorted(by_layer)],
        unit=3,
    )


def fmt_ulps(x: float) -> str:
    """An ulp distance: whole numbers as integers, fractions (across a binade) to two significant digits."""
    return "inf" if x == float("inf") else str(int(x)) if x == int(x) else f"{x:.2g}"


def _notes(report: dict):
    from rich.text import Text

    text = Text()
    text.append("notes\n", style="bold")
    for note in report["notes"]:
        text.append(f"  - {note}\n")
    return text


def render(report: dict) -> list:
    """The report as rich renderables, to print one after another (``for r in render(rep): console.print(r)``)."""
    out = [_summary(report), _main_grid(report)]
    if report["decode_shapes"]:
        out.append(_decode_shapes_grid(report))
    out += _attribution_grids(report)
    if report["layers"]:
        out.append(_layers_grid(report))
    if report["notes"]:
        out.append(_notes(report))
    return out
