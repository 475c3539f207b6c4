"""The quantized-rollout table of docs/quantization.md: for each scheme the real vLLM serves, the mismatch of the
stock bf16 trainer, the rounding profile, the quantization-aligned trainer and the exact one, on two models.

    .venv-vllm/bin/python scripts/quant_table.py OUT_DIR [--samples 16] [--tokens 48]
    .venv/bin/python scripts/quant_table.py OUT_DIR --emulated    # the GPU formats, on the reference engine

Runs ``roundalign probe --engine vllm --enforce-eager --quantization SCHEME`` (vLLM samples from the checkpoint
roundalign writes; every trainer scores the same completions) on the shipped Qwen3 and on the test suite's
higher-entropy Llama (head_dim 128, tests/wide_model.py), and prints one Markdown row per scheme and trainer, with
the mean entropy of each model at the sampled tokens and each probe's wall time. Needs vLLM in this Python (the
exact trainer runs its layers).

``--emulated``: the GPU formats instead (NVFP4, MXFP4, MXFP8, blockwise FP8), which vLLM's CPU build does not serve:
the reference engine serves each (``roundalign.quant.emulated``) and samples, and the same four trainers score its
completions, the exact one being the reference engine's own profile.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMES = ("none", "w8a8-int8", "w4a16", "w4a16-g32-zp", "fp8", "fp8-online")
EMULATED = ("nvfp4", "nvfp4-te", "mxfp4", "mxfp4-vllm", "mxfp8", "fp8-block")
LEVELS = ("stock bf16", "rounding only", "quantization-aligned", "exact")


def _models(out: Path) -> dict[str, Path]:
    sys.path.insert(0, str(ROOT))
    from roundalign import models
    from tests.wide_model import build_llama

    return {"shipped Qwen3 (head_dim 64)": models.path(), "Llama (head_dim 128)": build_llama(out / "llama")}


def _probe(model: Path, scheme: str, out: Path, samples: int, tokens: int, emulated: bool) -> tuple[dict, float]:
    engine = [] if emulated else ["--engine", "vllm", "--enforce-eager"]
    cmd = [sys.executable, "-m", "roundalign", "probe", *engine, "--model", str(model), "--num-samples",
           str(samples), "--max-tokens", str(tokens), "--no-plots", "--out", str(out)]  # fmt: skip
    if scheme == "none":
        from roundalign.engines.vllm.profile import trainer_profile

        exact = trainer_profile(enforce_eager=True)
        rounding = exact.removesuffix("-kernels")
        cmd += ["--trainer-profiles", f"hf,{rounding},{exact}"]
    else:
        cmd += ["--quantization", scheme]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"probe failed ({' '.join(cmd)}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads((out / "report.json").read_text()), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--emulated", action="store_true", help="the GPU formats, on the reference engine")
    args = parser.parse_args()
    print("| model (entropy) | scheme | trainer | bitwise equal | k3_kl | RMS log-ratio | probe wall time |")
    print("|---|---|---|---|---|---|---|")
    for label, model in _models(args.out).items():
        for scheme in EMULATED if args.emulated else SCHEMES:
            out = args.out / f"{model.name}-{scheme}"
            report, seconds = _probe(model, scheme, out, args.samples, args.tokens, args.emulated)
            entropy = report["tokens"]["mean_entropy_nats"]
            rows = [c for c in report["comparisons"] if c["reference"] == "decode"]
            levels = LEVELS if scheme != "none" else (LEVELS[0], LEVELS[1], LEVELS[3])
            for level, row in zip(levels, rows, strict=True):
                m = row["metrics"]
                print(
                    f"| {label} ({entropy:.2f} nats) | {scheme} | {level}: `{row['trainer_profile']}` | "
                    f"{m['mismatch/bitwise_equal_frac']:.1%} | {m['rollout_corr/k3_kl']:.2e} | "
                    f"{m['mismatch/log_ratio_rms']:.2e} | {seconds:.0f} s |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
