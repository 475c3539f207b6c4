"""What a quantized engine costs the trainer: the quantization-aligned and exact trainers' step against stock HF,
and the export onto the scheme's grid (RNE, stochastic, error feedback) against the bf16 RNE cast.

Runs in the engine's Python (``make vllm``: .venv-vllm), where the exact trainer's vLLM layers load.

- **Trainer** (per scheme): ``benchmarks/exact_step.py``'s three passes (train step, first recompute, recompute)
  and peak memory, for stock HF (bf16, quantization-unaware), the quantization-aligned trainer (the vLLM build's
  rounding profile ``+quantization=SCHEME``: the served weights, vLLM's activation quantizer and epilogue, torch's
  GEMM) and the exact one (``...-kernels+quantization=SCHEME``: vLLM's own quantized layers), from the same weights,
  interleaved, ratios to stock in the same run. Each forward after an optimizer step quantizes the changed weights
  again (the served copy follows the weights), as a training run does.
- **Export** (per scheme and tensor set): ``Exporter(mode, scheme=SCHEME)`` of the whole fp32 master state dict for
  each mode, against ``Exporter("rne")``, the bf16 cast of the same state dict, interleaved, first round warm-up.

    .venv-vllm/bin/python benchmarks/quant_cost.py --quick
    .venv-vllm/bin/python benchmarks/quant_cost.py --json quant.json       # make bench (~15 min on 2 cores)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers
from _machine import machine_info, write_json
from exact_step import format_table, run_case
from model_step import ratio_band
from sync_export import qwen25_05b_master, tiny_master

import roundalign
from roundalign.engines.vllm.profile import trainer_profile
from roundalign.sync import MODES, Exporter

TRAIN_SCHEMES = ("w8a8-int8", "w4a16", "fp8")
# (model, batch, longest sequence, rounds): the shipped model, as benchmarks/exact_step.py's first case
TRAIN_CASE = ("tiny-qwen3", 8, 128, 6)
QUICK_CASE = ("tiny-qwen3", 2, 32, 2)
EXPORT_SETS = {"tiny": ("w8a8-int8", "w4a16", "fp8"), "0.5b": ("w8a8-int8",)}


def export_case(name: str, master: dict, scheme: str, repeats: int) -> dict:
    exporters = {"bf16 rne": Exporter("rne")} | {mode: Exporter(mode, scheme=scheme) for mode in MODES}
    times = {key: [] for key in exporters}
    for round_ in range(repeats + 1):  # round 0 is warm-up (and builds the compiled kernels)
        for key, exporter in exporters.items():
            start = time.perf_counter()
            served = exporter.export(master)
            elapsed = time.perf_counter() - start
            del served
            if round_:
                times[key].append(elapsed)
    medians = {key: statistics.median(t) for key, t in times.items()}
    base = medians["bf16 rne"]
    row = {
        "set": name, "scheme": scheme, "parameters": sum(t.numel() for t in master.values()),
        "threads": torch.get_num_threads(), "export_s": times, "median_s": medians,
        "ratio": {key: m / base for key, m in medians.items()},
        "band": {key: ratio_band(times[key], times["bf16 rne"]) for key in times},
    }  # fmt: skip
    cells = "  ".join(f"{key} {medians[key]:.4f} s ({row['ratio'][key]:.2f}x)" for key in times)
    print(f"export {name} ({row['parameters'] / 1e6:.1f}M) {scheme}: {cells}", flush=True)
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes, 2 rounds, the tiny set only: a smoke run")
    ap.add_argument("--schemes", default=",".join(TRAIN_SCHEMES), help="the trainer's schemes (comma-separated)")
    ap.add_argument("--repeats", type=int, default=3, help="timed export rounds after one warm-up round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="write {suite, machine, train, export} here")
    args = ap.parse_args(argv)
    transformers.utils.logging.disable_progress_bar()
    exact = trainer_profile(True)
    aligned = roundalign.get_profile(exact).rounding_only().name
    machine = machine_info()
    print(f"machine: {machine['cpu']}, {machine['torch_threads']} torch threads, torch {machine['torch']}")
    name, batch, seq, rounds = QUICK_CASE if args.quick else TRAIN_CASE
    train = []
    for scheme in args.schemes.split(","):
        profiles = {"rounding": f"{aligned}+quantization={scheme}", "exact": f"{exact}+quantization={scheme}"}
        rows = run_case(name, batch, seq, 2 if args.quick else rounds, args.seed, profiles)
        for row in rows:
            row["scheme"] = scheme
        train.extend(rows)
        print(format_table(rows), flush=True)
    masters = {"tiny": tiny_master} | ({} if args.quick else {"0.5b": lambda: qwen25_05b_master(args.seed)})
    export = []
    for set_name, load in masters.items():
        master = load()
        for scheme in EXPORT_SETS[set_name]:
            export.append(export_case(set_name, master, scheme, 1 if args.quick else args.repeats))
        del master
    result = {"suite": "quant", "machine": machine, "train": train, "export": export}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
