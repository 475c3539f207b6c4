"""ATen's row-sum order written as tensor ops, so that a compiled model's RMSNorm reductions fuse with their neighbours.

A compiled model's RMSNorm must sum each row (the variance's ``x^2``, the backward's ``grad_normed * x``) in ATen's
order to equal the eager ops bit for bit; Inductor's own reductions add in another order. An opaque op that sums in
ATen's order (``roundalign::rms_rstd_rows``, ATen's own call) keeps the bits but is a fusion barrier: its
operand is stored for it, and what follows it starts a new kernel. ``row_sum`` writes ATen's order itself as
reshapes and small sums, which Inductor lowers as it lowers any reduction, fused with the square that feeds it:

ATen's CPU ``sum`` over a contiguous last dim (``aten/src/ATen/native/cpu/SumKernel.cpp``, ``cascade_sum`` ->
``vectorized_inner_sum``) reads a row as W-lane vectors (W = ``Vectorized<float>::size()`` of the kernel it
dispatches to). Groups of four vectors go to four interleaved accumulators, each a cascade (``multi_row_sum``) whose
level 0 closes every ``step`` groups into level 1, level 1 every ``step`` of those into level 2, and so on
(``step = 2^max(4, ceil(log2(groups)) / 4)``); then come the leftover groups into level 0, the upper levels into
level 0, the vectors past the last whole group into accumulator 0, accumulators 1-3 into accumulator 0, and last a
scalar total: the elements past the last whole vector from 0, then accumulator 0's W lanes in order. Each of those
steps is a sequential sum over one small dim here, a sum Inductor computes in order (its CPU code vectorises over
the W lanes, which are independent sums). Rows shorter than one vector take the same cascade on single elements
(``scalar_inner_sum``, W = 1).

A weight's gradient sums a tensor over every token: ATen's contiguous outer sum (``vectorized_outer_sum``) sums each
column of a whole block of 4 W columns by the same cascade over the rows, without the interleaving (``column_sum``);
``columns_in_order`` says when every column is in such a block.

``width()`` probes which W this machine's ATen uses (8 under its AVX2 and default kernels, 16 under AVX-512), by
comparing ``row_sum`` with ``torch.sum`` on random rows: exactly one W must agree, else None and the callers keep
the opaque ops. tests/test_cascade_sum.py checks both sums against ATen's, eager and compiled;
tests/test_ops_in_graph.py the compiled ops against the eager ones bit for bit.
"""

from __future__ import annotations

import functools

import torch

_LEVELS = 4  # multi_row_sum's levels: level 0 and three above it


def _ceil_log2(x: int) -> int:  # ATen's utils::CeilLog2
    return 1 if x <= 2 else (x - 1).bit_length()


def _in_order(parts: torch.Tensor, dim: int) -> torch.Tensor:
    """``parts`` summed over ``dim`` from 0, one after the other (what Inductor and ATen do with a short dim)."""
    return parts.sum(dim) if parts.shape[dim] else parts.new_zeros(parts.shape[:dim] + parts.shape[dim + 1 :])


def multi_row_sum(parts: torch.Tensor, dim: int) -> torch.Tensor:
    """ATen's ``multi_row_sum``: ``parts`` summed over ``dim`` (negative) as its cascade sums them. Blocks of ``step``
    consecutive entries are summed from 0 (level 0), blocks of ``step`` of those (level 1) and so on; the entries past
    the last whole block of each level stay open, and the open sums are added last, level 0 first."""
    size, rest = parts.shape[dim], parts.shape[dim + 1 :] if dim != -1 else ()
    lead = parts.shape[:dim]
    step = 1 << max(_ceil_log2(size) // 4, 4)
    open_parts = []
    for _ in range(_LEVELS - 1):
        closed = parts.shape[dim] // step
        open_parts.append(_in_order(parts.narrow(dim, closed * step, parts.shape[dim] - closed * step), dim))
        parts = parts.narrow(dim, 0, closed * step).reshape(*lead, closed, step, *rest).sum(dim)
        if closed == 0:
            break
    else:
        open_parts.append(_in_order(parts, dim))  # the top level keeps every block
    acc = open_parts[0]
    for part in open_parts[1:]:
        acc = acc + part
    return acc


def row_sum(v: torch.Tensor, width: int) -> torch.Tensor:
    """``v.sum(-1)`` for fp32 ``v``, bit for bit as ATen computes it with ``width`` lanes, in tensor ops."""
    n, lead = v.shape[-1], v.shape[:-1]
    lanes = width if n >= width else 1  # a row shorter than a vector: scalar_inner_sum, the same cascade
    vectors = n // lanes
    groups = vectors // 4
    # [groups, 4, lanes]: group i holds vectors 4i .. 4i + 3, one per interleaved accumulator
    acc = multi_row_sum(v[..., : groups * 4 * lanes].reshape(*lead, groups, 4, lanes), -3)
    first = acc[..., 0, :]
    for t in range(groups * 4, vectors):  # the vectors past the last whole group: accumulator 0
        first = first + v[..., t * lanes : (t + 1) * lanes]
    for k in range(1, 4):
        first = first + acc[..., k, :]
    if lanes == 1:
        return _positive_zero(first[..., 0])
    total = None  # the elements past the last whole vector, then the lanes in order
    for e in range(vectors * lanes, n):
        total = v[..., e] if total is None else total + v[..., e]
    for lane in range(lanes):
        total = first[..., lane] if total is None else total + first[..., lane]
    return _positive_zero(total)


def column_sum(v: torch.Tensor) -> torch.Tensor:
    """``v.sum_to_size(v.shape[-1:])`` for fp32 ``v``, bit for bit as ATen sums the columns of whole blocks of 4 W
    columns (``columns_in_order`` says when every column is in one): over every leading dim as one dim of rows, one
    cascade over the rows per column (``vectorized_outer_sum``'s ``multi_row_sum``, no interleaving)."""
    return _positive_zero(multi_row_sum(v.reshape(-1, v.shape[-1]), -2))


def _positive_zero(total: torch.Tensor) -> torch.Tensor:
    """``0 + total``: ATen adds each row's sum to an output filled with +0, so a zero sum is +0. The sums above may
    start from their first term instead of +0 (Inductor unrolls short sums so, and its C flags include
    -fno-signed-zeros), which differs only in the sign of a zero result; that sign is set here on the bits, which no
    float flag can fold away."""
    bits = total.view(torch.int32)
    return torch.where(bits == -(2**31), torch.zeros_like(bits), bits).view(torch.float32)


@torch.compiler.assume_constant_result  # a traced model reads the probe's answer, not its ops
def width() -> int | None:
    """The W at which ``row_sum`` equals ``torch.sum`` on this machine's CPU kernels, or None (no single W)."""
    return _probe()


def _spread(rows: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """Probe values with exponents spread over 2^-6..2^6: sums of values of one scale are often exact whatever the
    order, and would pass a wrong one."""
    return torch.randn(rows, n, generator=gen) * torch.exp2(torch.randint(-6, 7, (rows, n), generator=gen).float())


@functools.cache
def _probe() -> int | None:
    gen = torch.Generator().manual_seed(0)
    probes = [_spread(16, n, gen) for n in (5, 37, 300, 1100, 2100, 9000)]
    matches = [w for w in (8, 16) if all(torch.equal(row_sum(x, w), x.sum(-1)) for x in probes)]
    return matches[0] if len(matches) == 1 else None


@torch.compiler.assume_constant_result  # a traced model reads the answer, not the probe's ops
def columns_in_order(n: int, dtype: torch.dtype, width: int) -> bool:
    """Whether ATen sums every column of a ``(rows, n)`` tensor of ``dtype`` as ``column_sum`` does, at any row count
    and thread count: its contiguous outer sum (``vectorized_outer_sum``) runs the plain cascade on whole blocks of
    4 W columns from the start of each thread's column range, and the ranges start on multiples of 128 bytes
    (``parallel_dim_reduction``), so every column is in a whole block when both n and that multiple are multiples of
    4 W; the rest (the interleaved cascade) stays ATen's call. Checked against ATen once per dtype."""
    block = 4 * width
    return n % block == 0 and (128 // dtype.itemsize) % block == 0 and _columns_probe(dtype, width)


@functools.cache
def _columns_probe(dtype: torch.dtype, width: int) -> bool:
    gen = torch.Generator().manual_seed(1)
    for rows, n in ((3, 4 * width), (37, 8 * width), (1100, 32 * width), (5000, 4 * width)):
        t = _spread(rows, n, gen).to(dtype)
        if not torch.equal(column_sum(t.float()).to(dtype), t.sum_to_size(n)):
            return False
    return True
