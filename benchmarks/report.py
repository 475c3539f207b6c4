"""Fill docs/benchmarks.md from the two suites' JSON, with every ratio next to its target and misses marked.

    .venv/bin/python benchmarks/report.py --ops ops.json --model model.json --out docs/benchmarks.md
    .venv/bin/python benchmarks/report.py --exact exact.json --compile-time compile.json


Reads ``{"suite": "ops"|"model", "machine": {...}, "results": [row, ...]}`` (benchmarks/ops.py,
benchmarks/model_step.py), replaces the text between ``<!-- bench:ops -->`` / ``<!-- /bench:ops -->`` and
``<!-- bench:model -->`` / ``<!-- /bench:model -->`` in ``--out``, and keeps the raw JSON beside the page
(docs/benchmarks/ops.json and model.json for docs/benchmarks.md). Either suite may be left out; its table stays.

Targets (issues 6 and 18): time at most 1.05x stock in eager mode (1.10x for the whole tiny-qwen3, whose 256-wide
ops are mostly call overhead); compiled, the aligned model no slower than compiled stock (1.00x); saved-for-backward
and peak memory at most 1.00x stock; the exact trainer (vLLM's kernels, benchmarks/exact_step.py, ``--exact``) at
most 1.2x. ``--compile-time`` (benchmarks/compile_time.py) fills the first-use compile time, cold and warm; ``--sync``
(benchmarks/sync_export.py) Fair Cast's export against the RNE cast of the same state dict, at most 1.5x; ``--quant``
(benchmarks/quant_cost.py) a quantized engine's trainers and exports, without targets; ``--osol``
(benchmarks/osol_cost.py) what OSOL adds to a training step, against GRPO's step on the same batch, at most 1.15x.
The targets are the default ``apply``'s: the opt-out variant (``aligned+eager_ops``, ``compile_ops=False``) is
shown beside it without one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TIME_TARGET = {"eager": 1.05, "compiled": 1.00}
MODEL_TIME_TARGET = {("tiny-qwen3", "eager"): 1.10}  # issue 18: a whole model's step where it differs from the above
# Variants shown for comparison without a target, and why.
UNTARGETED_VARIANTS = {"aligned+eager_ops": "opt-out, no target"}
MEMORY_TARGET = 1.00
EXACT_TARGET = {"rounding": 1.05, "exact": 1.20}
# Passes reported without a target, and why: a recompute pass's first micro-batch also pays the exact trainer's
# once-per-weight-change preparation of vLLM's GEMM weights, spread over the pass's many micro-batches.
UNTARGETED_PASSES = {"first recompute": "once per weight change, no target"}
SYNC_TARGET = 1.5  # stochastic and error-feedback export, x the RNE cast of the same state dict (issue 18)
OSOL_TARGET = 1.15  # what OSOL adds to a training step (its phase), x GRPO's step on the same batch
REQUIRED = ("name", "variant", "mode", "pass", "shape", "time_ms", "time_ratio", "saved_ratio", "peak_ratio")


def load(path: str | Path, suite: str) -> dict:
    """Read one suite's JSON and check what the tables need, naming what is wrong."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or data.get("suite") != suite:
        got = data.get("suite") if isinstance(data, dict) else type(data).__name__
        raise ValueError(
            f"{path}: expected a {suite!r} suite JSON (key 'suite'), got {got!r}; pass benchmarks/"
            f"{'ops' if suite == 'ops' else 'model_step'}.py --json output as --{suite}"
        )
    for i, row in enumerate(data.get("results", [])):
        missing = [k for k in REQUIRED if k not in row]
        if missing:
            raise ValueError(f"{path}: results[{i}] lacks {', '.join(missing)}; rerun the suite to regenerate it")
        if row["mode"] not in TIME_TARGET:
            raise ValueError(f"{path}: results[{i}] has mode {row['mode']!r}; expected eager or compiled")
    if not data.get("results"):
        raise ValueError(f"{path}: no results; was the suite run with a mode or case filter that matched nothing?")
    return data


def _ratio(
    ratio: float | None, target: float, is_stock: bool, band: list[float] | None = None, untargeted: str | None = None
) -> tuple[str, bool]:
    """A table cell 'ratio [band] (<= target)', and whether it misses. With a noise ``band`` (the quartiles of the
    per-round ratios) a ratio whose band reaches down to the target is a tie, not a miss. ``untargeted``: the cell
    says this instead of the target, and never misses."""
    if ratio is None:
        return "-", False
    if is_stock:
        return f"{ratio:.3f} (ref)", False
    spread = f" [{band[0]:.2f}-{band[1]:.2f}]" if band else ""
    if untargeted:
        return f"{ratio:.3f}{spread} ({untargeted})", False
    miss = ratio > target and not (band and band[0] <= target)
    tie = ratio > target and not miss
    text = f"{ratio:.3f}"
    if ratio > target and float(text) <= target:  # a miss that three decimals would round away
        text = f"{ratio:.5f}"
    return f"{text}{spread} (≤ {target:.2f})" + (" **miss**" if miss else " tie" if tie else ""), miss


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def machine_line(machine: dict) -> str:
    m = machine
    return (f"Machine: {m.get('cpu', '?')}, {m.get('logical_cpus', '?')} logical CPUs, {m.get('torch_threads', '?')} "
            f"torch threads, torch {m.get('torch', '?')}, {m.get('date', '?')}.")  # fmt: skip


def table(rows: list[dict]) -> tuple[list[str], int, int]:
    """Markdown lines for ``rows``, the number of misses and of ratios checked against a target."""
    with_model = any("model" in r for r in rows)
    head = (["model"] if with_model else []) + [
        "shape", "pass", "mode", "variant", "time ms", "time × stock", "saved MiB", "saved × stock", "peak MiB",
        "peak × stock", "compile s",
    ]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    misses = checked = 0
    for r in rows:
        stock = r["variant"] == "stock"
        untargeted = UNTARGETED_VARIANTS.get(r["variant"])
        cells = []
        time_target = TIME_TARGET[r["mode"]]
        if "model" not in r:  # the model suite's rows (an op row names its op, and its model in "model")
            time_target = MODEL_TIME_TARGET.get((r["name"], r["mode"]), time_target)
        checks = ((r["time_ratio"], time_target, r.get("time_band")),
                  (r["saved_ratio"], MEMORY_TARGET, None), (r["peak_ratio"], MEMORY_TARGET, None))  # fmt: skip
        for ratio, target, spread in checks:
            text, miss = _ratio(ratio, target, stock, spread, untargeted)
            cells.append(text)
            misses += miss
            checked += ratio is not None and not stock and not untargeted
        compile_s = r.get("compile_s")
        row = ([str(r.get("model", ""))] if with_model else []) + [
            r["shape"], r["pass"], r["mode"], r["variant"], f"{r['time_ms']:.4g}", cells[0],
            _mib(r.get("saved_bytes")), cells[1], _mib(r.get("peak_bytes")), cells[2],
            "-" if compile_s is None else f"{compile_s:.1f}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    return lines, misses, checked


def section(data: dict) -> str:
    """The generated block for one suite: machine line, a table per name (op or model), a miss count."""
    rows = data["results"]
    names = list(dict.fromkeys(r["name"] for r in rows))  # first-seen order, as the suite ran them
    out = [machine_line(data.get("machine", {})), ""]
    total_misses = total_checked = 0
    for name in names:
        lines, misses, checked = table([r for r in rows if r["name"] == name])
        total_misses += misses
        total_checked += checked
        out += [f"#### {name}", "", *lines, ""]
    out.append(f"Targets missed: {total_misses} of {total_checked} ratios checked.")
    return "\n".join(out)


def exact_section(data: dict) -> str:
    """The exact trainer's block (benchmarks/exact_step.py): time per pass and peak, against their targets."""
    head = ["model", "shape", "pass", "variant", "profile", "time ms", "time × stock", "peak MiB", "peak × stock"]
    lines = [machine_line(data.get("machine", {})), "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    misses = checked = 0
    for r in data["results"]:
        stock = r["variant"] == "stock"
        band = r.get("time_band")
        untargeted = None if stock else UNTARGETED_PASSES.get(r["pass"])
        time_cell, miss = _ratio(r["time_ratio"], EXACT_TARGET.get(r["variant"], 1.0), stock, band, untargeted)
        peak_cell, peak_miss = _ratio(r.get("peak_ratio"), MEMORY_TARGET, stock)
        misses += miss + peak_miss
        checked += (not stock and r["pass"] not in UNTARGETED_PASSES) + (not stock and r.get("peak_ratio") is not None)
        lines.append("| " + " | ".join([
            r["name"], r["shape"], r["pass"], r["variant"], r.get("profile", ""), f"{r['time_ms']:.4g}", time_cell,
            _mib(r.get("peak_bytes")), peak_cell]) + " |")  # fmt: skip
    lines += ["", f"Targets missed: {misses} of {checked} ratios checked."]
    return "\n".join(lines)


def compile_section(data: dict) -> str:
    """The first-use compile time block (benchmarks/compile_time.py)."""
    lines = [machine_line(data.get("machine", {})), "",
             f"{data['model']}, profile `{data['profile']}`: the first training step's extra time (first step less "
             "the second), in fresh processes sharing one Inductor cache folder.", "",
             "| cache | first-use s | first step s | second step s | stock HF second step s |",
             "|---|---|---|---|---|"]  # fmt: skip
    for name in ("cold", "warm"):
        r = data[name]
        lines.append(f"| {name} | {r['first_use_s']:.1f} | {r['first_s']:.1f} | {r['second_s']:.2f} | "
                     f"{r['stock_second_s']:.2f} |")  # fmt: skip
    return "\n".join(lines)


def sync_section(data: dict) -> str:
    """Fair Cast's export block (benchmarks/sync_export.py): each mode against the RNE cast in the same run, per
    tensor set, dtype, page state and thread count, with the bytes a second each mode moved."""
    head = ["tensor set", "dtype", "pages", "threads", "RNE s", "RNE GB/s", "stochastic × RNE", "error-feedback × RNE",
            "error-feedback GB/s"]  # fmt: skip
    lines = [machine_line(data.get("machine", {})), "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    misses = checked = 0
    for r in data["results"].values():
        cells = []
        for mode in ("stochastic", "error-feedback"):
            cell, miss = _ratio(r["ratio"][mode], SYNC_TARGET, False, r["band"][mode])
            cells.append(cell)
            misses, checked = misses + miss, checked + 1
        lines.append("| " + " | ".join([
            f"{r['set']} ({r['parameters'] / 1e6:.1f}M)", r["dtype"], r["pages"], str(r["threads"]),
            f"{r['median_s']['rne']:.4f}", f"{r['gb_per_s']['rne']:.1f}", *cells,
            f"{r['gb_per_s']['error-feedback']:.1f}"]) + " |")  # fmt: skip
    lines += ["", f"Targets missed: {misses} of {checked} ratios checked."]
    return "\n".join(lines)


def quant_section(data: dict) -> str:
    """A quantized engine's cost (benchmarks/quant_cost.py): the quantization-aligned and exact trainers against
    stock HF per scheme, and the export onto each scheme's grid against the bf16 RNE cast. No targets: the issue
    asks for the figures (docs/quantization.md says what they buy)."""
    head = ["scheme", "model", "shape", "pass", "trainer", "time ms", "time × stock", "peak MiB", "peak × stock"]
    lines = [machine_line(data.get("machine", {})), "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    names = {"stock": "stock HF (bf16)", "rounding": "quantization-aligned", "exact": "exact"}
    for r in data["train"]:
        stock = r["variant"] == "stock"
        band = r.get("time_band")
        time_cell = "1" if stock else f"{r['time_ratio']:.2f}" + (f" ({band[0]:.2f}-{band[1]:.2f})" if band else "")
        peak = r.get("peak_ratio")
        peak_cell = "" if peak is None else ("1" if stock else f"{peak:.2f}")
        lines.append("| " + " | ".join([
            r["scheme"], r["name"], r["shape"], r["pass"], names[r["variant"]], f"{r['time_ms']:.4g}", time_cell,
            _mib(r.get("peak_bytes")), peak_cell]) + " |")  # fmt: skip
    head = ["tensor set", "scheme", "threads", "bf16 RNE s", "RNE × bf16", "stochastic × bf16", "error-feedback × bf16"]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in data["export"]:
        cells = [f"{r['ratio'][m]:.2f} ({r['band'][m][0]:.2f}-{r['band'][m][1]:.2f})" for m in
                 ("rne", "stochastic", "error-feedback")]  # fmt: skip
        lines.append("| " + " | ".join([
            f"{r['set']} ({r['parameters'] / 1e6:.1f}M)", r["scheme"], str(r["threads"]),
            f"{r['median_s']['bf16 rne']:.4f}", *cells]) + " |")  # fmt: skip
    return "\n".join(lines)


def _grpo(rows: list[dict], row: dict) -> dict:
    """The GRPO row of ``row``'s trainer."""
    return next(r for r in rows if r["trainer"] == row["trainer"] and r["variant"] == "grpo")


def osol_section(data: dict) -> str:
    """OSOL's cost (benchmarks/osol_cost.py): the trainer's part of a step and the whole step against GRPO's on the
    same batch, per trainer, the peak memory, and where OSOL's extra time goes."""
    shape, rows = data["shape"], data["results"]
    lines = [machine_line(data.get("machine", {})), "",
             f"{data['model']}, domains {data['domains']}: one batch of {shape['completions']} completions "
             f"({shape['prompts_per_step']} prompts x {shape['group_size']}, at most {shape['max_tokens']} tokens; "
             f"{data['completion_tokens']} completion tokens), sampled once by the reference engine and replayed to "
             f"every step; {data['rounds']} rounds, the first a warm-up. Rollout (the reference engine sampling that "
             f"batch): {data['rollout_ms']:.0f} ms. Added: GRPO's step plus OSOL's own phase (the footprint's "
             "forward on the previous weights and the weight copies there and back, the advantage correction, the "
             "backtracking's forward after the sync), against GRPO's step, round by round. Step: OSOL's whole "
             "trainer part (recompute, advantages, update, sync, OSOL's phase), which also trains the completions "
             "OSOL's penalty gives a gradient where GRPO's advantage is 0 (trained seqs: the share of the batch "
             "with a nonzero advantage, which the update trains). Whole step: rollout + the trainer's part.",
             ""]  # fmt: skip
    head = ["trainer", "variant", "added × GRPO", "step ms", "step × GRPO", "whole step ms", "whole × GRPO",
            "trained seqs", "peak MiB", "peak × GRPO", "OSOL's weights MiB"]  # fmt: skip
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    misses = checked = 0
    for r in rows:
        grpo = r["variant"] == "grpo"
        added_cell, miss = _ratio(
            r.get("additions_ratio", 1.0), data.get("target", OSOL_TARGET), grpo, r.get("additions_band")
        )
        time_cell, _ = _ratio(r["time_ratio"], 0.0, grpo, r.get("time_band"), "no target")
        whole_cell, _ = _ratio(r["whole_ratio"], 0.0, grpo, r.get("whole_band"), "no target")
        misses, checked = misses + miss, checked + (not grpo)
        peak_cell = "1.000 (ref)" if grpo else f"{r['peak_ratio']:.3f}"
        lines.append("| " + " | ".join([
            f"{r['trainer']} (`{r['profile']}`)", r["variant"], added_cell, f"{r['time_ms']:.4g}", time_cell,
            f"{r['whole_ms']:.4g}", whole_cell, f"{r['trained_sequence_frac']:.2f}", _mib(r["peak_bytes"]), peak_cell,
            f"{r['osol_held_bytes'] / 2**20:.2f}"]) + " |")  # fmt: skip
    lines.append("")
    for r in rows:
        extra = r.get("extra_ms")
        if extra is None:
            continue
        lines.append(f"- {r['trainer']}: OSOL's extra {extra['total']:.0f} ms: the footprint's forwards "
                     f"({r['focus_rows']} rows, the previous weights) {extra['footprint_forwards']:.0f} ms, the "
                     f"backtracking's ({r['focus_rows']} rows, the new weights) "
                     f"{extra['backtracking_forwards']:.0f} ms, the weight copies to the previous weights and back "
                     f"{extra['weight_copies']:.1f} ms, the update's extra sequences "
                     f"({r['trained_sequence_frac']:.2f} of the batch trained against GRPO's "
                     f"{_grpo(rows, r)['trained_sequence_frac']:.2f}) {extra['extra_trained']:.0f} ms, the rest (the "
                     f"advantage correction, noise) {extra['rest']:.0f} ms. Inside these, the first forward after "
                     f"each weight "
                     f"change beyond the others' median, OSOL's less GRPO's (vLLM's GEMM preparation in the exact "
                     f"trainer; none in stock HF): {extra['preparation']:+.0f} ms.")  # fmt: skip
    copies = round(rows[-1]["osol_held_bytes"] / data["weights_16bit_bytes"])
    lines.append(f"- Peak: the trainer's tensors kept between steps (fp32 master, gradients, optimizer state, compute "
                 f"copy, OSOL's weights) plus the step's own peak. OSOL keeps {copies} 16-bit "
                 f"{'copy' if copies == 1 else 'copies'} of the weights "
                 f"({data['weights_16bit_bytes'] / 2**20:.2f} MiB each).")  # fmt: skip
    lines += ["", f"Target: what OSOL adds at most {data.get('target', OSOL_TARGET):.2f}x GRPO's step. "
              f"Targets missed: {misses} of {checked} ratios checked."]  # fmt: skip
    return "\n".join(lines)


def fill(page: str, suite: str, block: str) -> str:
    """Replace what lies between the suite's markers in ``page`` with ``block``."""
    start, end = f"<!-- bench:{suite} -->", f"<!-- /bench:{suite} -->"
    i, j = page.find(start), page.find(end)
    if i < 0 or j < i:
        raise ValueError(
            f"the page lacks the markers {start} ... {end} (in that order); add them where the {suite} table should go"
        )
    return page[: i + len(start)] + "\n" + block + "\n" + page[j:]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", metavar="JSON", help="benchmarks/ops.py --json output")
    ap.add_argument("--model", metavar="JSON", help="benchmarks/model_step.py --json output")
    ap.add_argument("--exact", metavar="JSON", help="benchmarks/exact_step.py --json output")
    ap.add_argument("--compile-time", metavar="JSON", help="benchmarks/compile_time.py --json output")
    ap.add_argument("--sync", metavar="JSON", help="benchmarks/sync_export.py --json output")
    ap.add_argument("--quant", metavar="JSON", help="benchmarks/quant_cost.py --json output")
    ap.add_argument("--osol", metavar="JSON", help="benchmarks/osol_cost.py --json output")
    ap.add_argument("--out", default="docs/benchmarks.md", help="the page with the markers (default %(default)s)")
    args = ap.parse_args(argv)
    if not (args.ops or args.model or args.exact or args.compile_time or args.sync or args.quant or args.osol):
        ap.error("give at least one of --ops, --model, --exact, --compile-time, --sync, --quant, --osol")
    out = Path(args.out)
    if not out.is_file():
        ap.error(f"--out {out} does not exist; it must be the page holding the bench markers")
    page = out.read_text()
    raw_dir = out.with_suffix("")  # docs/benchmarks.md -> docs/benchmarks/
    for suite, path in (("ops", args.ops), ("model", args.model)):
        if not path:
            continue
        data = load(path, suite)
        page = fill(page, suite, section(data))
        raw_dir.mkdir(parents=True, exist_ok=True)
        (raw_dir / f"{suite}.json").write_text(json.dumps(data, indent=1) + "\n")
    for suite, path, render in (("exact", args.exact, exact_section), ("compile_time", args.compile_time,
                                compile_section), ("sync", args.sync, sync_section),
                                ("quant", args.quant, quant_section), ("osol", args.osol, osol_section)):  # fmt: skip
        if not path:
            continue
        data = json.loads(Path(path).read_text())
        listed = "train" if suite == "quant" else "results"
        empty = suite in ("exact", "sync", "osol", "quant") and not data.get(listed)
        if data.get("suite") != suite or empty:
            raise ValueError(f"{path}: expected a {suite!r} suite JSON with results")
        page = fill(page, suite, render(data))
        raw_dir.mkdir(parents=True, exist_ok=True)
        (raw_dir / f"{suite}.json").write_text(json.dumps(data, indent=1) + "\n")
    out.write_text(page)
    print(f"wrote {out} and the raw JSON under {raw_dir}/")


if __name__ == "__main__":
    main()
