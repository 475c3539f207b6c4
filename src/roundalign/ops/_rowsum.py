"""RMSNorm's row sums inside a compiled model: ATen's summation order, read straight from the 16-bit tensors.

A compiled model's RMSNorm keeps ATen's order for its variance and for its backward's row sum, so that it equals
the eager ops bit for bit (``roundalign.ops._traced``). ATen can only sum an fp32 tensor: the 16-bit input widened,
squared (or multiplied by the gradient) and summed, three passes and an fp32 copy, a block at a time. ``_rowsum.c``
restates ATen's summation order (``SumKernel.cpp``: a cascade over W-lane vectors, four accumulators interleaved,
the leftover elements and the lanes added last) and computes each summed element on the fly, one fp32 product from
the 16-bit values as ATen's would be: one pass, nothing widened in memory, 2-4x faster than the ATen calls.

W is whatever ATen's sum uses on this machine, found by a probe when the kernels load: their sums of random rows
(short ones, vector-sized ones, ones long enough for the cascade's upper levels) must equal ``torch.sum``'s at
exactly one candidate W. Elsewhere (no C compiler, another CPU architecture, a torch whose order differs) the
kernels stay off, with one warning, and ATen's calls run: the same bits, slower. ``ROUNDALIGN_ROW_KERNELS=0`` turns
them off on purpose.
"""

from __future__ import annotations

import ctypes
import os
import warnings
from pathlib import Path

import torch

from roundalign import native

ENV = "ROUNDALIGN_ROW_KERNELS"
SOURCE = Path(__file__).with_name("_rowsum.c")
_GRAIN = 32768  # at::internal::GRAIN_SIZE: a sum into one output of this many elements is split over threads
_SQUARES, _PRODUCTS = 0, 1  # the kernel's kinds: sum(x^2), sum(grad_normed * x)
_FORMATS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}  # the kernel's stored formats of x and grad
_state: dict = {}  # "lib", "width": the loaded library and ATen's lane count, or None; "why": the reason if None


def _load() -> tuple[ctypes.CDLL, int]:
    lib = native.build(SOURCE, "row-kernels", "libroundalign_rowsum")
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    lib.roundalign_row_sums.argtypes = [i32, ptr, ptr, ptr, ptr, i64, i64, i32, i32, i32]
    lib.roundalign_row_sums.restype = None
    return lib, _probe_width(lib)


def _probe_width(lib: ctypes.CDLL) -> int:
    """ATen's lane count: the one W at which the kernel's sums equal ``torch.sum``'s on every probe row."""
    gen = torch.Generator().manual_seed(0)
    probes = [torch.randn(16, n, generator=gen) * 4 for n in (5, 37, 300, 1100, 2100)]
    matches = []
    for width in (8, 16):
        same = True
        for x in probes:
            expected = x.float().pow(2).sum(-1)
            got = torch.empty(x.shape[0])
            lib.roundalign_row_sums(
                _SQUARES, x.data_ptr(), None, None, got.data_ptr(), *x.shape, width, _FORMATS[x.dtype], 0
            )
            same = same and torch.equal(got, expected)
        if same:
            matches.append(width)
    if len(matches) != 1:
        raise RuntimeError(f"torch {torch.__version__} sums rows in an order the kernels do not restate here")
    return matches[0]


def kernels() -> tuple[ctypes.CDLL, int] | None:
    """(library, ATen's lane count), or None (with one RuntimeWarning saying why) where they are off."""
    if "lib" not in _state:
        if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
            _state.update(lib=None, why=f"${ENV}=0")
        else:
            try:
                _state.update(lib=_load(), why=None)
            except Exception as exc:  # no compiler, a failed build, another summation order
                _state.update(lib=None, why=str(exc))
                warnings.warn(
                    f"roundalign: the row-sum kernels for compiled models are unavailable ({exc}); RMSNorm's "
                    "variance and gradient run as ATen calls instead (the same bits, slower). "
                    f"Set {ENV}=0 to silence this.",
                    RuntimeWarning,
                    stacklevel=3,
                )
    return _state["lib"]


def row_sums(x: torch.Tensor, grad=None, weight=None, rounded_product: bool = False) -> torch.Tensor | None:
    """Per row of ``x`` (its last dim), ATen's ``sum(x32 * x32)``, or with ``grad`` and ``weight`` its
    ``sum(grad_normed * x32)`` where ``grad_normed`` is ``r(grad * weight)`` (``rounded_product`` and a 16-bit
    ``weight``: a 16-bit product) else ``grad32 * weight32``; ``x32`` is ``x`` widened (bf16, fp16 or fp32 ``x``).
    fp32, shape ``x.shape[:-1]``; None where the kernels are off or do not take these tensors (not on the CPU, or a
    single long row, which ATen splits over threads)."""
    if x.device.type != "cpu" or x.dtype not in _FORMATS or x.numel() == 0:
        return None
    n = x.shape[-1]
    rows = x.numel() // n
    if rows == 1 and x.numel() >= _GRAIN and torch.get_num_threads() > 1:
        return None
    if grad is not None and (grad.dtype != x.dtype or grad.shape != x.shape or weight.numel() != n):
        return None
    loaded = kernels()
    if loaded is None:
        return None
    lib, width = loaded
    x = x.contiguous()
    out = torch.empty(x.shape[:-1], dtype=torch.float32)
    if grad is None:
        lib.roundalign_row_sums(
            _SQUARES, x.data_ptr(), None, None, out.data_ptr(), rows, n, width, _FORMATS[x.dtype], 0
        )
        return out
    grad = grad.contiguous()
    w32 = weight.to(torch.float32).contiguous()  # exact; the product r(grad * weight) rounds only in weight's dtype
    rounded = int(rounded_product and weight.dtype == x.dtype)
    lib.roundalign_row_sums(
        _PRODUCTS,
        x.data_ptr(),
        grad.data_ptr(),
        w32.data_ptr(),
        out.data_ptr(),
        rows,
        n,
        width,
        _FORMATS[x.dtype],
        rounded,
    )
    return out
