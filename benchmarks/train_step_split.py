"""Where a ``roundalign train`` step spends its time: rollout, recompute, update, sync, per configuration.

Each configuration is a full ``Run`` (rl/loop.py) on the shipped tiny-qwen3 with the same problems, sampling seed
and batch. The configurations take turns step by step (A, B, C, A, B, C, ...), so machine drift hits them alike;
the first step of each is warm-up. Printed: the median seconds of each phase and of the whole step, and the ratio
of the step time against the first configuration (stock HF trainer, RNE export) measured in the same run.

    .venv/bin/python benchmarks/train_step_split.py                  # 6 steps per configuration, 1 thread
    .venv/bin/python benchmarks/train_step_split.py --steps 10 --threads 2 --json step-split.json

Caveat: the trained batch differs between configurations after the first update (different weights sample
different completions), so the rollout and update phases drift apart with the run's own randomness; the sync
phase does not depend on it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch
from _machine import cpu_model

from roundalign.rl.config import TrainConfig
from roundalign.rl.loop import Run

PHASES = ("rollout", "recompute", "update", "sync", "step")
CONFIGS = {
    "hf / rne": dict(trainer_profile="hf"),
    "aligned / rne": dict(trainer_profile="aligned"),
    "aligned / stochastic": dict(trainer_profile="aligned", sync="stochastic"),
    "aligned / error-feedback": dict(trainer_profile="aligned", sync="error-feedback"),
    "aligned / rne / float16": dict(trainer_profile="aligned", dtype="float16"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="measured steps per configuration, after 1 warm-up")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--engine-profile", default="sglang")
    ap.add_argument("--json", metavar="PATH", help="write the raw per-step timings here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} thread(s)")
    print(f"batch: 8 problems x 8 completions, max 64 tokens, engine profile {args.engine_profile}, kernels backend")

    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, kw in CONFIGS.items():
            config = TrainConfig(engine_profile=args.engine_profile, steps=args.steps + 1, **kw).validate()
            runs[name] = Run(config, Path(tmp) / name.replace(" / ", "-"))
            runs[name].sync()
        times = {name: [] for name in CONFIGS}
        for step in range(1, args.steps + 2):
            for name, run in runs.items():
                m = run.step(step)
                if step > 1:
                    times[name].append({p: m[f"timing_s/{p}"] for p in PHASES})

    base = statistics.median(t["step"] for t in times["hf / rne"])
    header = f"{'configuration':<26}" + "".join(f"{p + ' (s)':>14}" for p in PHASES) + f"{'step vs hf/rne':>16}"
    print(header)
    for name, rows in times.items():
        med = {p: statistics.median(r[p] for r in rows) for p in PHASES}
        print(f"{name:<26}" + "".join(f"{med[p]:>14.3f}" for p in PHASES) + f"{med['step'] / base:>15.2f}x")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"machine": cpu_model(), "torch": torch.__version__, "threads": args.threads, "timings": times},
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
