#!/usr/bin/env python
"""Which rounding rules does a compiled vLLM-structured Qwen3 follow? Bitwise logit agreement, measured on the CPU.

Builds a tiny random bf16 Qwen3 (``tiny_qwen3`` in tests/vllm_native.py), runs vLLM's ``forward_native`` structure
(the engine's ``roundalign.engine.native.NativeModel``, as ``VllmQwen3`` over the HF weights) compiled with Inductor
two ways (one whole graph; piecewise, split at every attention op as vLLM's backend does) and compares its logits
bit for bit against:

- stock HF (unpatched);
- ``roundalign.apply(model, "vllm", qk_norm=...)`` for each q/k-norm rule;
- the same formulas (``formula_forward``) with the residual rounded where the compiled engine rounds it:
  ``every_add`` (= roundalign's ``normalize_fp32_sum``), ``at_attention`` (only between pieces), ``never``.

It also checks the first attention's q and k, whose inputs are identical on both sides (no error propagation),
against each q/k-norm rule. Usage, from the repository root:

    .venv/bin/python scripts/measure_qk_norm.py                          # the tables in docs/qk-norm.md
    .venv/bin/python scripts/measure_qk_norm.py --prompts 1 --tokens 300  # one long sequence
    .venv/bin/python scripts/measure_qk_norm.py --seed 3 --static --merged --code
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.vllm_native import MODES, QK_RULES, measure_qwen3, prompts, tiny_qwen3  # noqa: E402


def fp32_hidden_buffers(code: str, hidden: int) -> list[str]:
    """Inductor wrapper lines that allocate an fp32 (tokens, hidden) buffer: a residual sum kept in fp32."""
    pat = re.compile(rf"empty_strided_cpu\(\(\w+, {hidden}\), \({hidden}, 1\), torch\.float32\)")
    return [line.strip() for line in code.splitlines() if pat.search(line)]


def embedding_recomputes(code: str) -> list[str]:
    """Kernel calls in the wrapper that read the embedding table after the first layer (residual recomputed)."""
    calls = [m.group(1) for line in code.splitlines() if (m := re.match(r"\s*(cpp_fused\w+)\(", line))]
    return [c for c in calls[1:] if "embedding" in c]


def table(out: dict) -> str:
    lines = ["| reference | whole graph | piecewise |", "|---|---|---|"]
    ag = out["agreement"]
    for name in ag[MODES[0]]:
        cells = []
        for mode in MODES:
            a = ag[mode][name]
            pct = 100 * a["fraction"]
            cells.append(f"{a['equal']}/{a['total']} = {pct:.1f}% ({a['prompts_equal']}/{a['prompts']})")
        lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    lines += [
        "",
        "First attention's q and k (identical inputs on both sides): elements that differ from each rule",
        "",
        "| q/k norm rule | whole graph | piecewise |",
        "|---|---|---|",
    ]
    qk = out["first_attention_qk"]
    for rule in QK_RULES:
        cells = [f"{qk[m][rule][0]}/{qk[m][rule][1]}" for m in MODES]
        lines.append(f"| {rule} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=16, help="independent sequences (default 16)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--static", action="store_true", help="static shapes (default: token dim dynamic, as vLLM)")
    p.add_argument("--merged", action="store_true", help="one qkv GEMM and one gate_up GEMM, as vLLM")
    p.add_argument("--code", action="store_true", help="inspect Inductor's wrapper code for fp32 residual buffers")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    hf = tiny_qwen3(seed=args.seed, num_hidden_layers=args.layers, head_dim=args.head_dim)
    ids = prompts(hf.config.vocab_size, args.prompts, args.tokens, seed=args.seed + 1)
    out = measure_qwen3(hf, ids, dynamic=not args.static, merged=args.merged, code=args.code)
    code = out.pop("code")
    if args.code:
        hidden = hf.config.hidden_size
        out["inductor"] = {
            m: {
                "fp32_hidden_buffers": fp32_hidden_buffers(code[m], hidden),
                "kernels_reading_embedding_after_layer0": embedding_recomputes(code[m]),
            }
            for m in code
        }
    out["config"] = vars(args)
    out["torch"] = torch.__version__
    if args.json:
        print(json.dumps(out, indent=1, default=str))
        return 0
    print(f"torch {out['torch']}, config {out['config']}")
    print("compile + first prompt (s): " + ", ".join(f"{m} {s:.1f}" for m, s in out["seconds"].items()))
    print(f"eager engine vs per-op formula: {out['eager_vs_per_op_formula']}")
    print(f"eager engine vs roundalign.apply with per-op rules: {out['eager_vs_apply_per_op']}")
    print(f"formula == roundalign.apply, per residual carry and q/k rule: {out['formula_equals_apply']}")
    print("cells: logits bitwise equal / total = fraction (prompts whose logits are all equal)\n")
    print(table(out))
    for mode, info in out.get("inductor", {}).items():
        print(f"\n{mode}: fp32 (tokens, hidden) buffers: {info['fp32_hidden_buffers']}")
        print(
            f"{mode}: kernels after layer 0 that re-read the embedding table: "
            f"{info['kernels_reading_embedding_after_layer0']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
