"""First-use compile time of the ops' fused kernels (``apply``'s default), cold and warm.

``apply(model, profile)`` compiles each op's fused kernels on their first call, one per op, rule, dtype and input
layout, forward and backward (``roundalign.ops._fused``). Inductor keeps them in its on-disk cache
(``TORCHINDUCTOR_CACHE_DIR``), so a later process loads them instead. This script measures both in fresh processes
that share one empty cache folder:

- ``cold``: the first process, nothing cached: every kernel is traced, compiled by gcc and stored;
- ``warm``: a second process: every kernel is traced and loaded from the cache.

Each process builds the model, applies the profile, and times two training steps (forward, backward): the first-use
cost is the first step's time less the second's. Stock HF runs the same two steps in the same process, for scale.

    .venv/bin/python benchmarks/compile_time.py                    # tiny-qwen3, profile vllm
    .venv/bin/python benchmarks/compile_time.py --model qwen3-0.6b-2l-v4k --json /tmp/compile.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(model_name: str, profile: str) -> dict:
    """One process's figures (runs inside the subprocess)."""
    import torch
    import transformers
    from model_step import build_model

    import roundalign

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    stock = build_model(model_name).train()
    ids = torch.randint(0, stock.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))

    def two_steps(model) -> tuple[float, float]:
        times = []
        for _ in range(2):
            start = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            times.append(time.perf_counter() - start)
        return times[0], times[1]

    stock_first, stock_second = two_steps(stock)
    start = time.perf_counter()
    aligned = roundalign.apply(build_model(model_name), profile).train()
    apply_s = time.perf_counter() - start
    first, second = two_steps(aligned)
    return {"apply_s": apply_s, "first_s": first, "second_s": second, "first_use_s": first - second,
            "stock_first_s": stock_first, "stock_second_s": stock_second}  # fmt: skip


def run(model_name: str, profile: str, cache: str, threads: int | None) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    code = (
        f"import sys, json; sys.path.insert(0, {str(HERE)!r}); import compile_time; "
        f"print('RESULT', json.dumps(compile_time.child({model_name!r}, {profile!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"the measuring process failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1].split(" ", 1)[1])


def main(argv: list[str] | None = None) -> dict:
    sys.path.insert(0, str(HERE))
    from _machine import machine_info, write_json

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-qwen3", help="a model of benchmarks/model_step.py (default tiny-qwen3)")
    ap.add_argument("--profile", default="vllm")
    ap.add_argument("--threads", type=int, help="OMP_NUM_THREADS of the measuring processes")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="roundalign-inductor-") as cache:
        cold = run(args.model, args.profile, cache, args.threads)
        warm = run(args.model, args.profile, cache, args.threads)
    print(f"machine: {machine['cpu']}, {machine['logical_cpus']} logical CPUs, torch {machine['torch']}")
    print(f"{args.model}, profile {args.profile}: first training step's extra time (first step less second)")
    for name, r in (("cold", cold), ("warm", warm)):
        print(
            f"  {name}: {r['first_use_s']:6.1f} s (first step {r['first_s']:.1f} s, second {r['second_s']:.2f} s; "
            f"stock HF's second step {r['stock_second_s']:.2f} s)"
        )
    result = {"suite": "compile_time", "machine": machine, "model": args.model, "profile": args.profile,
              "cold": cold, "warm": warm}  # fmt: skip
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
