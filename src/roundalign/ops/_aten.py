"""A C restatement of ATen's CPU SiLU backward, for a compiled model's opaque op: ATen's bits in one pass.

A compiled model's SwiGLU keeps ATen's arithmetic for the gate's gradient, so that it equals the eager ops bit for
bit (``roundalign.ops._traced``). ATen's ``silu_backward`` needs its operands in fp32: the 16-bit activations
widened and multiplied into fp32 copies, several passes. ``_aten.c`` restates the kernel and computes each operand on
the fly from the stored 16-bit tensors: ``silu_backward_of_product`` is ``r(silu_backward(grad * up, gate))`` as
ATen's kernel computes it on the whole tensor (Sleef's exp in its vector loop, libm's on the elements each thread's
range leaves over). It can also give SwiGLU's up gradient ``r(grad * silu(gate))`` in the same pass (ATen's silu
splits its elements between the two exps as its backward does) and write the gate's over ``grad``.

It is used only where a probe, run when the library loads, finds ATen computing the same bits on this machine: every
bf16 and fp16 gate value through both of ATen's exps, at this machine's W and thread ranges. Elsewhere (no C
compiler, another CPU architecture, a torch built otherwise) the kernel stays off, with one warning, and ATen's calls
run: the same bits, slower. ``ROUNDALIGN_ATEN_KERNELS=0`` turns it off on purpose. (RMSNorm's row sums, once
restated here, are tensor ops Inductor fuses: ``roundalign.ops._cascade``.)
"""

from __future__ import annotations

import ctypes
import os
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from roundalign import native

ENV = "ROUNDALIGN_ATEN_KERNELS"
SOURCE = Path(__file__).with_name("_aten.c")
GRAIN = 32768  # at::internal::GRAIN_SIZE: ATen splits work of more elements over threads
_FORMATS = {torch.bfloat16: 0, torch.float16: 1}  # the kernel's stored formats
# per kernel name: (library, W) or None, and "why_<name>" if None
_state: dict = {}


def _load() -> ctypes.CDLL:
    # -fno-trapping-math: the exp's selects become vector blends (no value changes: nothing is reassociated)
    openmp, gomp = native.openmp()  # ATen's ranges on torch's own threads
    flags = [*native.FLAGS, "-fno-trapping-math", *openmp]
    lib = native.build(SOURCE, "aten-kernels", "libroundalign_aten", flags, ("-lm", *gomp))
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    lib.roundalign_silu_backward_of_product.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i32, i32, i32, i32]
    lib.roundalign_silu_backward_of_product.restype = None
    return lib


def _silu_call(lib, grad, up, gate, out, width: int, threads: int, out_fp32: bool, up_out=None) -> None:
    lib.roundalign_silu_backward_of_product(
        grad.data_ptr(), up.data_ptr(), gate.data_ptr(), out.data_ptr(), None if up_out is None else up_out.data_ptr(),
        gate.numel(), threads, width, _FORMATS[gate.dtype], int(out_fp32),
    )  # fmt: skip


def _silu_width(lib: ctypes.CDLL) -> int:
    """ATen's lane count for SiLU's backward, after checking the kernel against ATen on every 16-bit gate value."""
    threads = torch.get_num_threads()
    every_path = 1 << 30  # a width no range reaches: every element takes the scalar exp
    for dtype in (torch.bfloat16, torch.float16):
        gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
        for dy in (1.0, 3.3):  # dy * s * t: two dys pin down s * t and its rounding
            grad, up = torch.full_like(gate, dy), torch.ones_like(gate)
            dy32 = grad.float() * up.float()
            got, got_up = torch.empty(gate.shape), torch.empty(gate.shape)
            # the vector exp: whole vector steps, ranges of 32,768 (a multiple of any step)
            _silu_call(lib, grad, up, gate, got, 8, 1, True, got_up)
            vector = torch.cat([torch.ops.aten.silu_backward(dy32[i : i + GRAIN], gate[i : i + GRAIN].float())
                                for i in range(0, gate.numel(), GRAIN)])  # fmt: skip
            silu = torch.cat([F.silu(gate[i : i + GRAIN].float()) for i in range(0, gate.numel(), GRAIN)])
            vector_up = grad.float() * silu
            _check(got, vector, f"SiLU's backward on every {dtype} gate value (vector exp)")
            _check(got_up, vector_up, f"SiLU on every {dtype} gate value (vector exp)")
            # the scalar exp: ATen's scalar loop runs on strided operands, the kernel with no vector step
            _silu_call(lib, grad, up, gate, got, every_path, 1, True, got_up)
            scalar = torch.ops.aten.silu_backward(_strided(dy32), _strided(gate.float()))
            scalar_up = grad.float() * F.silu(_strided(gate.float()))
            _check(got, scalar, f"SiLU's backward on every {dtype} gate value (scalar exp)")
            _check(got_up, scalar_up, f"SiLU on every {dtype} gate value (scalar exp)")
    # Which elements take which exp: gate values where the two differ, at every position of a tensor split over this
    # machine's threads; exactly one W must give ATen's bits.
    differ = (vector.view(torch.int32) != scalar.view(torch.int32)) & ~vector.isnan()
    differ |= (vector_up.view(torch.int32) != scalar_up.view(torch.int32)) & ~vector_up.isnan()
    tricky = gate[differ]  # fp16 gate values (the last dtype probed)
    if tricky.numel() == 0:
        return 8  # both exps agree everywhere: positions cannot matter
    n = 3 * GRAIN + next(k for k in range(64) if _range_size(3 * GRAIN + k, threads) % 32 >= 16)
    gate = tricky.repeat(n // tricky.numel() + 1)[:n].contiguous()
    grad, up = torch.full_like(gate, 3.3), torch.ones_like(gate)  # the dy the differing values were found at
    expected = torch.ops.aten.silu_backward(grad.float() * up.float(), gate.float())
    expected_up = grad.float() * F.silu(gate.float())
    matches = []
    for width in (8, 16):
        got, got_up = torch.empty(gate.shape), torch.empty(gate.shape)
        _silu_call(lib, grad, up, gate, got, width, threads, True, got_up)
        same = (torch.equal(got.view(torch.int32), expected.view(torch.int32))
                and torch.equal(got_up.view(torch.int32), expected_up.view(torch.int32)))  # fmt: skip
        if same:
            matches.append(width)
    if len(matches) != 1:
        raise RuntimeError("ATen's SiLU backward splits its vector and scalar elements otherwise than the kernel")
    return matches[0]


def _range_size(n: int, threads: int) -> int:
    """How many elements each of ATen's thread ranges takes (the first ones; the last may take fewer): a size
    whose remainder mod 32 is 16 or more leaves different scalar elements at W = 8 and W = 16."""
    ranges = 1 if n <= GRAIN or threads == 1 else min(threads, -(-n // GRAIN))
    return -(-n // ranges)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a view with stride 2: ATen's element-wise loops take their scalar path on it."""
    return torch.stack([t, t], -1)[..., 0]


def _check(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    same = (got.view(torch.int32) == expected.view(torch.int32)) | (got.isnan() & expected.isnan())
    if not bool(same.all()):
        raise RuntimeError(f"{what} differs from ATen's on this machine (torch {torch.__version__})")


def _kernel(name: str, probe) -> tuple[ctypes.CDLL, int] | None:
    """(library, W) for one kernel, or None (with one RuntimeWarning saying why) where it is off."""
    if name not in _state:
        if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
            _state.update({name: None, f"why_{name}": f"${ENV}=0"})
            return None
        try:
            lib = _load()
            _state[name] = (lib, probe(lib))
        except Exception as exc:  # no compiler, a failed build, ATen computing otherwise
            _state.update({name: None, f"why_{name}": str(exc)})
            warnings.warn(
                f"roundalign: a compiled model's {name} kernel is unavailable ({exc}); it runs as ATen calls "
                f"instead (the same bits, slower). Set {ENV}=0 to silence this.",
                RuntimeWarning,
                stacklevel=4,
            )
    return _state[name]


def silu_backward_of_product(
    grad: torch.Tensor, up: torch.Tensor, gate: torch.Tensor, out: torch.Tensor | None = None, with_up: bool = False
):
    """``r(silu_backward(grad32 * up32, gate32))`` in the gate's dtype, as ATen computes it on the whole tensor
    with torch's threads; None where the kernel is off or does not take these tensors (16-bit CPU tensors of one
    dtype and shape). ``out``: where to write it, contiguous, of the gate's dtype and shape, ``grad`` itself
    included (each element is read before it is written). ``with_up``: return ``(gate gradient, up gradient)``, the
    second ``r(grad32 * silu(gate32))`` as eager computes it from ``F.silu`` of the widened gate (SwiGLU's)."""
    if gate.device.type != "cpu" or gate.dtype not in (torch.bfloat16, torch.float16) or gate.numel() == 0:
        return None
    if grad.dtype != gate.dtype or up.dtype != gate.dtype or grad.shape != gate.shape or up.shape != gate.shape:
        return None
    if out is not None and not (out.is_contiguous() and out.dtype == gate.dtype and out.shape == gate.shape):
        return None
    loaded = _kernel("SiLU backward", _silu_width)
    if loaded is None:
        return None
    lib, width = loaded
    grad, up, gate = grad.contiguous(), up.contiguous(), gate.contiguous()
    out = torch.empty(gate.shape, dtype=gate.dtype) if out is None else out
    up_out = torch.empty(gate.shape, dtype=gate.dtype) if with_up else None
    _silu_call(lib, grad, up, gate, out, width, torch.get_num_threads(), False, up_out)
    return (out, up_out) if with_up else out
