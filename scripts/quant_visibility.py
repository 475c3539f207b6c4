"""How much of the trainer's small updates reaches a quantized engine: RNE vs stochastic rounding vs error feedback.

    .venv/bin/python scripts/quant_visibility.py [--steps 100] [--lr 1e-6] [--out docs/results/quant-visibility.json]

The fp32 master starts as the shipped model's checkpoint (as an RL run does) and takes ``--steps`` Adam-like
updates: ``m += lr * sign(b + n_t)`` per weight, ``b ~ N(0, 1)`` fixed per weight (a persistent direction, strong for
some weights and weak for others) and ``n_t ~ N(0, 1)`` fresh each step. Every step is exported with each mode
onto each scheme's grid (``roundalign.sync.Exporter(sync, scheme=)``; ``none`` is the bf16 engine) and the served
copy, as the engine computes with it (``sync.grid.served_weights``), is measured over the quantized linear layers
(the only weights whose grid differs between schemes):

- ``visible``: the share of served weights whose value changed, mean per step (PULSE's measure);
- ``transfer``: ``<s_t - s_(t-1), m_t - m_(t-1)> / |m_t - m_(t-1)|^2``, mean per step (``UpdateTracker``);
- ``drift served``: ``<mean_t s_t - s_0, mean_t m_t - m_0> / |mean_t m_t - m_0|^2``: the share of the master's
  mean movement over the run that the served copy's mean movement carries (1: all of it reaches the engine on
  average; 0: none);
- ``first change``: steps until a weight's served value first changes, median over the weights (``> steps``
  where most never change; stochastic rounding changes values from noise alone, so this is about RNE and EF);
- ``lag``: the served copy's lag in steps (``UpdateTracker``'s ``lag_steps`` at the last step).

Prints a Markdown table and writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from roundalign.models import path as model_path
from roundalign.quant import checkpoint
from roundalign.quant.schemes import SCHEMES
from roundalign.sync import Exporter, UpdateTracker
from roundalign.sync.grid import served_weights

SCHEMES_MEASURED = ("none", "w8a8-int8", "fp8", "w4a16", "w4a16-g32-zp")
MODES = ("rne", "stochastic", "error-feedback")


def run(master0: dict, scheme: str, sync: str, steps: int, lr: float, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    bias = {k: torch.randn(v.shape, generator=g) for k, v in master0.items()}
    exporter = Exporter(sync, seed=seed, scheme=scheme)
    tracker = UpdateTracker(lag_window=steps + 1, sample_size=65536, seed=seed)
    master = {k: v.clone() for k, v in master0.items()}
    linears = [k for k in master if checkpoint.is_quantized_linear(k, master[k])]
    first_served = prev = None
    served_sum = {k: torch.zeros_like(master[k], dtype=torch.float64) for k in linears}
    master_sum = {k: torch.zeros_like(master[k], dtype=torch.float64) for k in linears}
    first_change = {k: torch.full(master[k].shape, steps + 1, dtype=torch.int32) for k in linears}
    visible, transfer, lag = [], [], None
    seconds = 0.0
    for t in range(steps + 1):
        start = time.perf_counter()
        served = served_weights(exporter.export(master), SCHEMES[scheme])
        seconds += (time.perf_counter() - start) * (t > 0)  # the first export may build the compiled kernels
        served = {k: served[k].float() for k in linears}
        metrics = tracker.update({k: master[k] for k in linears}, served)
        if t:
            visible.append(metrics["sync/visible_fraction"])
            if metrics["sync/update_transfer"] is not None:
                transfer.append(metrics["sync/update_transfer"])
            for k in linears:
                changed = (served[k] != prev[k]) & (first_change[k] > steps)
                first_change[k][changed] = t
        first_served = served if first_served is None else first_served
        prev = served
        lag = metrics["sync/lag_steps"]
        for k in linears:
            served_sum[k] += served[k]
            master_sum[k] += master[k]
        for k in master:  # the step's update (every tensor: the non-linear ones are exported too)
            noise = torch.randn(master[k].shape, generator=g)
            master[k] += lr * torch.sign(bias[k] + noise)
    num = den = 0.0
    for k in linears:
        moved = served_sum[k] / (steps + 1) - first_served[k].double()
        drift = master_sum[k] / (steps + 1) - master0[k].double()
        num += float((moved * drift).sum())
        den += float((drift * drift).sum())
    changes = torch.cat([first_change[k].flatten() for k in linears]).float()
    return {
        "visible": sum(visible) / len(visible),
        "transfer": sum(transfer) / len(transfer) if transfer else None,
        "drift_served": num / den,
        "first_change_median": float(changes.median()),
        "lag": lag,
        "export_s": seconds / max(steps, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--schemes", default=",".join(SCHEMES_MEASURED))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    master0 = {k: v.float() for k, v in load_file(str(model_path("tiny-qwen3") / "model.safetensors")).items()}
    rows = []
    print("| scheme | export | visible | transfer | drift served | first change (median steps) | lag | export s |")
    print("|---|---|---|---|---|---|---|---|")
    for scheme in args.schemes.split(","):
        for sync in MODES:
            r = run(master0, scheme, sync, args.steps, args.lr, args.seed)
            rows.append({"scheme": scheme, "sync": sync, **r})
            transfer = "n/a" if r["transfer"] is None else f"{r['transfer']:.3f}"
            first = r["first_change_median"]
            first = f"> {args.steps}" if first > args.steps else f"{first:.0f}"
            print(
                f"| {scheme} | {sync} | {r['visible']:.2%} | {transfer} | {r['drift_served']:.3f} | {first} | "
                f"{r['lag']:.0f} | {r['export_s']:.3f} |",
                flush=True,
            )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "steps": args.steps, "lr": args.lr, "seed": args.seed, "model": "tiny-qwen3 (shipped)",
            "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
        }  # fmt: skip
        args.out.write_text(json.dumps({"settings": meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
