"""The engine's GEMMs: one call per sequence, so that a sequence gets the same bits in any batch.

A GEMM library does not promise that a row of the product depends on that row alone. oneDNN picks its kernel (AMX
tiles or AVX-512 dot products on an Intel Xeon), its blocking and its split of the reduction over threads from the
shape of the call, so the same row in a 59-row call and in a 3-row call can differ in the last bit: on an Intel
Xeon with AMX-BF16 the engine's batched prefill gave a prompt another first log-prob than the prompt alone, while
an AMD EPYC (no bf16 oneDNN path) gave the same bits either way.

So the engine never lets two sequences share a GEMM call. Every linear is computed per sequence over that
sequence's rows: a prefill over the prompt's rows (the call the prompt gets alone, and the call a trainer makes for
one unpadded sequence), a decode step over its one row, the lm_head over the one row it samples from. A sequence's
result then does not depend on what else is in the batch on any CPU, because its calls are the same calls. The
price is more, smaller calls in a batched decode (docs/engine.md, "Batch invariance", has the throughput).

``linear`` is the eager function (the kernels backend, and the lm_head of both backends); ``roundalign::linear`` is
the same as an opaque ``torch.library`` op for the inductor backend, which reads the row groups from the engine's
forward context as ``roundalign::unified_attention`` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from roundalign import compile_key
from roundalign.engine.attention import current_step, own_rows


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows) -> torch.Tensor:
    """``F.linear`` of ``x`` (2-D), one call per ``(first row, count)`` in ``rows`` (which cover ``x``)."""
    if len(rows) == 1:
        return F.linear(x, weight, bias)
    return torch.cat([F.linear(own_rows(x[start : start + n]), weight, bias) for start, n in rows])


def logits(hidden: torch.Tensor, weight: torch.Tensor, groups) -> torch.Tensor:
    """The lm_head over ``hidden``, one call per ``(seq, first row, first position, rows)`` in ``groups``."""
    return linear(hidden, weight, None, [(start, n) for _, start, _, n in groups])


compile_key.key_compiles()  # graphs that call the op below: keyed on its sources


@torch.library.custom_op("roundalign::linear", mutates_args=())
def linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``linear`` over the current step's sequences; opaque to the compiler, like a GEMM's extern kernel call."""
    return linear(x, weight, bias, current_step().gemm_rows(x.shape[0]))


@linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])
