"""Generation throughput of roundalign.engine (each backend) against HF ``generate``, same model, batch and sampling.

Both sides sample the same number of tokens: a ragged batch of prompts (HF gets it left-padded with an attention
mask, the engine flattened), ``max_tokens`` new tokens each (HF: ``min_new_tokens = max_new_tokens``; the engine:
``ignore_eos``), temperature/top-p/top-k as given (HF's default top-k of 50 is turned off unless asked for).
Rounds are interleaved (HF, kernels, inductor, HF, ...) so that machine drift hits every side alike; the first
round is warm-up (and the inductor backend's compile, reported separately). Tokens/s and ratios use medians.

    .venv/bin/python benchmarks/engine_throughput.py                   # the shipped tiny-qwen3 if present
    .venv/bin/python benchmarks/engine_throughput.py --random          # a random tiny Qwen3 (hidden 256, 4 layers)
    .venv/bin/python benchmarks/engine_throughput.py --batch 16 --max-tokens 128 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import transformers
from _machine import cpu_model, isa_flags

from roundalign.engine import Engine, SamplingParams


def _model(args):
    """(HF model, description): the shipped model unless --random or --model, a random tiny Qwen3 as fallback."""
    path = args.model
    if path is None and not args.random:
        try:
            import roundalign.models

            path = roundalign.models.path("tiny-qwen3")
        except (ImportError, ValueError, FileNotFoundError) as e:
            print(f"(no shipped tiny-qwen3: {e}; using a random tiny Qwen3)")
    if path is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
        return model.eval(), str(path)
    torch.manual_seed(args.seed)
    config = transformers.Qwen3Config(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=512,
        max_position_embeddings=1024,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval(), "random Qwen3 (hidden 256, 4 layers, head_dim 64, vocab 512)"


def _hf_runner(model, prompts, args):
    pad = 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left-padded, as HF generate wants
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    gen = transformers.GenerationConfig(
        do_sample=args.temperature > 0,
        temperature=args.temperature or None,
        top_p=args.top_p,
        top_k=args.top_k,
        max_new_tokens=args.max_tokens,
        min_new_tokens=args.max_tokens,
        pad_token_id=pad,
        eos_token_id=model.config.eos_token_id,
    )

    def run() -> int:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, generation_config=gen)
        return (out.shape[1] - width) * out.shape[0]

    return run


def _engine_runner(engine, prompts, args):
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
        ignore_eos=True,
    )

    def run() -> int:
        return sum(len(o.token_ids) for o in engine.generate(prompts, params))

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # model
    p.add_argument("--model", help="a model directory (default: the shipped tiny-qwen3)")
    p.add_argument("--random", action="store_true", help="a random tiny Qwen3 instead of the shipped model")
    # batch and sampling
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-min", type=int, default=8)
    p.add_argument("--prompt-max", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    # measurement
    p.add_argument("--backends", default="kernels,inductor")
    p.add_argument("--profile", default="vllm")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds; the first is warm-up")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    print(f"args: {vars(args)}")
    if args.threads:
        torch.set_num_threads(args.threads)

    model, desc = _model(args)
    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(args.prompt_min, args.prompt_max + 1, (args.batch,), generator=g).tolist()
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]

    runners = {"hf generate": _hf_runner(model, prompts, args)}
    engines = {}
    for b in args.backends.split(","):
        engines[b] = Engine(model, profile=args.profile, backend=b)
        runners[f"engine {b}"] = _engine_runner(engines[b], prompts, args)
    seconds: dict[str, list[float]] = {name: [] for name in runners}
    tokens: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, run in runners.items():
            t0 = time.perf_counter()
            tokens[name] = run()
            seconds[name].append(time.perf_counter() - t0)

    print(
        f"machine: {cpu_model()} ({' '.join(isa_flags())}), {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} torch threads, load average {os.getloadavg()[0]:.1f} at the end; "
        f"torch {torch.__version__}, transformers {transformers.__version__}"
    )
    print(
        f"model: {desc}; batch {args.batch}, prompts {min(lengths)}-{max(lengths)} tokens, "
        f"{args.max_tokens} new tokens each"
    )
    for b, eng in engines.items():
        if eng.compile_stats["graphs"]:
            print(
                f"engine {b}: compiled {eng.compile_stats['graphs']} graph(s), {eng.compile_stats['pieces']} "
                f"pieces in {eng.compile_stats['seconds']:.1f} s (warm-up round, not counted)"
            )
    hf = tokens["hf generate"] / statistics.median(seconds["hf generate"][1:])
    for name in runners:
        rate = tokens[name] / statistics.median(seconds[name][1:])
        print(f"{name:18s} {rate:9.1f} tokens/s   ratio to hf generate {rate / hf:5.2f}")


if __name__ == "__main__":
    main()
