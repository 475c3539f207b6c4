"""Turn a rounding formula into an op with the right backward and no surprises under torch.compile.

Each op in ``roundalign.ops`` is written once, as a formula: plain torch code in which every rounding point is an
explicit cast, ``r(t) = t.to(out_dtype)``. This module makes two custom ops from a formula
(``torch.library.custom_op``):

- ``roundalign::<name>`` runs the formula. It is opaque to Inductor. That matters: Inductor drops explicit bf16
  casts inside the kernels it fuses (``emulate_precision_casts=False``), so a formula traced into a compiled graph
  would lose its rounding points. As an opaque op it runs exactly as in eager mode, and compiled numerics equal
  eager numerics bit for bit.
- ``roundalign::<name>_backward`` recomputes the formula under autograd and returns its vector-Jacobian product.
  Only the op's inputs (bf16) are saved for backward, never the fp32 intermediates, and only those whose values the
  backward reads (RoPE's ``x`` and the residual add's operands are not), so the saved activation bytes stay at or
  below stock HF's for the same region.

**The compiled variant** (``compile=True``, registered as ``roundalign::<name>_compiled``; ``apply(...,
compile_ops=True)`` uses it) runs the same formula, and its backward, through ``torch.compile`` with Inductor's
``emulate_precision_casts=True``, which keeps every explicit cast as a rounding point. Inductor then fuses each
formula into one kernel with no fp32 temporaries in memory. Elementwise arithmetic is the same IEEE operations in
either mode; a *reduction* is not (Inductor sums in its own order), so a formula with one (RMSNorm's variance, its
backward's sums) keeps each reduction in an opaque ATen op inside the fused kernel chain. tests/test_ops_compiled.py
checks the compiled variant against the eager one bit for bit.

The gradient is therefore autograd's gradient of the formula itself: a rule that rounds once is written as
``(fp32 formula).to(bf16)``, whose casts are straight-through in backward, so its gradient is the gradient of the
fp32 formula rounded once to the input dtype. A rule that rounds per op (HF's) is written as HF's bf16
expression, so its gradient is stock HF's, bit for bit. (One exception: a norm of the fp32 residual sum ``S`` is
differentiated at ``R = r(S)``; ``roundalign.ops.rms_norm`` says why.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from roundalign.ops import _fused
from roundalign.ops._traced import IN_MODEL, IN_MODEL_BACKWARD, TRACED, TRACED_BACKWARD


def _vjp(formula: Callable, tensors: Sequence[torch.Tensor], consts: Sequence, grads, diff: Sequence[int]):
    # torch.func.vjp, not torch.autograd.grad: a custom op's kernel runs below the autograd dispatch key, where
    # plain autograd records nothing; functorch's transform re-enables it for its own level.
    def of_diff(*diff_tensors):
        args = list(tensors)
        for i, t in zip(diff, diff_tensors, strict=True):
            args[i] = t
        outs = formula(*args, *consts)
        return outs if isinstance(outs, tuple) else (outs,)

    _, pullback = torch.func.vjp(of_diff, *[tensors[i] for i in diff])
    return tuple(pullback(tuple(grads)))


def _unalias(outs: tuple, inputs: tuple, contiguous: bool = True) -> tuple:
    """A custom op may not return its inputs or one tensor twice, and autograd may accumulate into a gradient it
    was handed; the VJP of an add does both, so copy those. ``contiguous``: as the custom op's fake kernel
    promises."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
    fresh = []
    for t in outs:
        ptr = t.untyped_storage().data_ptr()
        # Contiguous, as the fake kernel promises (a transposed input's grad may come back with other strides).
        if ptr in seen:
            t = t.clone(memory_format=torch.contiguous_format)
        elif contiguous:
            t = t.contiguous()
        fresh.append(t)
        seen.add(ptr)
    return tuple(fresh)


def _as_rows(tensors) -> tuple:
    """Tensors of rank >= 2 as 2-D rows over their last dim (a view when possible); 1-D ones (weights) as they are."""
    return tuple(t.reshape(-1, t.shape[-1]) if t.dim() >= 2 else t for t in tensors)


def _reshaped(outs, shapes):
    if isinstance(outs, torch.Tensor):
        return outs.reshape(shapes[0])
    return tuple(t.reshape(shape) for t, shape in zip(outs, shapes, strict=True))


def define(
    name: str,
    formula: Callable,
    tensors: Sequence[str],
    consts: Sequence[tuple[str, str]],
    n_out: int,
    diff: Sequence[int],
    needed: Sequence[int] | None = None,
    compile: bool = False,
    backward: Callable | None = None,
    rowwise: bool = False,
) -> Op:
    """Make the op ``name`` from ``formula(*tensors, *consts)``: an ``Op`` whose call has autograd support.

    ``consts`` are (schema type, name) pairs, e.g. ``("float", "eps")``; ``diff`` indexes the tensor inputs that
    get gradients. ``needed`` indexes the tensor inputs whose values the backward reads (default: all). Leave out
    an input the formula is linear in when nothing else needs its value (RoPE's ``x``, a residual add's operands):
    its vector-Jacobian product does not depend on it, so it is not saved, and the backward recomputes the formula
    with a zero of the same shape and dtype in its place. ``compile``: the fused variant (``roundalign.ops._fused``).
    ``backward(*grads, *tensors, *consts)``: the formula's backward written out, returning the ``diff`` inputs'
    gradients; it runs in place of the VJP (eagerly, or fused), spares functorch's per-call cost, and must equal
    autograd's bitwise, which the gradient tests check. ``rowwise``: the formula works row by row over the last dim,
    and every output has the first input's shape, so the fused variant sees 2-D rows whatever the caller's rank
    (one kernel for (B, T, H) activations and (B, T, heads, D) q/k alike).

    With a ``backward``, ``formula`` and ``backward`` take the rounding primitives as ``num``
    (``roundalign.numerics.formulas``), and the op gets two traced forms (``roundalign.ops._traced``): with
    ``TRACED``/``TRACED_BACKWARD`` for its fused kernels, and with ``IN_MODEL``/``IN_MODEL_BACKWARD`` for a compiled
    model that traces it.
    """
    forms = None
    if backward is not None:
        forms = {
            "traced": (functools.partial(formula, num=TRACED), functools.partial(backward, num=TRACED_BACKWARD)),
            "in_model": (functools.partial(formula, num=IN_MODEL), functools.partial(backward, num=IN_MODEL_BACKWARD)),
        }
    return Op(name, formula, tensors, consts, n_out, diff, needed, compile, backward, rowwise, forms)


def define_pair(name: str, formula: Callable, *args, **kwargs) -> tuple[Op, Op]:
    """The op ``name`` and its fused variant ``name_compiled`` (``compile=True``), from one set of ``define``'s
    arguments."""
    return define(name, formula, *args, **kwargs), define(f"{name}_compiled", formula, *args, compile=True, **kwargs)


class Op:
    """One op, two ways in: a direct ``autograd.Function`` in eager mode (no dispatcher, no guards: the per-call cost
    that dominates a narrow model), and a ``torch.library`` custom op while Dynamo traces, which Inductor treats as
    opaque so that its rounding points survive a compiled model. Both run the same kernels and backward."""

    def __init__(self, name, formula, tensors, consts, n_out, diff, needed, compile, backward, rowwise, forms):
        self.name, self.formula, self.n_out, self.diff = name, formula, n_out, tuple(diff)
        self.nt = nt = len(tensors)
        self.needed = tuple(range(nt)) if needed is None else tuple(needed)
        self.rowwise = rowwise
        self._backward = backward
        # The fused kernels compile the traced forms, whose rounding points and opaque ATen calls Inductor keeps.
        fwd, bwd = forms["traced"] if forms is not None else (formula, self._vjp_flat)
        self._fwd_kernels = _fused.Kernels(name, fwd) if compile else None
        self._bwd_kernels = _fused.Kernels(f"{name}_backward", _as_tuple(bwd)) if compile else None
        self.function = _function(self)
        self.op = self._register(tensors, consts)
        self.traced_function = _traced_function(self, *forms["in_model"]) if forms is not None else None

    # -- the computation, shared by both ways in --------------------------------------------------------------

    def forward_kernel(self, ts: tuple, consts: tuple):
        if self._fwd_kernels is not None:
            rows = _as_rows(ts) if self.rowwise else ts
            out = self._fwd_kernels.run(rows, consts)
            if out is not None:
                return _reshaped(out, [ts[0].shape] * self.n_out) if self.rowwise else out
        return self.formula(*ts, *consts)

    def _vjp_flat(self, *args):
        """``(*grads, *tensors, *consts) -> diff grads``: the written-out backward, else autograd's VJP."""
        grads, ts, consts = args[: self.n_out], args[self.n_out : self.n_out + self.nt], args[self.n_out + self.nt :]
        if self._backward is not None:
            got = self._backward(*grads, *ts, *consts)
            return got if isinstance(got, tuple) else (got,)
        return _vjp(self.formula, ts, consts, grads, self.diff)

    def backward_kernel(self, grads: tuple, ts: tuple, consts: tuple) -> tuple:
        got = None
        if self._bwd_kernels is not None:
            if self.rowwise:
                got = self._bwd_kernels.run((*_as_rows(grads), *_as_rows(ts)), consts)
                if got is not None:
                    got = _reshaped(got, [ts[i].shape for i in self.diff])
            else:
                got = self._bwd_kernels.run((*grads, *ts), consts)
        if got is None:
            got = self._vjp_flat(*grads, *ts, *consts)
        return got if isinstance(got, tuple) else (got,)

    # -- the way in while Dynamo traces: custom ops ------------------------------------------------------------

    def _register(self, tensors, consts):
        nt, n_out, diff, name = self.nt, self.n_out, self.diff, self.name
        t_args = ", ".join(f"Tensor {t}" for t in tensors)
        c_args = "".join(f", {ty} {n}" for ty, n in consts)
        outs = "Tensor" if n_out == 1 else "(" + ", ".join(["Tensor"] * n_out) + ")"
        grads_in = ", ".join(f"Tensor grad{i}" for i in range(n_out))
        grads_out = "(" + ", ".join(["Tensor"] * len(diff)) + ")" if len(diff) > 1 else "Tensor"

        def forward_impl(*args):
            with torch.no_grad():
                out = self.forward_kernel(args[:nt], args[nt:])
            return _outputs(self, out, args)

        fwd = torch.library.custom_op(
            f"roundalign::{name}", forward_impl, mutates_args=(), schema=f"({t_args}{c_args}) -> {outs}"
        )
        fwd.register_fake(self.formula)

        def backward_impl(*args):
            grads, ts, consts_ = args[:n_out], args[n_out : n_out + nt], args[n_out + nt :]
            got = _unalias(self.backward_kernel(grads, ts, consts_), args)
            return got if len(diff) > 1 else got[0]

        bwd = torch.library.custom_op(
            f"roundalign::{name}_backward",
            backward_impl,
            mutates_args=(),
            schema=f"({grads_in}, {t_args}{c_args}) -> {grads_out}",
        )

        @bwd.register_fake
        def _(*args):
            rest = args[n_out:]
            got = tuple(rest[i].new_empty(rest[i].shape) for i in diff)
            return got if len(diff) > 1 else got[0]

        def setup_context(ctx, inputs, output):
            _save(ctx, self, inputs)

        def autograd_backward(ctx, *grads):
            got = bwd(*grads, *_saved(ctx, self), *ctx.consts)
            return _per_input(self, got if isinstance(got, tuple) else (got,), len(ctx.consts))

        fwd.register_autograd(autograd_backward, setup_context=setup_context)
        return fwd

    def __call__(self, *args):
        if torch.compiler.is_compiling():
            # Inside a compiled model: the traced formula, fused with its neighbours, rounding points kept. The
            # opaque custom op only for an op without one.
            return self.op(*args) if self.traced_function is None else self.traced_function.apply(*args)
        return self.function.apply(*args)


def _as_tuple(fn: Callable) -> Callable:
    def run(*args):
        out = fn(*args)
        return out if isinstance(out, tuple) else (out,)

    return run


def _outputs(op: Op, out, inputs: tuple):
    """The forward's outputs as the op returns them, none of them one of its inputs."""
    outs = _unalias(out if isinstance(out, tuple) else (out,), inputs, contiguous=False)
    return outs[0] if op.n_out == 1 else outs


def _save(ctx, op: Op, inputs: tuple) -> None:
    nt = op.nt
    ctx.save_for_backward(*(inputs[i] for i in op.needed))
    ctx.unsaved = {i: (t.shape, t.dtype, t.device) for i, t in enumerate(inputs[:nt]) if i not in op.needed}
    ctx.consts = tuple(inputs[nt:])


def _saved(ctx, op: Op) -> tuple:
    saved = dict(zip(op.needed, ctx.saved_tensors, strict=True))
    for i, (shape, dtype, device) in ctx.unsaved.items():
        saved[i] = torch.zeros((), dtype=dtype, device=device).expand(shape)  # stands in for an unsaved input
    return tuple(saved[i] for i in range(op.nt))


def _per_input(op: Op, got: tuple, n_consts: int) -> tuple:
    per_input = [None] * (op.nt + n_consts)
    for i, g in zip(op.diff, got, strict=True):
        per_input[i] = g
    return tuple(per_input)


def _function(op: Op) -> type[torch.autograd.Function]:
    """The eager way in. Autocast is off inside, as it is inside a custom op's kernel: the formulas choose their
    own dtypes."""

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            ts, consts = args[: op.nt], args[op.nt :]
            device = ts[0].device.type
            if torch.is_autocast_enabled(device):
                with torch.autocast(device, enabled=False):
                    out = op.forward_kernel(ts, consts)
            else:
                out = op.forward_kernel(ts, consts)
            _save(ctx, op, args)
            return _outputs(op, out, args)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, *grads):
            got = _unalias(op.backward_kernel(grads, _saved(ctx, op), ctx.consts), grads, contiguous=False)
            return _per_input(op, got, len(ctx.consts))

    Function.__name__ = Function.__qualname__ = f"{op.name}_function"
    return Function


def _traced_function(op: Op, forward: Callable, backward: Callable) -> type[torch.autograd.Function]:
    """The way in while Dynamo traces: an ``autograd.Function`` it traces into the graph, forward and backward, so
    that Inductor fuses both with the model's own code (``roundalign.ops._traced``)."""

    class Traced(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            _save(ctx, op, args)  # only the inputs whose values the backward reads, as in eager
            return forward(*args)

        @staticmethod
        def backward(ctx, *grads):
            got = backward(*grads, *_saved(ctx, op), *ctx.consts)
            return _per_input(op, got if isinstance(got, tuple) else (got,), len(ctx.consts))

    Traced.__name__ = Traced.__qualname__ = f"{op.name}_traced"
    return Traced
