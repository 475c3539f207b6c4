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
expression, so its gradient is stock HF's, bit for bit.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence

import torch


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


def _unalias(outs: tuple, inputs: tuple) -> tuple:
    """A custom op may not return its inputs or one tensor twice; the VJP of an add does both, so copy those."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
    fresh = []
    for t in outs:
        ptr = t.untyped_storage().data_ptr()
        # Contiguous, as the fake kernel promises (a transposed input's grad may come back with other strides).
        fresh.append(t.clone(memory_format=torch.contiguous_format) if ptr in seen else t.contiguous())
        seen.add(ptr)
    return tuple(fresh)


def _compiled(fn: Callable) -> Callable:
    """``run(key, *args)``: ``fn(*args)`` compiled by Inductor with explicit casts kept, one compile per ``key``.

    ``key`` is the op's constants (rule, dtype, eps): each gets its own copy of ``fn``'s code object, because
    Dynamo caches graphs, and counts recompiles against its limit of 8, per code object. Sharing one would let the
    rules of every model in the process, and their dtype and shape variants, evict each other into eager fallback.
    ``dynamic=None``: the first shape compiles static, a second one recompiles with dynamic sizes, so RL's varying
    sequence lengths do not recompile per length.
    """
    cache: dict = {}

    def run(key, *args):
        compiled = cache.get(key)
        if compiled is None:
            own = types.FunctionType(
                fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
            )
            compiled = cache[key] = torch.compile(own, dynamic=None, options={"emulate_precision_casts": True})
        return compiled(*args)

    return run


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
):
    """Register ``roundalign::name`` and its backward from ``formula(*tensors, *consts)``.

    ``consts`` are (schema type, name) pairs, e.g. ``("float", "eps")``; ``diff`` indexes the tensor inputs that
    get gradients. ``needed`` indexes the tensor inputs whose values the backward reads (default: all). Leave out
    an input the formula is linear in when nothing else needs its value (RoPE's ``x``, a residual add's operands):
    its vector-Jacobian product does not depend on it, so it is not saved, and the backward recomputes the formula
    with a zero of the same shape and dtype in its place. ``compile``: run the formula and its VJP through Inductor
    (module docstring). ``backward(*grads, *tensors, *consts)``: the formula's backward written out, returning the
    ``diff`` inputs' gradients; it runs in place of the VJP (eagerly, or through Inductor in the fused variant),
    spares functorch's per-call cost, and must equal autograd's bitwise, which the gradient tests check.
    ``rowwise``: the formula works row by row over the last dim, and every
    output has the first input's shape, so the compiled variant sees 2-D rows whatever the caller's rank (one graph
    for (B, T, H) activations and (B, T, heads, D) q/k alike: fewer recompiles). Returns a callable with autograd
    support.
    """
    t_args = ", ".join(f"Tensor {t}" for t in tensors)
    c_args = "".join(f", {ty} {n}" for ty, n in consts)
    outs = "Tensor" if n_out == 1 else "(" + ", ".join(["Tensor"] * n_out) + ")"
    grads_in = ", ".join(f"Tensor grad{i}" for i in range(n_out))
    grads_out = "(" + ", ".join(["Tensor"] * len(diff)) + ")" if len(diff) > 1 else "Tensor"
    nt = len(tensors)
    needed = tuple(range(nt)) if needed is None else tuple(needed)

    fused_formula = _compiled(formula) if compile else None

    def forward_impl(*args):
        ts, consts_ = args[:nt], args[nt:]  # the tensor inputs, the constants
        with torch.no_grad():
            if fused_formula is None:
                return formula(*args)
            if not rowwise:
                return fused_formula(consts_, *ts, *consts_)
            outs = fused_formula(consts_, *_as_rows(ts), *consts_)
            return _reshaped(outs, [ts[0].shape] * n_out)

    fwd = torch.library.custom_op(
        f"roundalign::{name}", forward_impl, mutates_args=(), schema=f"({t_args}{c_args}) -> {outs}"
    )
    fwd.register_fake(formula)

    def vjp(grads, ts, consts_):
        if backward is not None:
            got = backward(*grads, *ts, *consts_)
            return got if isinstance(got, tuple) else (got,)
        return _vjp(formula, ts, consts_, grads, diff)

    fused_vjp = _compiled(vjp) if compile else None

    def backward_impl(*args):
        grads, ts, consts_ = args[:n_out], args[n_out : n_out + nt], args[n_out + nt :]
        if fused_vjp is None:
            got = vjp(grads, ts, consts_)
        elif not rowwise:
            got = fused_vjp(consts_, grads, ts, consts_)
        else:
            got = fused_vjp(consts_, _as_rows(grads), _as_rows(ts), consts_)
            got = _reshaped(got, [ts[i].shape for i in diff])
        got = _unalias(got, args)
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
        ctx.save_for_backward(*(inputs[i] for i in needed))
        ctx.unsaved = {i: (t.shape, t.dtype, t.device) for i, t in enumerate(inputs[:nt]) if i not in needed}
        ctx.consts = inputs[nt:]

    def autograd_backward(ctx, *grads):
        saved = dict(zip(needed, ctx.saved_tensors, strict=True))
        for i, (shape, dtype, device) in ctx.unsaved.items():
            saved[i] = torch.zeros((), dtype=dtype, device=device).expand(shape)  # stands in for an unsaved input
        got = bwd(*grads, *(saved[i] for i in range(nt)), *ctx.consts)
        got = got if isinstance(got, tuple) else (got,)
        per_input = [None] * (nt + len(consts))
        for i, g in zip(diff, got, strict=True):
            per_input[i] = g
        return tuple(per_input)

    fwd.register_autograd(autograd_backward, setup_context=setup_context)
    return fwd
