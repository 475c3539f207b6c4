"""Cost of exporting an fp32 master to bf16 per mode (RNE, stochastic, error feedback), and of UpdateTracker.update.

Two tensor sets, each as an fp32 master state_dict:

- ``tiny``: the shipped tiny-qwen3 (``roundalign.models.path("tiny-qwen3")``, read with safetensors, upcast).
- ``0.5b``: random fp32 tensors with Qwen2.5-0.5B's shapes (hidden 896, 24 layers, intermediate 4864, 14 heads,
  2 kv heads, head_dim 64, vocab 151936, tied embeddings: about 494M parameters, 2 GB in fp32). Peak memory is
  about 9 GB (master, served copy, EF residuals, the tracker's previous master and served copy).

Each round exports the whole state_dict once per mode, interleaved (rne, stochastic, error-feedback, rne, ...) so
that machine drift hits every mode alike; the first round is warm-up. Medians and ratios against RNE come from the
same run. ``UpdateTracker.update`` is timed on the RNE export, after one untimed first call (which has no previous
step to compare with); ``--no-tracker`` skips it. ``--dtypes bf16,fp16`` runs each set once per export dtype, and
``--threads 1,2`` once per torch thread count.

Where each served copy lands decides much of an export's time, and every mode allocates its served copy alike:

- ``fresh`` pages: the allocator returns freed memory to the kernel before each export (``malloc_trim``), so the
  served copy is written into pages the kernel first maps and zeroes, as a large tensor's allocation is (glibc maps
  those on their own and unmaps them when freed);
- ``warm`` pages: the allocator keeps what it frees (``mallopt``: no separate mappings, no trimming), so after the
  warm-up round every served copy lands in memory already mapped, and the time is the export's own work.

``--pages fresh,warm`` (the default) runs both, fresh first (warm cannot be undone in-process); both need glibc,
elsewhere the allocator's default runs as ``default``. The table's GB/s counts the bytes each mode must move: 6 an
element for RNE and SR (read fp32, write 16 bits), 14 for error feedback (its fp32 residual read and written too).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sync_export.py     # both sets, bf16, 3 timed rounds
    .venv/bin/python benchmarks/sync_export.py --dtypes bf16,fp16 --threads 1,2 --no-tracker --repeats 7  # make bench
    .venv/bin/python benchmarks/sync_export.py --sets tiny --repeats 10 --json /tmp/sync.json
    .venv/bin/python benchmarks/sync_export.py --sets 0.5b --dtypes bf16,fp16 --no-tracker
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

import torch
from _machine import machine_info
from model_step import ratio_band

from roundalign.sync import MODES, Exporter, UpdateTracker, _native

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BYTES = {"rne": 6, "stochastic": 6, "error-feedback": 14}  # what each mode must move per element (docstring)
PAGES = ("fresh", "warm")
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def _glibc():
    """glibc's malloc controls, or None on another C library."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc's own symbol: mallopt elsewhere may mean other things)
        libc.mallopt.argtypes, libc.malloc_trim.argtypes = [ctypes.c_int, ctypes.c_int], [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


def set_pages(pages: str, libc) -> None:
    """Make the allocator keep what it frees (``warm``); ``fresh`` needs nothing here (bench_set trims)."""
    if pages == "warm":
        libc.mallopt(_M_MMAP_MAX, 0)  # every allocation from the heap, none mapped on its own
        libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)  # and the heap never handed back


def tiny_master() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    import roundalign.models

    weights = load_file(str(roundalign.models.path("tiny-qwen3") / "model.safetensors"))
    return {name: t.float() for name, t in weights.items()}  # the fp32 master a trainer would hold


def qwen25_05b_master(seed: int) -> dict[str, torch.Tensor]:
    """Random fp32 tensors with Qwen2.5-0.5B's HF names and shapes (tied embeddings: no lm_head.weight)."""
    hidden, layers, inter, heads, kv_heads, head_dim, vocab = 896, 24, 4864, 14, 2, 64, 151936
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden), p + "self_attn.q_proj.bias": (heads * head_dim,),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.k_proj.bias": (kv_heads * head_dim,),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.bias": (kv_heads * head_dim,),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
        }  # fmt: skip
    shapes["model.norm.weight"] = (hidden,)
    # Weights ~ N(0, 0.02^2) as at init; norms near 1. The values do not change the cost of any mode.
    return {n: 1.0 + 0.1 * torch.randn(s, generator=g) if n.endswith("norm.weight")
            else 0.02 * torch.randn(s, generator=g) for n, s in shapes.items()}  # fmt: skip


def bench_set(name: str, master: dict[str, torch.Tensor], dtype: str, pages: str, libc, args) -> dict:
    numel = sum(t.numel() for t in master.values())
    print(
        f"\n{name}, {dtype}, {pages} pages, {torch.get_num_threads()} threads: {len(master)} tensors, "
        f"{numel / 1e6:.1f}M parameters ({numel * 4 / 2**30:.2f} GiB fp32)"
    )
    exporters = {mode: Exporter(mode, seed=args.seed, dtype=_DTYPES[dtype]) for mode in MODES}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_ in range(args.repeats + 1):  # round 0 is warm-up
        for mode in MODES:
            if pages == "fresh":
                libc.malloc_trim(0)  # the freed served copies go back to the kernel: this one is faulted in anew
            start = time.perf_counter()
            served = exporters[mode].export(master)
            elapsed = time.perf_counter() - start
            del served  # only one served copy alive at a time
            if round_:
                times[mode].append(elapsed)
    track = []
    if args.tracker:
        tracker = UpdateTracker(lag_window=args.lag_window, sample_size=args.sample_size, seed=args.seed)
        served = exporters["rne"].export(master)
        tracker.update(master, served)  # first call: nothing to compare with yet
        for _ in range(args.repeats):
            start = time.perf_counter()
            tracker.update(master, served)
            track.append(time.perf_counter() - start)
        del served, tracker
    del exporters
    medians = {mode: statistics.median(times[mode]) for mode in MODES}
    rne = medians["rne"]
    ratio = {mode: medians[mode] / rne for mode in MODES}
    gb_per_s = {mode: BYTES[mode] * numel / medians[mode] / 1e9 for mode in MODES}
    print(f"{'mode':<16}{'median s':>10}{'min s':>10}{'vs rne':>8}{'Mparam/s':>10}{'GB/s':>7}")
    for mode in MODES:
        med = medians[mode]
        print(f"{mode:<16}{med:>10.4f}{min(times[mode]):>10.4f}{ratio[mode]:>7.2f}x{numel / med / 1e6:>10.0f}"
              f"{gb_per_s[mode]:>7.1f}")  # fmt: skip
    if track:
        med = statistics.median(track)
        print(f"{'tracker.update':<16}{med:>10.4f}{min(track):>10.4f}{med / rne:>7.2f}x{numel / med / 1e6:>10.0f}")
    return {
        "set": name, "dtype": dtype, "pages": pages, "threads": torch.get_num_threads(), "parameters": numel,
        "tensors": len(master), "export_s": times, "tracker_update_s": track, "median_s": medians, "ratio": ratio,
        "band": {mode: ratio_band(times[mode], times["rne"]) for mode in MODES},  # quartiles of per-round ratios
        "gb_per_s": gb_per_s,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # what to time
    p.add_argument("--sets", default="tiny,0.5b", help="comma-separated: tiny, 0.5b")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="export dtype (one; see --dtypes)")
    p.add_argument("--dtypes", default=None, help="comma-separated export dtypes (bf16, fp16); overrides --dtype")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds after one warm-up round")
    # tracker settings
    p.add_argument("--lag-window", type=int, default=256)
    p.add_argument("--sample-size", type=int, default=65536)
    p.add_argument("--no-tracker", dest="tracker", action="store_false", help="do not time UpdateTracker.update")
    # run
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", default=None, help="comma-separated torch thread counts (default: torch's choice)")
    p.add_argument("--pages", default=",".join(PAGES), help="comma-separated: fresh, warm (module docstring)")
    p.add_argument("--json", default=None, help="write raw timings and the machine here")
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    dtypes = args.dtypes.split(",") if args.dtypes else [args.dtype]
    if unknown := [d for d in dtypes if d not in _DTYPES]:
        p.error(f"unknown dtype {unknown[0]!r}; choose from {', '.join(_DTYPES)}")
    try:
        threads = [int(t) for t in args.threads.split(",")] if args.threads else [torch.get_num_threads()]
    except ValueError:
        p.error(f"--threads takes comma-separated thread counts, got {args.threads!r}")
    if min(threads) < 1:
        p.error("--threads must be at least 1")
    pages = args.pages.split(",")
    if unknown := [x for x in pages if x not in PAGES]:
        p.error(f"unknown --pages {unknown[0]!r}; choose from {', '.join(PAGES)}")
    pages.sort(key=PAGES.index)  # fresh first: warm cannot be undone in this process
    libc = _glibc()
    if libc is None:
        print("pages: this C library has no glibc malloc controls; the allocator's default runs as 'default'")
        pages = ["default"]
    info = machine_info()
    print(f"args: {vars(args)}")
    print(f"machine: {info['cpu']}, {info['torch_threads']} torch threads, torch {info['torch']}, {info['date']}")
    # Which export path runs: the compiled one-pass kernels, or the torch formulas where they cannot be built.
    info["sync_kernels"] = "compiled" if _native.kernels() is not None else f"torch formulas: {_native._state['why']}"
    print(f"export kernels: {info['sync_kernels']}")
    loaders = {"tiny": tiny_master, "0.5b": lambda: qwen25_05b_master(args.seed)}
    if unknown := [name for name in args.sets.split(",") if name not in loaders]:
        p.error(f"unknown set {unknown[0]!r}; choose from {', '.join(loaders)}")
    masters = {name: loaders[name]() for name in args.sets.split(",")}  # kept: every pages setting times them
    results = {}
    for page in pages:  # fresh first: warm cannot be undone in this process
        set_pages(page, libc)
        for name, master in masters.items():
            for count in threads:
                torch.set_num_threads(count)
                for dtype in dtypes:
                    results[f"{name}/{dtype}/{page}/{count}t"] = bench_set(name, master, dtype, page, libc, args)
    del masters
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"suite": "sync", "machine": info, "args": vars(args), "results": results}, f, indent=1)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
