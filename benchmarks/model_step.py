"""Model-level cost of alignment: one full training step (forward, backward, AdamW) against stock HF, same run.

The per-op suite (benchmarks/ops.py) says what each rounding point costs in isolation; this one says what a
trainer pays for a whole step. Two models:

- ``tiny-qwen3``: the shipped model (hidden 256, 4 layers), a batch of 8 x 128 random token ids;
- ``qwen3-0.6b-2l``: Qwen3-0.6B's shape (hidden 1024, intermediate 3072, 16 q / 8 kv heads, head_dim 128, the real
  vocab of 151936, tied embeddings as in the real model) cut to 2 layers, random init from a config, bf16;
  ``qwen3-0.6b-2l-v16k`` is the same with a 16,384-token vocabulary (benchmarks/exact_step.py's second shape, sized
  for a CPU without native bf16 GEMMs).

Variants: ``stock`` (HF as loaded), ``aligned`` and ``vllm`` (``roundalign.apply`` on a deep copy, so all start
from the same weights, with apply's defaults: the ops' fused kernels wherever Inductor can compile), and
``aligned+eager_ops`` (``apply(..., compile_ops=False)``: the eager ops, which were the default before issue 18).
Modes: ``eager`` and ``compiled`` (``model.compile()``: Dynamo + Inductor over the model's forward, loss included
since HF computes it there; AOTAutograd compiles the backward, and the ops are traced into the graph, fused with
their neighbours; the AdamW step stays eager). Each round runs one step of every variant in turn (interleaved, so
machine drift hits all alike); round 1 is warm-up (and compilation); the table gives medians and ratios to the
stock row of the same case and mode. ``time_band`` is the noise band of a time ratio: the quartiles of the per-round
ratios (each round's step time over stock's in the same round), so a ratio whose band holds 1.00 is a tie within
the run's noise.

``--gemm``: what the linear layers' GEMMs run as, the same in every variant. ``native`` is the model's bf16 GEMM.
``fp32`` computes each ``F.linear`` in fp32 and rounds its output to bf16 once: on a CPU without native bf16 GEMMs
(no AVX512-BF16 or AMX), torch's bf16 GEMM is an emulated path several times slower than fp32, which buries the
element-wise regions this suite measures under GEMM time (a tiny-qwen3 step took 9 s). ``auto`` (the default)
times both on a 1024-cube GEMM and takes ``fp32`` when bf16 is more than twice as slow; the choice is printed and
kept in the JSON (``gemm``).

After the timed rounds, one more step per variant measures memory (never timed):
- ``saved_bytes``: activation bytes saved for backward over the whole forward, from
  ``torch.autograd.graph.saved_tensors_hooks``, each distinct storage once, parameters left out (they are the same
  for every variant; ``saved_param_bytes`` has them);
- ``peak_bytes``: the peak of the running sum of the allocator events that ``torch.profiler`` records with
  ``profile_memory=True`` over forward + backward, relative to the memory held when the step starts. The AdamW
  step is left out of it because it is the same for every variant and, on a small model, its foreach temporaries
  are the step's peak and would hide the activations; ``step_peak_bytes`` is the peak of the whole step with it.

    .venv/bin/python benchmarks/model_step.py --quick                # tiny shapes, 2 rounds: a smoke run
    .venv/bin/python benchmarks/model_step.py --json model.json      # the full suite (~7 min on 2 cores)
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import time
from collections.abc import Callable

import torch
import transformers
from _machine import machine_info, write_json

import roundalign

# stock first: the others' ratios divide by it. "+eager_ops": apply(..., compile_ops=False), the eager ops.
VARIANTS = ("stock", "aligned", "vllm", "aligned+eager_ops")
MODES = ("eager", "compiled")
PASS = "train step"
# (model, batch, seq, modes, rounds). Sized for about 8 of `make bench`'s 15 minutes on 2 cores. The 0.6B-wide case
# has a 4,096-token vocabulary, so that the LM head does not hide the element-wise regions (with the real 151,936
# the head is most of a 2-layer step: `--cases qwen3-0.6b-2l` runs it). tiny-qwen3's step takes about 0.1 s, so
# 30 rounds cost little; with 12, aligned and aligned+eager_ops (which compile the same graph) came out 1.034x and
# 0.998x in one compiled run, with 40 rounds 0.993x and 1.002x (Zen 4, 2026-12-03).
FULL_CASES = (
    ("tiny-qwen3", 8, 128, MODES, 30),
    ("qwen3-0.6b-2l-v4k", 1, 512, ("eager",), 8),
    ("qwen3-0.6b-2l-v4k", 1, 1024, MODES, 8),
    ("qwen3-0.6b-2l-v4k", 1, 2048, ("eager",), 6),
)
EXTRA_CASES = (("qwen3-0.6b-2l", 1, 512, MODES, 8),)
QUICK_CASES = (("tiny-qwen3", 2, 32, MODES, 2),)


def build_model(name: str) -> transformers.PreTrainedModel:
    """The stock bf16 model for ``name``; call after seeding, so that random init is reproducible."""
    if name == "tiny-qwen3":
        return transformers.AutoModelForCausalLM.from_pretrained(
            roundalign.models.path("tiny-qwen3"), dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    if name in VOCAB:
        config = transformers.Qwen3Config(
            hidden_size=1024, intermediate_size=3072, num_hidden_layers=2, num_attention_heads=16,
            num_key_value_heads=8, head_dim=128, vocab_size=VOCAB[name],
            tie_word_embeddings=True, max_position_embeddings=40960, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )  # fmt: skip
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    raise ValueError(f"unknown benchmark model {name!r}; choose one of {', '.join(MODELS)}")


VOCAB = {"qwen3-0.6b-2l": 151936, "qwen3-0.6b-2l-v16k": 16384, "qwen3-0.6b-2l-v4k": 4096}
MODELS = ("tiny-qwen3", *VOCAB)


def _fp32_linear(x, weight, bias=None):
    """The GEMM stand-in (``--gemm fp32``): ``F.linear`` in fp32, its output rounded to the input's dtype once."""
    out = _LINEAR(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(x.dtype)


_LINEAR = torch.nn.functional.linear


def choose_gemm(gemm: str) -> tuple[str, str]:
    """(``native`` or ``fp32``, why) for ``--gemm``; installs the stand-in for ``fp32``."""
    why = "asked for"
    if gemm == "auto":
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        cost = {}
        for dtype in (torch.float32, torch.bfloat16):
            x, w = a.to(dtype), b.to(dtype)
            _LINEAR(x, w)
            start = time.perf_counter()
            for _ in range(3):
                _LINEAR(x, w)
            cost[dtype] = time.perf_counter() - start
        slower = cost[torch.bfloat16] / cost[torch.float32]
        gemm = "fp32" if slower > 2 else "native"
        why = f"bf16 GEMM {slower:.1f}x the time of fp32 on this CPU"
    if gemm == "fp32":
        torch.nn.functional.linear = _fp32_linear
    return gemm, why


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def measure_saved(fn: Callable[[], object], exclude: set[int] = frozenset()) -> tuple[object, int, int]:
    """Run ``fn`` with a saved-tensors hook; return (its result, saved bytes, saved bytes in ``exclude``).

    Each distinct storage counts once, at its full size (a view keeps its whole storage alive). Storages whose
    ``storage_key`` is in ``exclude`` (the parameters) are summed apart.
    """
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.setdefault(storage_key(t), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    excluded = sum(n for k, n in seen.items() if k in exclude)
    return out, sum(seen.values()) - excluded, excluded


def measure_peak(fn: Callable[[], object]) -> tuple[object, int, int]:
    """Run ``fn`` under ``torch.profiler`` with ``profile_memory=True``; return (its result, peak, net bytes).

    The peak is the maximum of the running sum of the allocation events (frees are negative), in time order,
    starting from zero: memory allocated beyond what was held when ``fn`` started. ``net`` is the sum at the end
    (what ``fn`` left allocated), so that a later call's peak can be put on the same baseline.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, e.extra_fields.alloc_size))
        stack.extend(e.children)
    running = peak = 0
    for _, size in sorted(events):
        running += size
        peak = max(peak, running)
    return out, peak, running


class Trainer:
    """One variant: a model, its AdamW and the batch; ``step`` is the measured unit."""

    def __init__(self, model: torch.nn.Module, ids: torch.Tensor):
        self.model, self.ids = model.train(), ids
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        self.param_keys = {storage_key(p) for p in model.parameters()}

    def forward(self) -> torch.Tensor:
        return self.model(input_ids=self.ids, labels=self.ids).loss

    def step(self) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = self.forward()
        loss.backward()
        self.opt.step()
        return loss.item()

    def forward_backward_saved(self) -> tuple[int, int]:
        loss, saved, saved_params = measure_saved(self.forward, self.param_keys)
        loss.backward()
        return saved, saved_params

    def measured_step(self) -> dict[str, int]:
        """Saved activation and parameter bytes, the forward+backward peak and the whole step's peak, in bytes."""
        self.opt.zero_grad(set_to_none=True)
        (saved, saved_params), peak, net = measure_peak(self.forward_backward_saved)
        _, opt_peak, _ = measure_peak(self.opt.step)
        return {"saved_bytes": saved, "saved_param_bytes": saved_params, "peak_bytes": peak,
                "step_peak_bytes": max(peak, net + opt_peak)}  # fmt: skip


def run_case(name: str, batch: int, seq: int, mode: str, rounds: int, seed: int) -> list[dict]:
    """Rows for one (model, shape, mode): every variant, interleaved over ``rounds`` (the first is warm-up)."""
    torch.manual_seed(seed)
    base = build_model(name)
    ids = torch.randint(0, base.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    trainers = {}
    for variant in VARIANTS:
        profile, _, fused = variant.partition("+")
        compile_ops = False if fused == "eager_ops" else None  # None: apply's default
        model = base if variant == "stock" else roundalign.apply(copy.deepcopy(base), profile, compile_ops=compile_ops)
        if mode == "compiled":
            model.compile()
        trainers[variant] = Trainer(model, ids)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for variant, trainer in trainers.items():
            start = time.perf_counter()
            trainer.step()
            times[variant].append(time.perf_counter() - start)
    memory = {v: t.measured_step() for v, t in trainers.items()}  # after timing: the profiler slows a step

    rows = []
    for variant in VARIANTS:
        median = statistics.median(times[variant][1:])
        rows.append({
            "name": name, "variant": variant, "mode": mode, "pass": PASS, "shape": f"{batch}x{seq}",
            "time_ms": median * 1e3, "times_ms": [t * 1e3 for t in times[variant]], **memory[variant],
            "compile_s": max(0.0, times[variant][0] - median) if mode == "compiled" else None,
        })  # fmt: skip
    stock = rows[0]
    for row in rows:
        row["time_ratio"] = row["time_ms"] / stock["time_ms"]
        row["time_band"] = ratio_band(row["times_ms"][1:], stock["times_ms"][1:])
        row["saved_ratio"] = row["saved_bytes"] / stock["saved_bytes"]
        row["peak_ratio"] = row["peak_bytes"] / stock["peak_bytes"]
    del trainers, base
    gc.collect()
    torch._dynamo.reset()  # each case compiles afresh: no recompile limit, no shapes marked dynamic by a prior case
    return rows


def ratio_band(times: list[float], stock_times: list[float]) -> list[float]:
    """The quartiles of the per-round ratios ``times[i] / stock_times[i]`` (both without the warm-up round)."""
    ratios = [t / s for t, s in zip(times, stock_times, strict=True)]
    if len(ratios) < 2:
        return [ratios[0], ratios[0]]
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return [q1, q3]


def format_table(rows: list[dict]) -> str:
    head = (f"{'model':<15}{'shape':>9} {'mode':<9}{'variant':<9}{'time ms':>10}{'x stock':>9}"
            f"{'band':>12}{'saved MiB':>11}{'x stock':>9}{'peak MiB':>10}{'x stock':>9}{'compile s':>11}")  # fmt: skip
    lines = [head]
    for r in rows:
        comp = f"{r['compile_s']:.1f}" if r["compile_s"] is not None else "-"
        lines.append(
            f"{r['name']:<15}{r['shape']:>9} {r['mode']:<9}{r['variant']:<9}{r['time_ms']:>10.1f}"
            f"{r['time_ratio']:>8.3f}x{'{:.2f}-{:.2f}'.format(*r['time_band']):>12}"
            f"{r['saved_bytes'] / 2**20:>11.1f}{r['saved_ratio']:>8.3f}x"
            f"{r['peak_bytes'] / 2**20:>10.1f}{r['peak_ratio']:>8.3f}x{comp:>11}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny-qwen3 at 2 x 32 tokens, 2 rounds: a smoke run")
    ap.add_argument(
        "--rounds",
        type=int,
        help="rounds per case, the first is warm-up (default: 30 for tiny-qwen3, "
        "8 or 6 for the 0.6B shape, 2 with --quick)",
    )
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of eager,compiled")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gemm", choices=("auto", "native", "fp32"), default="auto", help="see the docstring")
    ap.add_argument(
        "--cases", help="comma-separated models to run (default: the full suite's); adds the real-vocab case"
    )
    ap.add_argument("--json", metavar="PATH", help="write {suite, machine, results} here")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        ap.error(f"--modes takes a comma-separated subset of {', '.join(MODES)}; got {args.modes!r}")
    rounds = args.rounds
    if rounds is not None and rounds < 2:
        ap.error(f"--rounds must be at least 2 (round 1 is warm-up), got {rounds}")
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()

    machine = machine_info()
    machine["gemm"], why = choose_gemm(args.gemm)
    print(
        f"machine: {machine['cpu']}, {machine['logical_cpus']} logical CPUs, {machine['torch_threads']} torch "
        f"threads, torch {machine['torch']}, transformers {machine['transformers']}, {machine['date']}"
    )
    print(f"{PASS}: forward + backward + AdamW; round 1 warm-up; medians; ratios to stock in the same run; band: "
          "the quartiles of the per-round ratios")  # fmt: skip
    print(f"linear layers' GEMMs: {machine['gemm']} ({why})")
    cases = QUICK_CASES if args.quick else FULL_CASES + EXTRA_CASES
    if args.cases:
        wanted = set(args.cases.split(","))
        if wanted - set(MODELS):
            ap.error(f"--cases takes models from {', '.join(MODELS)}; got {args.cases!r}")
        cases = [c for c in cases if c[0] in wanted]
    elif not args.quick:
        cases = FULL_CASES
    rows = []
    try:
        for name, batch, seq, case_modes, case_rounds in cases:
            for mode in case_modes:
                if mode in modes:
                    rows.extend(run_case(name, batch, seq, mode, rounds or case_rounds, args.seed))
    finally:
        torch.nn.functional.linear = _LINEAR  # the stand-in, if any, ends with the suite (tests run it in-process)
    print(format_table(rows))
    result = {"suite": "model", "machine": machine, "results": rows}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
