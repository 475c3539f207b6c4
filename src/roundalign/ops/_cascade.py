"""ATen's row-sum order written as tensor ops, so that a compiled model's RMSNorm reductions fuse with their neighbours.

A compiled model's RMSNorm must sum each row (the variance's ``x^2``, the backward's ``grad_normed * x``) in ATen's
order to equal the eager ops bit for bit; Inductor's own reductions add in another order. An opaque op that sums in
ATen's order (``roundalign::rms_rstd_rows``, the C kernels of ``_aten``) keeps the bits but is a fusion barrier: its
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

``width()`` probes which W this machine's ATen uses (8 under its AVX2 and default kernels, 16 under AVX-512), by
comparing ``row_sum`` with ``torch.sum`` on random rows: exactly one W must agree, else None and the callers keep
the opaque ops. tests/test_ops_in_graph.py checks the compiled form against the eager ops bit for bit.
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


def row_sum(v: torch.Tensor, width: int) -> torch.Tensor:
    """``v.sum(-1)`` for fp32 ``v``, bit for bit as ATen computes it with ``width`` lanes, in tensor ops."""
    n, lead = v.shape[-1], v.shape[:-1]
    lanes = width if n >= width else 1  # a row shorter than a vector: scalar_inner_sum, the same cascade
    vectors = n // lanes
    groups = vectors // 4
    step = 1 << max(_ceil_log2(groups) // 4, 4)
    # [groups, 4, lanes]: group i holds vectors 4i .. 4i + 3, one per accumulator
    level = v[..., : groups * 4 * lanes].reshape(*lead, groups, 4, lanes)
    # Level j closes every `step` of its blocks into level j + 1; what remains open at the end joins level 0.
    open_parts = []
    for _ in range(_LEVELS - 1):
        closed = level.shape[-3] // step
        open_parts.append(_in_order(level[..., closed * step :, :, :], -3))
        level = level[..., : closed * step, :, :].reshape(*lead, closed, step, 4, lanes).sum(-3)
        if closed == 0:
            break
    else:
        open_parts.append(_in_order(level, -3))  # the top level keeps every block
    acc = open_parts[0]
    for part in open_parts[1:]:
        acc = acc + part
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


@functools.cache
def _probe() -> int | None:
    gen = torch.Generator().manual_seed(0)
    probes = [torch.randn(16, n, generator=gen) * torch.exp2(torch.randint(-6, 7, (16, n), generator=gen).float())
              for n in (5, 37, 300, 1100, 2100, 9000)]  # fmt: skip
    matches = [w for w in (8, 16) if all(torch.equal(row_sum(x, w), x.sum(-1)) for x in probes)]
    return matches[0] if len(matches) == 1 else None
