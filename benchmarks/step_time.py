"""Training-step time of a patched model as a ratio to stock HF, measured in one run with interleaved A/B steps.

A first look at what alignment costs; the performance issue builds the full suite (per op, memory, compiled).
Each round runs one step (forward, backward) of every variant in turn, so machine drift hits all of them alike,
and the ratio uses medians.

    .venv/bin/python benchmarks/step_time.py                      # 2-layer, 1024-wide Qwen3, 2 x 512 tokens
    .venv/bin/python benchmarks/step_time.py --layers 4 --rounds 10
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import transformers

import roundalign


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=6, help="steps per variant; the first is warm-up")
    parser.add_argument("--profiles", default="vllm,vllm-eager-legacy,aligned")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        head_dim=64,
        vocab_size=8192,
    )
    variants = {"stock": None, **{p: p for p in args.profiles.split(",")}}
    models = {}
    for name, profile in variants.items():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).train()
        models[name] = roundalign.apply(model, profile) if profile else model
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))

    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            model(ids).logits.float().logsumexp(-1).mean().backward()
            times[name].append(time.perf_counter() - start)

    print(
        f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, transformers {transformers.__version__}"
    )
    print(f"model: Qwen3 hidden {args.hidden}, {args.layers} layers; batch {args.batch} x {args.seq} tokens")
    stock = statistics.median(times["stock"][1:])
    for name, values in times.items():
        median = statistics.median(values[1:])
        print(f"{name:20s} median {median * 1e3:8.1f} ms   ratio to stock {median / stock:.2f}")


if __name__ == "__main__":
    main()
