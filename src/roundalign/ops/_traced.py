"""The ops inside a compiled model: formulas whose rounding points Inductor keeps while it fuses them with their
neighbours.

Under ``torch.compile`` Inductor computes a fused kernel's 16-bit values in fp32 and drops the casts between them
(``emulate_precision_casts=False``, its default), which would erase a formula's rounding points. Setting that option
for the whole model would also change the numerics of every stock op in it, and the option belongs to whoever calls
``torch.compile``. So here the formulas run with rounding primitives that Inductor cannot drop:

- ``roundalign::round_to(x, dtype)``: ``r(x)``, a conversion to the 16-bit ``dtype`` that Inductor lowers as a real
  conversion (``use_compute_types=False``, what ``emulate_precision_casts`` does for every cast);
- ``roundalign::widen(x, dtype)``: a 16-bit ``x`` widened to fp32 exactly as stored, rounded first if a fused
  producer left it in fp32 registers;
- ``Traced.ew(fn, *tensors)``: an element-wise op on 16-bit operands computed as eager computes it (operands
  widened, fp32 arithmetic, the result rounded), for the rules written as HF's per-op bf16 expressions.

Reductions stay opaque ATen calls (``roundalign::rms_rstd``, ``roundalign::rms_grad_dot``, ``roundalign::sum_to``), in
ATen's summation order, and
so does SiLU's backward (``roundalign::silu_backward``): Inductor's decomposition of it associates the products
otherwise than ATen's kernel, which moves a few fp16 gradients by one unit in the last place. The
formulas are the same functions as the eager ones (``roundalign.numerics.formulas``), called with ``num=TRACED``
instead of ``num=EAGER``; tests/test_ops_compiled.py checks a compiled model against the eager ops bit for bit.

Without Inductor (another backend) the primitives run as the plain casts they stand for: the same numbers. Their
Inductor lowerings register the first time a graph uses them (their fake kernels run while Dynamo traces, before
Inductor lowers), so importing roundalign never imports Inductor.
"""

from __future__ import annotations

import functools

import torch

from roundalign.numerics.dtypes import LOW_PRECISION, compute_dtype
from roundalign.numerics.formulas import rstd_aten

_lib = torch.library.Library("roundalign", "FRAGMENT")  # plain dispatcher ops: a fraction of custom_op's call cost
# Tagged pointwise: AOTAutograd's partitioner may then recompute them in the backward from the saved 16-bit tensors
# rather than save their fp32 results (twice the bytes), as it does for stock casts.
_lib.define("round_to(Tensor x, ScalarType dtype) -> Tensor", tags=(torch.Tag.pointwise,))
_lib.define("widen(Tensor x, ScalarType dtype) -> Tensor", tags=(torch.Tag.pointwise,))
# The same widening, read by a backward from its saved 16-bit inputs. A second op so that AOTAutograd does not merge
# it with the forward's widening of the same tensor: the merged node's fp32 result would be saved for the backward
# (twice the bytes of the 16-bit input), since the partitioner recomputes only ATen's own pointwise ops.
_lib.define("widen_saved(Tensor x, ScalarType dtype) -> Tensor", tags=(torch.Tag.pointwise,))
# RMSNorm's two row reductions read the stored 16-bit x (and the gradient) and widen a block of rows at a time: an
# opaque op's inputs are materialised, and an fp32 copy of x (with ATen's x^2 beside it) would cost more memory at
# the backward's peak than stock's fused reduction uses in all.
_lib.define("rms_rstd(Tensor x, float eps) -> Tensor")
_lib.define("rms_grad_dot(Tensor grad, Tensor weight, Tensor x, bool rounded_product) -> Tensor")
_lib.define("sum_to(Tensor t, SymInt[] size) -> Tensor")
_lib.define("silu_backward(Tensor grad, Tensor x) -> Tensor")
_lib.define("silu_backward_of_product(Tensor grad, Tensor up, Tensor gate) -> Tensor")

_lib.impl("round_to", lambda x, dtype: x.to(dtype), "CompositeExplicitAutograd")
_lib.impl("widen", lambda x, dtype: x.to(dtype), "CompositeExplicitAutograd")
_lib.impl("widen_saved", lambda x, dtype: x.to(dtype), "CompositeExplicitAutograd")
_BLOCK_BYTES = 1 << 20  # fp32 bytes per block of rows: cache-sized, and a few hundred blocks at most per call


def _blocks(n_rows: int, row_len: int) -> list[slice]:
    step = max(1, _BLOCK_BYTES // (4 * max(row_len, 1)))
    return [slice(i, i + step) for i in range(0, n_rows, step)]


def rms_rstd_rows(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``rstd_aten(x.to(acc), eps)`` a block of rows at a time: the same bits, since ATen reduces each row of an
    inner-dim reduction alone (tests/test_ops_compiled.py compares with the whole-tensor eager formula)."""
    acc = compute_dtype(x)
    rows = x.reshape(-1, x.shape[-1])
    if rows.numel() == 0:
        return rstd_aten(x.to(acc), eps)
    out = rows.new_empty((rows.shape[0], 1), dtype=acc)
    for b in _blocks(*rows.shape):
        out[b] = rstd_aten(rows[b].to(acc), eps)
    return out.reshape(*x.shape[:-1], 1)


def rms_grad_dot_rows(grad: torch.Tensor, weight: torch.Tensor, x: torch.Tensor, rounded_product: bool) -> torch.Tensor:
    """Per row, ``sum(grad_normed * x32)`` of RMSNorm's backward, a block of rows at a time, where ``grad_normed`` is
    ``r(grad * weight)`` widened (``rounded_product``: HF's bf16 weight multiply) or ``grad32 * weight32``."""
    acc = compute_dtype(x)
    n = x.shape[-1]
    g_rows, x_rows = grad.reshape(-1, n), x.reshape(-1, n)
    out = x_rows.new_empty((x_rows.shape[0], 1), dtype=acc)
    for b in _blocks(*x_rows.shape):
        g = g_rows[b]
        grad_normed = (g * weight).to(acc) if rounded_product else g.to(acc) * weight.to(acc)
        out[b] = (grad_normed * x_rows[b].to(acc)).sum_to_size(out[b].shape)
    return out.reshape(*x.shape[:-1], 1)


def silu_backward_of_product_blocks(grad: torch.Tensor, up: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``Eager.silu_backward_of_product`` a block of elements at a time, from the 16-bit inputs: element-wise, so the
    same bits, without the two fp32 MLP-wide tensors an opaque call on the widened operands would materialise."""
    acc = compute_dtype(gate)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    flat, g, u, x = out.view(-1), grad.reshape(-1), up.reshape(-1), gate.reshape(-1)
    step = _BLOCK_BYTES // 4
    for i in range(0, flat.numel(), step):
        b = slice(i, i + step)
        flat[b] = torch.ops.aten.silu_backward(g[b].to(acc) * u[b].to(acc), x[b].to(acc))  # rounds as it stores
    return out


_lib.impl("rms_rstd", rms_rstd_rows, "CompositeExplicitAutograd")
_lib.impl("silu_backward_of_product", silu_backward_of_product_blocks, "CompositeExplicitAutograd")
_lib.impl("rms_grad_dot", rms_grad_dot_rows, "CompositeExplicitAutograd")
_lib.impl("sum_to", lambda t, size: t.sum_to_size(size), "CompositeExplicitAutograd")
_lib.impl("silu_backward", lambda grad, x: torch.ops.aten.silu_backward(grad, x), "CompositeExplicitAutograd")

_registered = False


def _register_lowerings() -> None:
    """Inductor lowerings for the two rounding primitives (once, on first use in a traced graph)."""
    global _registered
    if _registered:
        return
    from torch._inductor import lowering as L
    from torch._inductor.virtualized import ops

    @L.register_lowering(torch.ops.roundalign.round_to.default, type_promotion_kind=None)
    def _round_to(x, dtype):
        return L.to_dtype(x, dtype, copy=True, use_compute_types=False)  # a real conversion: r(x)

    @L.register_lowering(torch.ops.roundalign.widen.default, type_promotion_kind=None)
    @L.register_lowering(torch.ops.roundalign.widen_saved.default, type_promotion_kind=None)
    def _widen(x, dtype):
        src = x.get_dtype()

        def inner(v):
            # A value a fused producer computed in fp32 is rounded to its 16-bit dtype here, as storing it would.
            v16 = ops.to_dtype(v, src, use_compute_types=False)
            return ops.to_dtype(v16, dtype, use_compute_types=False)

        return L.make_pointwise(inner, override_return_dtype=dtype)(x)

    _registered = True


@torch.library.register_fake("roundalign::round_to")
def _(x, dtype):
    _register_lowerings()
    return torch.empty_like(x, dtype=dtype)


@torch.library.register_fake("roundalign::widen")
def _(x, dtype):
    _register_lowerings()
    return torch.empty_like(x, dtype=dtype)


@torch.library.register_fake("roundalign::widen_saved")
def _(x, dtype):
    _register_lowerings()
    return torch.empty_like(x, dtype=dtype)


torch.library.register_fake("roundalign::rms_rstd")(
    lambda x, eps: x.new_empty((*x.shape[:-1], 1), dtype=compute_dtype(x))
)
torch.library.register_fake("roundalign::rms_grad_dot")(
    lambda grad, weight, x, rounded_product: x.new_empty((*x.shape[:-1], 1), dtype=compute_dtype(x))
)
torch.library.register_fake("roundalign::sum_to")(lambda t, size: t.new_empty(size))
torch.library.register_fake("roundalign::silu_backward")(lambda grad, x: torch.empty_like(x))
torch.library.register_fake("roundalign::silu_backward_of_product")(
    lambda grad, up, gate: torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
)


def rstd_op(x32: torch.Tensor, eps: float, x: torch.Tensor | None = None) -> torch.Tensor:
    """nu(x) as an ATen call Inductor cannot see into (it would sum the squares in its own order), reading the
    16-bit ``x`` where given rather than its fp32 widening ``x32``."""
    return torch.ops.roundalign.rms_rstd(x32 if x is None else x, eps)


def grad_dot_op(grad, weight, x, rounded_product: bool) -> torch.Tensor:
    """RMSNorm backward's row sum ``sum(grad_normed * x32)`` as an opaque ATen call (``rms_grad_dot_rows``)."""
    return torch.ops.roundalign.rms_grad_dot(grad, weight, x, rounded_product)


def sum_to_op(t: torch.Tensor, shape) -> torch.Tensor:
    """``t.sum_to_size(shape)`` as an ATen call Inductor cannot see into; no call when nothing is summed."""
    if tuple(t.shape) == tuple(shape):
        return t
    return torch.ops.roundalign.sum_to(t, list(shape))


class Traced:
    """The rounding primitives of ``roundalign.numerics.formulas.Eager``, in a form Inductor keeps. ``widen`` is the
    widening op: ``roundalign::widen`` in forwards, ``roundalign::widen_saved`` in backwards."""

    def __init__(self, widen):
        self._widen = widen

    def to(self, t: torch.Tensor, dtype: torch.dtype, copy: bool = False) -> torch.Tensor:
        if t.dtype == dtype and dtype in LOW_PRECISION:
            # A no-op cast in eager, whose 16-bit tensor holds rounded values; here it may pass on a value a fused
            # producer left in fp32 registers (a gradient through an add), so settle it as stored.
            return torch.ops.roundalign.round_to(self._widen(t, torch.float32), dtype)
        if t.dtype == dtype:
            return t.clone() if copy else t
        if dtype in LOW_PRECISION and t.dtype not in LOW_PRECISION:
            return torch.ops.roundalign.round_to(t, dtype)
        if t.dtype in LOW_PRECISION and dtype not in LOW_PRECISION:
            return self._widen(t, dtype)
        return t.to(dtype)

    def ew(self, fn, *tensors: torch.Tensor) -> torch.Tensor:
        out = functools.reduce(torch.promote_types, [t.dtype for t in tensors])
        if out not in LOW_PRECISION:
            return fn(*(self.to(t, out) for t in tensors))
        wide = [self.to(t, torch.float32) for t in tensors]
        return self.to(fn(*wide), out)

    sum_to = staticmethod(sum_to_op)

    @staticmethod
    def silu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.roundalign.silu_backward(grad, x)

    def silu_backward_of_product(self, grad: torch.Tensor, up: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # The gradient settled as stored (see settle) before the opaque call reads it.
        return torch.ops.roundalign.silu_backward_of_product(self.settle(grad), up, gate)

    def settle(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as stored in its dtype, for an opaque op to read. A 16-bit value a fused producer computed is
        otherwise stored for the op and, in the same kernel, handed on unrounded to the code that widens it
        (Inductor forwards the stored value's fp32 source; seen on SwiGLU's backward)."""
        return self.to(t, t.dtype)


TRACED = Traced(torch.ops.roundalign.widen)
TRACED_BACKWARD = Traced(torch.ops.roundalign.widen_saved)
