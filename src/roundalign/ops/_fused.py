"""The fused kernels behind ``roundalign.ops``: each op compiled once by Inductor and called directly.

A formula (plain torch code whose every rounding point is an explicit cast) runs eagerly as several ATen kernels
with fp32 temporaries in memory. Inductor fuses it into one kernel. What it compiles is the op's traced form
(``roundalign.ops._traced``: the same formula with rounding primitives Inductor keeps, reductions and SiLU's
backward as opaque ATen calls), so the fused kernel equals the eager formula bit for bit
(tests/test_ops_compiled.py), and ``emulate_precision_casts`` is set for good measure.

**Why not ``torch.compile`` per call.** A ``torch.compile``'d function checks Dynamo's guards on every call, which
on a CPU costs more than the kernel itself on a small model (docs/design.md has the figures). Here each formula is
traced once per *signature* (``make_fx`` with symbolic sizes) and compiled with
``torch._inductor.standalone_compile``; the call is then Inductor's generated wrapper and kernel alone. What
Dynamo's guards would check is the signature:

- per tensor input: dtype, rank, which dims have size 1 (tracing specialises them), and the dims' memory order
  (the kernel's index arithmetic is written for one layout; other strides are normalised to it, a view, or the
  input is made contiguous);
- per op: its constants (rule, dtype, eps) and the device type.

Sizes are symbolic, each dim its own symbol (``use_duck_shape=False``: two dims of equal size in the example are not
assumed equal forever), so one kernel serves every batch and sequence length. The relations the formula needs
(operands of one shape, cos/sin broadcast over heads) come from the op's own contract, which every call satisfies.
A size-0 input runs the eager formula.

**The disk cache** is Inductor's FX graph cache (``TORCHINDUCTOR_CACHE_DIR``), so a second process loads each kernel
instead of compiling it. Its key covers the traced graph, torch and the Inductor config, but not the Python of the
opaque ops a graph calls, nor their fake kernels; ``roundalign.compile_key`` adds a hash of those sources to
torch.compile's cache key tag (for every graph, a whole compiled model's too), so an upgraded roundalign never
reuses an older graph.

**When no compiler is at hand** (no C++ compiler on the CPU, no Triton on a GPU), or a compile fails, the op runs
its eager formula: the same bits, slower, with one warning that says why.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Sequence

import torch

from roundalign import compile_key

log = logging.getLogger(__name__)

ENV = "ROUNDALIGN_COMPILE_OPS"  # "0" runs the eager ops everywhere (apply's default); "1" insists on fused ones


_INDUCTOR_OPTIONS = {"emulate_precision_casts": True}

# --- can this process compile? -----------------------------------------------------------------------------------

_available: dict[str, str | None] = {}  # device type -> None (a compiler is there) or why not
_warned: set[str] = set()


def unavailable_reason(device_type: str) -> str | None:
    """Why Inductor cannot compile for ``device_type`` here, or None when it can."""
    if device_type not in _available:
        _available[device_type] = _probe(device_type)
    return _available[device_type]


def _probe(device_type: str) -> str | None:
    if device_type == "cpu":
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()
        except Exception as exc:  # InvalidCxxCompiler, or a broken toolchain
            return f"no C++ compiler for Inductor on the CPU ({exc}); install g++ or set CXX"
        return None
    if device_type in ("cuda", "xpu"):
        from torch.utils._triton import has_triton

        return None if has_triton() else f"Triton is not installed for {device_type}; pip install triton"
    return f"Inductor has no backend for device type {device_type!r}"


def warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def fused_requested(compile_ops: bool | None) -> bool:
    """``apply``'s ``compile_ops``: None means the fused kernels unless ``$ROUNDALIGN_COMPILE_OPS`` is "0"."""
    if compile_ops is not None:
        return bool(compile_ops)
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


# --- signatures --------------------------------------------------------------------------------------------------

_BROADCAST = "broadcast"  # a stand-in whose every stride is 0 (an input the backward reads only the shape of)
_IDENTITY = [tuple(range(n)) for n in range(8)]


def _canonical(t: torch.Tensor) -> tuple[tuple, torch.Tensor]:
    """``t``'s signature and ``t`` in the layout the signature names (a view when possible, else a copy)."""
    ones = tuple(s == 1 for s in t.shape)
    if t.is_contiguous() and not any(ones):  # the common case, without the stride arithmetic below
        return (t.dtype, t.dim(), ones, _IDENTITY[t.dim()]), t
    if t.dim() and all(st == 0 for st in t.stride()) and t.numel() > 1:
        return (t.dtype, t.dim(), ones, _BROADCAST), t
    order = tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), d)))  # outermost first
    strides = [0] * t.dim()
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= t.shape[d]
    if any(t.stride(d) != strides[d] for d in range(t.dim()) if t.shape[d] > 1):
        t = t.contiguous()  # not dense in any order: a slice or an expand
        order = tuple(range(t.dim()))
    elif tuple(t.stride()) != tuple(strides):
        t = t.as_strided(t.shape, strides)  # size-1 dims' strides do not address memory: normalise them
    return (t.dtype, t.dim(), ones, order), t


def _example(sig: tuple, like: torch.Tensor) -> torch.Tensor:
    dtype, _, _, order = sig
    if order == _BROADCAST:
        return torch.zeros((), dtype=dtype, device=like.device).expand(like.shape)
    return torch.empty_strided(like.shape, like.stride(), dtype=dtype, device=like.device)


# --- the kernels -------------------------------------------------------------------------------------------------


class Kernels:
    """``fn(*tensors, *consts)`` as direct Inductor kernels, one per signature; ``run`` returns None when the eager
    formula must run instead (size 0, no compiler, or a compile that failed, which warns once)."""

    def __init__(self, name: str, fn: Callable):
        self.name = name
        self.fn = fn
        self._cache: dict = {}

    def run(self, tensors: Sequence[torch.Tensor], consts: Sequence):
        if any(t.numel() == 0 for t in tensors):
            return None
        device = tensors[0].device.type
        reason = unavailable_reason(device)
        if reason is not None:
            warn_once(f"unavailable:{device}", f"roundalign: running the eager ops: {reason}.")
            return None
        sigs, canon = zip(*(_canonical(t) for t in tensors), strict=True)
        key = (device, tuple(consts), sigs)
        kernel = self._cache.get(key)
        if kernel is None:
            kernel = self._cache[key] = self._build(canon, consts, key)
        if kernel is False:
            return None
        return kernel(*canon)

    def _build(self, canon, consts, key):
        from torch.fx.experimental import _config as fx_config
        from torch.fx.experimental.proxy_tensor import make_fx

        consts = tuple(consts)

        def graph(*tensors):
            return self.fn(*tensors, *consts)

        examples = [_example(sig, t) for sig, t in zip(key[2], canon, strict=True)]
        compile_key.key_compiles()
        try:
            with (
                torch._inductor.config.patch(_INDUCTOR_OPTIONS),
                fx_config.patch(use_duck_shape=False),
                torch.autocast(key[0], enabled=False),
                torch.no_grad(),
            ):
                gm = make_fx(graph, tracing_mode="symbolic")(*examples)
                artifact = torch._inductor.standalone_compile(gm, examples, dynamic_shapes="from_graph")
        except Exception as exc:  # a toolchain or Inductor failure: the eager formula gives the same bits
            warn_once(
                f"compile-failed:{self.name}",
                f"roundalign: compiling the fused kernel of {self.name} failed ({type(exc).__name__}: {exc}); "
                f"running its eager formula (same numbers, slower). Set {ENV}=0 to skip compiling.",
            )
            log.debug("compile of %s failed", self.name, exc_info=True)
            return False
        unwrap = isinstance(gm.graph.output_node().args[0], (list, tuple))

        def kernel(*tensors):
            out = artifact(*tensors)
            return tuple(out) if unwrap else out[0] if isinstance(out, (list, tuple)) else out

        return kernel
