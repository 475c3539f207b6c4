"""Per-op cost of alignment: stock HF against roundalign.ops under each rule, time and activation memory.

The four regions whose rounding points a profile sets, at Qwen3-0.6B and Qwen3-8B widths, bf16, batch 1:

- ``rms_norm``: HF's ``Qwen3RMSNorm`` module against ``ops.rms_norm`` (round_before_weight, round_after_weight);
- ``add_rms_norm``: the post-attention residual add and the norm after it, as HF's decoder layer writes it
  (``residual + hidden_states``, then the norm) against ``ops.residual_add`` + ``ops.rms_norm`` as the patched
  decoder layer runs them, for the (norm rule, residual rule) pairs the profiles use, plus ``never_round``. Under
  ``never_round`` the incoming residual is the fp32 sum ``S``, and under it and ``round_at_attention`` the layer
  carries ``S`` (fp32) on to the MLP's add instead of ``R``: both outputs are what that layer returns there;
- ``rope``: HF's ``apply_rotary_pos_emb`` on q and k, transposed views of ``(B, T, H, D)`` as HF's attention hands
  them over, with HF's own rotary embedding's cos/sin, against ``ops.rope`` per cos/sin dtype x rounding;
- ``swiglu``: ``Qwen3MLP.act_fn(gate) * up`` (HF's MLP minus its projections) against ``ops.swiglu``.

Every aligned variant also runs as ``<rule>+compile_ops``: the op's Inductor-fused variant (``compiled=True``,
what ``roundalign.apply`` uses by default), bitwise equal to the eager op.

Each is timed forward (under ``no_grad``) and forward+backward (against fixed random output grads), eager and
``torch.compile``'d (Inductor; the same Python callable is compiled for stock and aligned, one fresh compile per
shape). Every round runs each variant of a case once, in turn; the first round is warm-up (and, compiled, the
compile, reported as ``compile_s``); times are medians. Memory, measured once after the timed rounds:
``saved_bytes``, the bytes saved for backward (``saved_tensors_hooks``, each storage once), and ``peak_bytes``, the
peak of the running sum of the CPU allocations and frees the profiler records during the pass
(``torch.profiler.profile(profile_memory=True)``), i.e. the most memory the pass held beyond its inputs.

    .venv/bin/python benchmarks/ops.py --quick                      # tiny shapes, 2 rounds: a smoke test
    .venv/bin/python benchmarks/ops.py --json ops.json              # the default suite (about 7 min on 2 cores)
    .venv/bin/python benchmarks/ops.py --ops rope --models qwen3-8b --seqs 4096 --modes eager --rounds 7
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers
from _machine import machine_info, write_json
from model_step import measure_peak
from transformers.models.qwen3 import modeling_qwen3 as hf

from roundalign import ops
from roundalign.profiles import SEARCHED_ROPE_RULES

# (hidden, intermediate, q heads, kv heads, head_dim), from the models' config.json.
MODELS = {
    "qwen3-0.6b": (1024, 3072, 16, 8, 128),
    "qwen3-8b": (4096, 12288, 32, 8, 128),
    "tiny": (64, 128, 4, 2, 16),  # --quick only
}
# The default suite: every op at every model x seq listed here fits the ~7 min budget on a 2-core CPU only with
# seq 4096 at 0.6B width and 512/2048 at 8B width; --seqs overrides both.
DEFAULT_SEQS = {"qwen3-0.6b": (512, 1024, 2048, 4096), "qwen3-8b": (512, 2048)}
OPS = ("rms_norm", "add_rms_norm", "rope", "swiglu")
PASSES = ("forward", "forward+backward")
EPS = 1e-6
FUSED = {False: "", True: "+compile_ops"}  # variant-name suffix of the ops' Inductor-fused variants
ROPE_THETA = 1_000_000.0  # Qwen3-0.6B and Qwen3-8B


@dataclass
class Variant:
    name: str  # "stock" or the rule(s)
    fn: Callable  # fn(*inputs) -> tensor or tuple of tensors
    inputs: tuple  # tensors; the float leaves that require grad get gradients in forward+backward


def _leaf(*shape, dtype=torch.bfloat16, scale=1.0, shift=0.0):
    return (torch.randn(*shape) * scale + shift).to(dtype).requires_grad_(True)


def _config(model: str) -> transformers.Qwen3Config:
    hidden, inter, heads, kv, head_dim = MODELS[model]
    return transformers.Qwen3Config(
        hidden_size=hidden,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        num_hidden_layers=1,
        rope_parameters={"rope_theta": ROPE_THETA, "rope_type": "default"},
    )


def variants(op: str, model: str, seq: int) -> list[Variant]:
    """The stock variant first, then one per rule, all reading the same input tensors (seeded per case)."""
    torch.manual_seed(0)
    cfg = _config(model)
    hidden, inter, heads, kv, head_dim = MODELS[model]
    if op == "rms_norm":
        norm = hf.Qwen3RMSNorm(hidden, eps=EPS).to(torch.bfloat16)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(hidden))
        x = _leaf(1, seq, hidden)
        out = [Variant("stock", lambda x, w: norm(x), (x, norm.weight))]
        for rule in ("round_before_weight", "round_after_weight"):
            for c in (False, True):
                out.append(
                    Variant(
                        rule + FUSED[c],
                        lambda x, w, rule=rule, c=c: ops.rms_norm(x, w, EPS, rule, compiled=c),
                        (x, norm.weight),
                    )
                )
        return out
    if op == "add_rms_norm":
        norm = hf.Qwen3RMSNorm(hidden, eps=EPS).to(torch.bfloat16)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(hidden))
        a, h = _leaf(1, seq, hidden), _leaf(1, seq, hidden)
        h32 = h.detach().float().requires_grad_(True)  # the fp32 residual S that never_round carries in

        def stock(a, h, w):
            h = h + a  # HF: hidden_states = residual + hidden_states
            return norm(h), h

        out = [Variant("stock", stock, (a, h, norm.weight))]
        # hf, te, sglang/aligned, vllm, and the whole-graph compiled rule no profile uses yet.
        pairs = [
            ("round_before_weight", "normalize_rounded_sum"),
            ("round_after_weight", "normalize_rounded_sum"),
            ("round_after_weight", "normalize_fp32_sum"),
            ("round_after_weight", "round_at_attention"),
            ("round_after_weight", "never_round"),
        ]
        for (norm_rule, res_rule), c in itertools.product(pairs, (False, True)):

            def aligned(a, h, w, norm_rule=norm_rule, res_rule=res_rule, c=c):
                rounded, x = ops.residual_add(a, h, res_rule, compiled=c)  # (R, what the norm reads)
                carried = x if res_rule in ("round_at_attention", "never_round") else rounded
                return ops.rms_norm(x, w, EPS, norm_rule, out_dtype=rounded.dtype, compiled=c), carried

            out.append(
                Variant(
                    f"{norm_rule}/{res_rule}{FUSED[c]}",
                    aligned,
                    (a, h32 if res_rule == "never_round" else h, norm.weight),
                )
            )
        return out
    if op == "rope":
        rotary = hf.Qwen3RotaryEmbedding(cfg)
        pos = torch.arange(seq)[None]
        cos32, sin32 = rotary(torch.zeros(1, dtype=torch.float32), pos)  # (1, T, D), fp32: the c32 rule
        cos16, sin16 = rotary(torch.zeros(1, dtype=torch.bfloat16), pos)  # HF's: cast to the model dtype
        q, k = _leaf(1, seq, heads, head_dim), _leaf(1, seq, kv, head_dim)  # q/k norm outputs, (B, T, H, D)

        def stock(q, k, cos, sin):
            return hf.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)

        out = [Variant("stock", stock, (q, k, cos16, sin16))]
        for cs, (cos, sin) in (("bf16", (cos16, sin16)), ("fp32", (cos32, sin32))):
            roundings = [str(r.rounding) for r in SEARCHED_ROPE_RULES if str(r.cos_sin) == cs]  # as fit's space
            for rounding, c in itertools.product(roundings, (False, True)):

                def aligned(q, k, cos, sin, rounding=rounding, c=c):  # as AlignedAttention runs it
                    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
                    return (
                        ops.rope(q.transpose(1, 2), cos, sin, rounding, torch.bfloat16, compiled=c),
                        ops.rope(k.transpose(1, 2), cos, sin, rounding, torch.bfloat16, compiled=c),
                    )

                out.append(Variant(f"{cs}/{rounding}{FUSED[c]}", aligned, (q, k, cos, sin)))
        return out
    if op == "swiglu":
        mlp = hf.Qwen3MLP(cfg)
        gate, up = _leaf(1, seq, inter), _leaf(1, seq, inter)
        out = [Variant("stock", lambda g, u: mlp.act_fn(g) * u, (gate, up))]
        for rule, c in itertools.product(("round_silu", "once"), (False, True)):
            out.append(
                Variant(rule + FUSED[c], lambda g, u, rule=rule, c=c: ops.swiglu(g, u, rule, compiled=c), (gate, up))
            )
        return out
    raise ValueError(f"unknown op {op!r}; choose from {', '.join(OPS)}")


def _outputs(result) -> tuple:
    return result if isinstance(result, tuple) else (result,)


class Pass:
    """One pass of a variant as a no-argument call; forward+backward uses fixed random output grads (seeded)."""

    def __init__(self, fn: Callable, inputs: tuple, pass_: str, eager_fn: Callable | None = None):
        self.fn, self.inputs, self.pass_ = fn, inputs, pass_
        self.leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
        self.grads = None
        if pass_ != "forward":
            with torch.no_grad():
                # The eager callable: calling a compiled one here would compile a no_grad graph never timed.
                shapes = [(o.shape, o.dtype) for o in _outputs((eager_fn or fn)(*inputs))]
            g = torch.Generator().manual_seed(1)
            self.grads = [torch.randn(s, generator=g).to(d) for s, d in shapes]

    def forward(self):
        if self.grads is None:
            with torch.no_grad():
                return self.fn(*self.inputs)
        for t in self.leaves:
            t.grad = None
        return self.fn(*self.inputs)

    def backward(self, outs) -> None:
        if self.grads is not None:
            torch.autograd.backward(_outputs(outs), self.grads)

    def __call__(self) -> None:
        self.backward(self.forward())


def saved_bytes(run: Pass) -> int:
    """Bytes that the forward saves for backward, each distinct storage counted once.

    The hooks wrap the forward only: that is where tensors are saved, and the aligned ops' backward
    (``torch.func.vjp``) refuses to run under saved-tensor hooks.
    """
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = run.forward()
    run.backward(outs)
    return sum(storages.values())


def peak_bytes(run: Pass) -> int:
    """Peak of the running sum of the CPU allocations (+) and frees (-) the profiler records during the pass.

    Read from the allocator's own events (``model_step.measure_peak``), not from the per-op events' memory
    columns: those repeat an allocation in every op that encloses it (``aten::to`` > ``_to_copy`` >
    ``empty_strided``), which counted each temporary two or three times in the first baseline.
    """
    _, peak, _ = measure_peak(run)
    return peak


def bench_case(op: str, model: str, seq: int, mode: str, rounds: int, shape: str) -> list[dict]:
    """Every variant of one op at one shape and mode, both passes: rows with medians and same-run ratios."""
    rows = []
    for pass_ in PASSES:
        if mode == "compiled":
            torch._dynamo.reset()  # a fresh compile per case: no stale guards
            # The variants of a case are closures of one function, i.e. one code object to Dynamo, which allows 8
            # graphs per code object before it runs the rest eagerly: add_rms_norm alone has 10 aligned variants.
            torch._dynamo.config.recompile_limit = 64
        vs = variants(op, model, seq)
        fns = {v.name: torch.compile(v.fn) if mode == "compiled" else v.fn for v in vs}
        runs = {v.name: Pass(fns[v.name], v.inputs, pass_, eager_fn=v.fn) for v in vs}
        first: dict[str, float] = {}
        for name, run in runs.items():  # the first call compiles (compiled mode): timed apart, as compile_s
            t0 = time.perf_counter()
            run()
            first[name] = time.perf_counter() - t0
        times: dict[str, list[float]] = {name: [] for name in runs}
        for r in range(rounds):  # interleaved: each variant once per round; round 0 is warm-up
            for name, run in runs.items():
                t0 = time.perf_counter()
                run()
                if r:
                    times[name].append(time.perf_counter() - t0)
        for name, run in runs.items():
            row = {
                "name": op,
                "variant": name,
                "mode": mode,
                "pass": pass_,
                "shape": shape,
                "model": model,
                "seq": seq,
                "rounds": rounds - 1,
                "time_ms": statistics.median(times[name]) * 1e3,
                "saved_bytes": saved_bytes(run) if pass_ != "forward" else None,
                "peak_bytes": peak_bytes(run),
            }
            if mode == "compiled":
                row["compile_s"] = first[name]
            rows.append(row)
    return rows


def add_ratios(rows: list[dict]) -> None:
    """time/saved/peak ratio of each row against the stock row of the same name, mode, pass and shape."""
    stock = {(r["name"], r["mode"], r["pass"], r["shape"]): r for r in rows if r["variant"] == "stock"}
    for r in rows:
        s = stock[(r["name"], r["mode"], r["pass"], r["shape"])]
        r["time_ratio"] = r["time_ms"] / s["time_ms"]
        r["saved_ratio"] = r["saved_bytes"] / s["saved_bytes"] if r["saved_bytes"] is not None else None
        r["peak_ratio"] = r["peak_bytes"] / s["peak_bytes"] if s["peak_bytes"] else None


def _mb(n) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'op':<13}{'variant':<48}{'mode':<9}{'pass':<17}{'shape':<20}{'ms':>9}{'time':>7}"
        f"{'saved MB':>10}{'saved':>7}{'peak MB':>9}{'peak':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['name']:<13}{r['variant']:<48}{r['mode']:<9}{r['pass']:<17}{r['shape']:<20}{r['time_ms']:>9.3f}"
            f"{_x(r['time_ratio']):>7}{_mb(r['saved_bytes']):>10}{_x(r['saved_ratio']):>7}"
            f"{_mb(r['peak_bytes']):>9}{_x(r['peak_ratio']):>7}"
        )


def _csv(value: str, allowed, what: str) -> list[str]:
    items = [v for v in value.split(",") if v]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise SystemExit(f"ops.py: unknown {what} {', '.join(bad) or '(none)'}; choose from {', '.join(allowed)}")
    return items


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (hidden 64), seq 32 and 64, 2 rounds")
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, from {','.join(OPS)}")
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-8b", help="comma-separated: qwen3-0.6b, qwen3-8b")
    ap.add_argument(
        "--seqs",
        help="comma-separated sequence lengths for every model (default: per model, 0.6B 512-4096, 8B 512 and 2048)",
    )
    ap.add_argument("--modes", default="eager,compiled", help="eager, compiled or both")
    ap.add_argument("--rounds", type=int, help="rounds per case, the first is warm-up (default 9; --quick 2)")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    ap.add_argument("--json", metavar="PATH", help="write {suite, machine, results} here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = args.rounds or (2 if args.quick else 9)
    if rounds < 2:
        raise SystemExit(f"ops.py: --rounds must be at least 2 (one warm-up, one timed), got {rounds}")
    op_list = _csv(args.ops, OPS, "op")
    modes = _csv(args.modes, ("eager", "compiled"), "mode")
    if args.quick:
        plan = [("tiny", s) for s in (32, 64)]
    else:
        models = _csv(args.models, ("qwen3-0.6b", "qwen3-8b"), "model")
        try:
            seqs = [int(s) for s in args.seqs.split(",")] if args.seqs else None
        except ValueError:
            raise SystemExit(f"ops.py: --seqs takes comma-separated integers, got {args.seqs!r}") from None
        plan = [(m, s) for m in models for s in (seqs or DEFAULT_SEQS[m])]

    info = machine_info()
    print(
        f"machine: {info['cpu']}, {info['logical_cpus']} logical CPUs, {info['torch_threads']} torch threads, "
        f"torch {info['torch']}, transformers {info['transformers']}, {info['date']}"
    )
    print(f"ops: {', '.join(op_list)}; modes: {', '.join(modes)}; {rounds} rounds (1 warm-up); bf16, batch 1")
    rows = []
    for model, seq in plan:
        shape = f"{model} seq={seq}"
        for mode in modes:
            for op in op_list:
                rows += bench_case(op, model, seq, mode, rounds, shape)
    add_ratios(rows)
    print_table(rows)
    if args.json:
        write_json(args.json, {"suite": "ops", "machine": info, "results": rows})
        print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
