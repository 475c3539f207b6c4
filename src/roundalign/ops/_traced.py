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

Reductions stay in ATen's summation order, and SiLU's backward in ATen's arithmetic (Inductor's decomposition of
it associates the products otherwise than ATen's kernel, which moves a few fp16 gradients by one unit in the last
place). In our own fused kernels (``TRACED``, ``TRACED_BACKWARD``) they are opaque ATen calls
(``roundalign::rms_rstd``, ``roundalign::sum_to``, ``roundalign::silu_backward``), which Inductor fuses with their
widenings. The formulas are the same functions as the eager ones (``roundalign.numerics.formulas``), called with
``num=TRACED`` instead of ``num=EAGER``; tests/test_ops_compiled.py checks a compiled model against the eager ops bit
for bit.

**Inside a compiled model** (``IN_MODEL``, ``IN_MODEL_BACKWARD``) an opaque call is a fusion barrier, and its
operands are materialised: a reduction over a widened 16-bit activation costs an fp32 copy of it, SwiGLU's backward
two fp32 MLP-wide tensors, held at the backward's peak where stock's fused code holds nothing. So there:

- RMSNorm's row sums (the variance, the backward's ``sum(grad_normed * x)``) are ATen's summation order written as
  tensor ops (``roundalign.ops._cascade``), which Inductor fuses with the squares and products that feed them;
- SiLU's backward reads the stored 16-bit tensors (``roundalign::silu_backward_of_product``) by a C kernel that
  restates ATen's (``roundalign.ops._aten``), else ATen's call on about 1 MiB of widened elements at a time; under
  ``torch.compile`` SwiGLU's two gradients come from one call that writes the gate's over the incoming gradient
  (``roundalign::swiglu_backward_``), so that Inductor holds no third MLP-wide buffer;
- where ``_cascade`` cannot say ATen's order (an ATen whose order it does not match, rows of 32,768 or more), the row
  sums are opaque ops over the stored tensors too (``roundalign::rms_rstd_rows``, ``rms_row_dot_rows``): ATen's
  calls on about 1 MiB of widened rows at a time, the same bits, since rows are reduced alone;
- the weights' gradients, sums over every token, are ATen's column order written as tensor ops too
  (``_cascade.column_sum``) where every column falls in a whole block of 4 W columns (hidden sizes that are
  multiples of 32 at W = 8); elsewhere ATen orders a column's sum by its place in such blocks, and so by how its
  threads split the columns, and the sums stay opaque ATen calls (``roundalign::sum_to``).

Without Inductor (another backend) the primitives run as the plain casts they stand for: the same numbers. Their
Inductor lowerings register the first time a graph uses them (their fake kernels run while Dynamo traces, before
Inductor lowers), so importing roundalign never imports Inductor.
"""

from __future__ import annotations

import functools

import torch

from roundalign import compile_key
from roundalign.numerics.dtypes import LOW_PRECISION, compute_dtype
from roundalign.numerics.formulas import EAGER, Eager, rstd_aten
from roundalign.ops import _aten, _cascade

compile_key.key_compiles()  # graphs that call these ops: keyed on their sources (roundalign/compile_key.py)
_lib = torch.library.Library("roundalign", "FRAGMENT")  # plain dispatcher ops: a fraction of custom_op's call cost
# Tagged pointwise: AOTAutograd's partitioner may then recompute them in the backward from the saved 16-bit tensors
# rather than save their fp32 results (twice the bytes), as it does for stock casts.
_lib.define("round_to(Tensor x, ScalarType dtype) -> Tensor", tags=(torch.Tag.pointwise,))
_lib.define("widen(Tensor x, ScalarType dtype) -> Tensor", tags=(torch.Tag.pointwise,))
# The same widening, read by a backward from its saved 16-bit inputs. A second op so that AOTAutograd does not merge
# it with the forward's widening of the same tensor: the merged node's fp32 result would be saved for the backward
# (twice the bytes of the 16-bit input). The partitioner counts it as pointwise (_recomputable_in_backward).
_lib.define("widen_saved(Tensor x, ScalarType dtype) -> Tensor", tags=(torch.Tag.pointwise,))
_lib.define("rms_rstd(Tensor x32, float eps) -> Tensor")
_lib.define("sum_to(Tensor t, SymInt[] size) -> Tensor")
_lib.define("silu_backward(Tensor grad, Tensor x) -> Tensor")
_lib.define("rms_rstd_rows(Tensor x, float eps) -> Tensor")
_lib.define("rms_row_dot_rows(Tensor grad, Tensor weight, Tensor x, bool rounded_product) -> Tensor")
_lib.define("silu_backward_of_product(Tensor grad, Tensor up, Tensor gate) -> Tensor")
# SwiGLU's backward (rule once) in one call that writes the gate's gradient over grad and returns up's: inside a
# compiled model grad is dead after it, so Inductor holds two MLP-wide buffers here, as for stock's fused kernel,
# not three (grad, the up gradient and the call's result). Nothing else reads grad, so no read of it can be
# scheduled after the write.
_lib.define("swiglu_backward_(Tensor(a!) grad, Tensor up, Tensor gate) -> Tensor")

_lib.impl("round_to", lambda x, dtype: x.to(dtype), "CompositeExplicitAutograd")
_lib.impl("widen", lambda x, dtype: x.to(dtype), "CompositeExplicitAutograd")
_lib.impl("widen_saved", lambda x, dtype: x.to(dtype), "CompositeExplicitAutograd")
_lib.impl("rms_rstd", rstd_aten, "CompositeExplicitAutograd")
_lib.impl("sum_to", lambda t, size: t.sum_to_size(size), "CompositeExplicitAutograd")
_lib.impl("silu_backward", lambda grad, x: torch.ops.aten.silu_backward(grad, x), "CompositeExplicitAutograd")

_BLOCK_BYTES = 1 << 20  # fp32 bytes a block widens: cache-sized; one block for a narrow model's activations


def _blocks(n_rows: int, row_len: int) -> list[slice]:
    step = max(1, _BLOCK_BYTES // (4 * max(row_len, 1)))
    return [slice(i, i + step) for i in range(0, n_rows, step)]


# In place where eager allocates: `a *= b` with fp32 `a` and 16-bit `b` widens `b` exactly, as `a * b.float()`
# does, and a reduction's `out=` variant is the same kernel as its functional one (tests/test_ops_in_graph.py
# compares with the eager formulas bit for bit, across block edges).


def rms_rstd_rows(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``rstd_aten(x.to(fp32), eps)`` a block of rows at a time: the same bits, since ATen reduces each row of an
    inner-dim reduction alone."""
    acc = compute_dtype(x)
    rows = x.reshape(-1, x.shape[-1])
    out = rows.new_empty((rows.shape[0], 1), dtype=acc)
    for b in _blocks(*rows.shape):
        sq = rows[b].to(acc, copy=True)
        torch.mean(sq.mul_(sq), -1, keepdim=True, out=out[b])  # mean(x^2): pow(2) is x * x
    return out.add_(eps).rsqrt_().reshape(*x.shape[:-1], 1)


def rms_row_dot_rows(grad: torch.Tensor, weight: torch.Tensor, x: torch.Tensor, rounded_product: bool) -> torch.Tensor:
    """``Eager.row_dot`` from the 16-bit ``grad`` and ``x``, a block of rows at a time."""
    acc = compute_dtype(x)
    n = x.shape[-1]
    g_rows, x_rows = grad.reshape(-1, n), x.reshape(-1, n)
    out = x_rows.new_empty((x_rows.shape[0], 1), dtype=acc)
    for b in _blocks(*x_rows.shape):
        # grad_normed: r(grad * weight) widened, or grad32 * weight32
        grad_normed = (g_rows[b] * weight).to(acc) if rounded_product else g_rows[b].to(acc).mul_(weight)
        torch.sum(grad_normed.mul_(x_rows[b]), -1, keepdim=True, out=out[b])
    return out.reshape(*x.shape[:-1], 1)


def silu_backward_of_product_blocks(grad: torch.Tensor, up: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``Eager.silu_backward_of_product``: by the SiLU kernel (``_aten``), else a block of elements at a time
    (element-wise, so the same bits)."""
    out = _aten.silu_backward_of_product(grad, up, gate)
    if out is not None:
        return out
    acc = compute_dtype(gate)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    flat, g, u, x = out.view(-1), grad.reshape(-1), up.reshape(-1), gate.reshape(-1)
    step = _BLOCK_BYTES // 8  # two fp32 blocks live at once
    for i in range(0, flat.numel(), step):
        b = slice(i, i + step)
        product = g[b].to(acc, copy=True).mul_(u[b])  # grad32 * up32
        torch.ops.aten.silu_backward.grad_input(product, x[b].to(acc), grad_input=product)
        flat[b].copy_(product)  # rounds to the gate's dtype, as .to() does
    return out


_lib.impl("rms_rstd_rows", rms_rstd_rows, "CompositeExplicitAutograd")
_lib.impl("rms_row_dot_rows", rms_row_dot_rows, "CompositeExplicitAutograd")
_lib.impl("silu_backward_of_product", silu_backward_of_product_blocks, "CompositeExplicitAutograd")


def swiglu_backward_(grad: torch.Tensor, up: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``Eager.swiglu_backward``'s two gradients, the gate's written over ``grad``: by the SiLU kernel, else by
    the eager formulas themselves."""
    if grad.is_contiguous():
        done = _aten.silu_backward_of_product(grad, up, gate, out=grad, with_up=True)
        if done is not None:
            return done[1]
    grad_gate, grad_up = EAGER.swiglu_backward(grad, up, gate)
    grad.copy_(grad_gate)
    return grad_up


_lib.impl("swiglu_backward_", swiglu_backward_, "CompositeExplicitAutograd")

_registered = False


def _register_lowerings() -> None:
    """Inductor lowerings for the two rounding primitives (once, on first use in a traced graph)."""
    global _registered
    compile_key.key_compiles()  # again at trace time: the user may have set torch's cache key tag since the import
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

    _recomputable_in_backward()
    _registered = True


def _recomputable_in_backward() -> None:
    """Let AOTAutograd's partitioner count ``widen_saved`` as one of its own pointwise ops, as it does ATen's casts.

    Its op lists hold ATen's pointwise ops only (``torch.Tag.pointwise`` is read from ``torch.ops.aten`` alone), so
    a value a backward widened through ``widen_saved`` counted as "materialized in the backward" and was never
    recomputed there, only saved: RoPE's bf16 cos and sin, which stock's compiled graph recomputes from the
    positions. Only ``widen_saved``: letting the partitioner also recompute ``round_to`` and ``widen`` moved what
    it saved elsewhere (a higher peak, not a lower one).
    The lowering above computes the same bits wherever the widening runs."""
    from torch._functorch import partitioners

    get = partitioners.get_default_op_list
    if getattr(get, "_roundalign", False):
        return

    @functools.wraps(get)
    def with_ours():
        types = get()
        types.recomputable_ops.add(torch.ops.roundalign.widen_saved)
        types.fusible_ops.add(torch.ops.roundalign.widen_saved)
        return types

    with_ours._roundalign = True
    partitioners.get_default_op_list = with_ours


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


torch.library.register_fake("roundalign::rms_rstd")(lambda x32, eps: x32.new_empty((*x32.shape[:-1], 1)))
torch.library.register_fake("roundalign::sum_to")(lambda t, size: t.new_empty(size))
torch.library.register_fake("roundalign::silu_backward")(lambda grad, x: torch.empty_like(x))
torch.library.register_fake("roundalign::rms_rstd_rows")(
    lambda x, eps: x.new_empty((*x.shape[:-1], 1), dtype=compute_dtype(x))
)
torch.library.register_fake("roundalign::rms_row_dot_rows")(
    lambda grad, weight, x, rounded_product: x.new_empty((*x.shape[:-1], 1), dtype=compute_dtype(x))
)
torch.library.register_fake("roundalign::silu_backward_of_product")(lambda grad, up, gate: torch.empty_like(gate))
torch.library.register_fake("roundalign::swiglu_backward_")(lambda grad, up, gate: torch.empty_like(up))


def rstd_op(x32: torch.Tensor, eps: float) -> torch.Tensor:
    """nu(x) as an ATen call Inductor cannot see into (it would sum the squares in its own order)."""
    return torch.ops.roundalign.rms_rstd(x32, eps)


def sum_to_op(t: torch.Tensor, shape) -> torch.Tensor:
    """``t.sum_to_size(shape)`` as an ATen call Inductor cannot see into; no call when nothing is summed."""
    if tuple(t.shape) == tuple(shape):
        return t
    return torch.ops.roundalign.sum_to(t, list(shape))


class Traced(Eager):
    """The rounding primitives of ``roundalign.numerics.formulas.Eager``, in a form Inductor keeps. ``widen`` is the
    widening op: ``roundalign::widen`` in forwards, ``roundalign::widen_saved`` in backwards. ``in_model``: the
    reductions and SiLU's backward read the stored 16-bit tensors a block at a time (the module docstring)."""

    def __init__(self, widen, in_model: bool = False):
        self._widen = widen
        self.in_model = in_model

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

    def settle(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as stored in its dtype, for an opaque op to read. A 16-bit value a fused producer computed is
        otherwise stored for the op and, in the same kernel, handed on unrounded to code that widens it (Inductor
        forwards the stored value's fp32 source; seen on SwiGLU's backward)."""
        return self.to(t, t.dtype)

    def sum_to(self, t: torch.Tensor, shape) -> torch.Tensor:
        if self.in_model and _fusable_columns(t, shape):  # a weight's gradient: the sum over every token
            s = _cascade.column_sum(self.to(t, torch.float32))
            return s if t.dtype == torch.float32 else self.to(s, t.dtype)  # ATen's sum rounds once, to t's dtype
        return sum_to_op(t, shape)

    @staticmethod
    def silu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.roundalign.silu_backward(grad, x)

    # The in-model forms read the 16-bit tensors as stored. Only a gradient is settled first: the activations a
    # backward reads are saved tensors, stored already, and settling them would copy them.

    def rstd(self, x32: torch.Tensor, eps: float, x: torch.Tensor) -> torch.Tensor:
        if self.in_model and (lanes := _fusable_sum(x32)):  # ATen's mean: its sum divided by the count
            return torch.rsqrt(_cascade.row_sum(x32 * x32, lanes) / x32.shape[-1] + eps).unsqueeze(-1)
        if self.in_model:
            return torch.ops.roundalign.rms_rstd_rows(x, eps)
        return rstd_op(x32, eps)

    def row_dot(self, grad_normed, x32, grad, weight, x, rounded_product: bool) -> torch.Tensor:
        if self.in_model and (lanes := _fusable_sum(x32)):
            return _cascade.row_sum(grad_normed * x32, lanes).unsqueeze(-1)
        if self.in_model and x.dtype in LOW_PRECISION and grad.dtype == x.dtype:
            return torch.ops.roundalign.rms_row_dot_rows(self.settle(grad), weight, x, rounded_product)
        return super().row_dot(grad_normed, x32, grad, weight, x, rounded_product)

    def silu_backward_of_product(self, grad: torch.Tensor, up: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.in_model:
            return torch.ops.roundalign.silu_backward_of_product(self.settle(grad), up, gate)
        return super().silu_backward_of_product(grad, up, gate)

    def swiglu_backward(self, grad: torch.Tensor, up: torch.Tensor, gate: torch.Tensor):
        if self.in_model and torch.compiler.is_compiling():
            # One call, the gate's gradient written over grad (no third MLP-wide buffer). Tracing only: in eager,
            # grad is autograd's tensor (perhaps expanded), not ours to overwrite.
            grad_up = torch.ops.roundalign.swiglu_backward_(grad, up, gate)
            return grad, grad_up
        return super().swiglu_backward(grad, up, gate)


def _fusable_sum(x32: torch.Tensor) -> int | None:
    """ATen's lane count where a row sum over ``x32`` can be written in tensor ops (``_cascade``), else None: fp32
    rows on the CPU shorter than ATen's grain (a longer single row is split over threads, another order)."""
    if x32.dtype != torch.float32 or x32.device.type != "cpu" or x32.shape[-1] >= _aten.GRAIN:
        return None
    return _cascade.width()


def _fusable_columns(t: torch.Tensor, shape) -> bool:
    """Whether ``t.sum_to_size(shape)`` sums every leading dim of a CPU tensor into its last and ATen orders each of
    its columns' sums as ``_cascade.column_sum`` does (``_cascade.columns_in_order``)."""
    if t.device.type != "cpu" or t.dim() < 2 or tuple(shape) != (t.shape[-1],):
        return False
    if t.dtype not in (torch.float32, *LOW_PRECISION) or (lanes := _cascade.width()) is None:
        return False
    return _cascade.columns_in_order(t.shape[-1], t.dtype, lanes)


TRACED = Traced(torch.ops.roundalign.widen)
TRACED_BACKWARD = Traced(torch.ops.roundalign.widen_saved)
IN_MODEL = Traced(torch.ops.roundalign.widen, in_model=True)
IN_MODEL_BACKWARD = Traced(torch.ops.roundalign.widen_saved, in_model=True)
