"""What the exact trainer costs: a training step and a log-prob recompute with vLLM's kernels, against stock HF.

The ``-kernels`` profiles run vLLM's own CPU attention and GEMM in the trainer (docs/kernels.md), so this suite runs
in the engine's Python, where vLLM's ops load (``make vllm``: .venv-vllm). Three variants of one model, from the
same weights:

- ``stock``: HF as loaded (SDPA, torch's linear);
- ``rounding``: ``roundalign.apply`` with the vLLM build's rounding profile alone (HF's kernels);
- ``exact``: the same profile with vLLM's kernels (``-kernels``): bitwise equal to vLLM's sampler in eager mode.

Each on an RL-shaped batch: right-padded sequences of several lengths, ``attention_mask`` and ``position_ids``
from the mask, as verl and TRL hand them to the model. Three passes per variant, each where an RL loop runs it:

- ``train step``: forward, backward of the summed token log-probs, AdamW, after another train step (the update
  phase: every forward follows an optimizer step, so the exact variant prepares vLLM's GEMM weights in each);
- ``recompute``: a no-grad forward and the log-softmax (verl's old_log_prob) on weights the forward before it
  already saw: a micro-batch of the recompute pass after its first;
- ``first recompute``: the same, first after an optimizer step: the recompute pass's first micro-batch, which
  also pays the exact variant's once-per-weight-change preparation (reported, no target of its own: an RL
  recompute pass runs many micro-batches on one set of weights).

Rounds interleave the variants (machine drift hits all alike), round 1 is warm-up, the table gives medians, ratios
to stock in the same run and their noise band (the quartiles of the per-round ratios), then one more step per
variant measures the peak memory of forward + backward (``torch.profiler``, as benchmarks/model_step.py measures
it).

    .venv-vllm/bin/python benchmarks/exact_step.py --quick                     # a smoke run
    .venv-vllm/bin/python benchmarks/exact_step.py --json exact.json           # the suite (~20 min on 2 cores)
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import time

import torch
import transformers
from _machine import machine_info, write_json
from model_step import MODELS, build_model, measure_peak, ratio_band

import roundalign
from roundalign.engines.vllm.profile import trainer_profile

VARIANTS = ("stock", "rounding", "exact")
PASSES = ("train step", "first recompute", "recompute")
# (model, batch, longest sequence, rounds)
# Sized for about 20 minutes on a 2-core AVX2 CPU, where a bf16 training step is slow (8 x 128 tokens of the tiny
# model: ~7 s; one of benchmarks/model_step.py's 0.6B shape did not finish 12 steps in 25 minutes). The second
# case has Qwen3-0.6B's layers (head_dim 128, 16 q / 8 kv heads) and a 16k vocabulary. Pass --model qwen3-0.6b-2l
# (the real 151,936-token vocabulary) on a machine with native bf16 GEMMs (AVX512-BF16, AMX).
FULL_CASES = (("tiny-qwen3", 8, 128, 10), ("qwen3-0.6b-2l-v16k", 2, 128, 4))
QUICK_CASES = (("tiny-qwen3", 2, 32, 2),)


def rl_batch(vocab: int, batch: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    """Right-padded rows from ``seq`` down to ``seq / 2`` tokens, with their mask and per-sequence positions."""
    g = torch.Generator().manual_seed(seed)
    lengths = [seq - (seq // 2) * i // max(1, batch - 1) for i in range(batch)]
    ids = torch.randint(1, vocab, (batch, seq), generator=g)
    mask = (torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}


class Variant:
    def __init__(self, model, batch: dict[str, torch.Tensor]):
        self.model, self.batch = model.train(), batch
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        self.targets = batch["input_ids"][:, 1:]
        self.keep = batch["attention_mask"][:, 1:].bool()

    def loss(self) -> torch.Tensor:
        logits = self.model(**self.batch).logits[:, :-1].float()
        logp = logits.log_softmax(-1).gather(-1, self.targets[..., None])[..., 0]
        return -(logp * self.keep).sum() / self.keep.sum()

    def forward_backward(self) -> None:
        self.loss().backward()

    def train_step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.forward_backward()
        self.opt.step()

    def recompute(self) -> None:
        with torch.no_grad():
            self.loss()


def run_case(name: str, batch: int, seq: int, rounds: int, seed: int, profiles: dict[str, str]) -> list[dict]:
    torch.manual_seed(seed)
    base = build_model(name)
    inputs = rl_batch(base.config.vocab_size, batch, seq, seed)
    variants = {
        v: Variant(base if v == "stock" else roundalign.apply(copy.deepcopy(base), profiles[v]), inputs)
        for v in VARIANTS
    }
    times = {(v, p): [] for v in VARIANTS for p in PASSES}
    for _ in range(rounds):
        for v, runner in variants.items():
            runner.train_step()  # the step before: the timed one's forward follows an optimizer step
            for p, fn in zip(PASSES, (runner.train_step, runner.recompute, runner.recompute), strict=True):
                start = time.perf_counter()
                fn()
                times[(v, p)].append(time.perf_counter() - start)
    peaks = {}
    for v, runner in variants.items():
        runner.opt.zero_grad(set_to_none=True)
        peaks[v] = measure_peak(runner.forward_backward)[1]
    rows = []
    for p in PASSES:
        for v in VARIANTS:
            median = statistics.median(times[(v, p)][1:])
            rows.append({
                "name": name, "shape": f"{batch}x{seq}", "pass": p, "variant": v,
                "profile": profiles.get(v, "stock HF"), "time_ms": median * 1e3,
                "times_ms": [t * 1e3 for t in times[(v, p)]], "peak_bytes": peaks[v] if p == PASSES[0] else None,
            })  # fmt: skip
        stock = rows[-len(VARIANTS)]
        for row in rows[-len(VARIANTS) :]:
            row["time_ratio"] = row["time_ms"] / stock["time_ms"]
            row["time_band"] = ratio_band(row["times_ms"][1:], stock["times_ms"][1:])
            if row["peak_bytes"] is not None:
                row["peak_ratio"] = row["peak_bytes"] / stock["peak_bytes"]
    del variants, base
    gc.collect()
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [f"{'model':<15}{'shape':>9} {'pass':<16}{'variant':<10}{'time ms':>10}{'x stock':>9}{'band':>11}"
             f"{'peak MiB':>10}{'x stock':>9}"]  # fmt: skip
    for r in rows:
        peak = f"{r['peak_bytes'] / 2**20:>10.1f}{r['peak_ratio']:>8.3f}x" if r["peak_bytes"] is not None else ""
        lines.append(
            f"{r['name']:<15}{r['shape']:>9} {r['pass']:<16}{r['variant']:<10}{r['time_ms']:>10.1f}"
            f"{r['time_ratio']:>8.3f}x{'{:.2f}-{:.2f}'.format(*r['time_band']):>11}{peak}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny-qwen3 at 2 x 32 tokens, 2 rounds: a smoke run")
    ap.add_argument("--rounds", type=int, help="rounds per case, the first is warm-up")
    ap.add_argument("--model", choices=MODELS, help="one model instead of the suite's cases")
    ap.add_argument("--batch", type=int, help="with --model: rows per batch (default 8 for tiny-qwen3, else 1)")
    ap.add_argument("--seq", type=int, help="with --model: the longest row's tokens (default 128, 512 for 0.6B)")
    ap.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                    help="the vLLM mode whose profile to time (default: eager, the exact one)")  # fmt: skip
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="write {suite, machine, results} here")
    args = ap.parse_args(argv)
    if args.rounds is not None and args.rounds < 2:
        ap.error(f"--rounds must be at least 2 (round 1 is warm-up), got {args.rounds}")
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    exact = trainer_profile(args.enforce_eager)
    profiles = {"rounding": roundalign.get_profile(exact).rounding_only().name, "exact": exact}
    machine = machine_info()
    print(f"machine: {machine['cpu']}, {machine['torch_threads']} torch threads, torch {machine['torch']}")
    print(f"profiles: rounding = {profiles['rounding']}, exact = {profiles['exact']}; medians, ratios to stock")
    rows = []
    cases = QUICK_CASES if args.quick else FULL_CASES
    if (args.batch or args.seq) and not args.model:
        ap.error("--batch and --seq size the --model case; the suite's cases have their own")
    if args.model:
        tiny = args.model == "tiny-qwen3"
        batch, seq = args.batch or (8 if tiny else 1), args.seq or (128 if tiny else 512)
        cases = ((args.model, batch, seq, 10 if tiny else 4),)
    for name, batch, seq, rounds in cases:
        rows.extend(run_case(name, batch, seq, args.rounds or rounds, args.seed, profiles))
        print(format_table(rows), flush=True)  # after each case: a long suite shows what it has
    result = {"suite": "exact", "machine": machine, "results": rows}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
