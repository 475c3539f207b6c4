"""ATen's row-sum order in tensor ops (roundalign/ops/_cascade.py) gives ATen's bits, eager and inside a compiled graph.

The reference is ATen itself: ``torch.sum`` over the last dim, the call the eager formulas make (``rstd_aten``'s
mean is that sum divided by the count, the backward's ``sum_to`` the same sum). Row lengths cover each branch of
ATen's order: shorter than one vector, whole vectors with leftover elements, groups of four vectors with leftover
vectors, and rows long enough for each upper level of the cascade (level 1 from 16 x 4 x W elements, level 2 from
256 x 4 x W, level 3 from 4096 x 4 x W). Compiled cases run Inductor's default config, with symbolic row counts as
a model's graph has them after a recompile.
"""

from __future__ import annotations

import pytest
import torch

from helpers import assert_bitwise_equal, spread_rows
from roundalign import ops
from roundalign.ops import _aten, _cascade, _traced

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
LENGTHS = [*range(1, 70), 127, 128, 129, 255, 256, 300, 511, 512, 513, 896, 1023, 1024, 1025, 2047, 2049, 3584, 4100]
LONG = [8191, 8192, 8200, 16389, 131072 + 77]  # levels 2 and 3 at W = 8 and 16


@pytest.fixture(scope="module")
def lanes() -> int:
    lanes = _cascade.width()
    assert lanes in (8, 16), "ATen's row sums must match one lane count on the suite's machines"
    return lanes


def test_row_sum_is_atens(lanes):
    for n in LENGTHS + LONG:
        x = spread_rows(n, n, rows=3 if n > 5000 else 6)
        assert_bitwise_equal(_cascade.row_sum(x, lanes), x.sum(-1), f"n={n}")


def test_zero_sums_are_positive(lanes):
    """ATen adds each row's sum to an output of +0: a row of -0 sums to +0 (here the last step sets it)."""
    for n in (3, 200, 1100):
        x = torch.full((2, n), -0.0)
        assert_bitwise_equal(_cascade.row_sum(x, lanes), x.sum(-1), f"n={n}")


def test_the_probe_tells_the_lane_counts_apart(lanes):
    """The other lane count's order differs from ATen's on the probe's rows, so the probe picks exactly one."""
    other = 24 - lanes
    x = spread_rows(300, 1)
    assert not torch.equal(_cascade.row_sum(x[:-1], other), x[:-1].sum(-1))


@pytest.mark.slow
@pytest.mark.parametrize("n", [5, 37, 200, 1100, 9000])
def test_compiled_row_sum_is_atens(lanes, n):
    """Inductor computes the written order as written: every step a sequential sum over a short dim."""
    torch._dynamo.reset()  # a fresh cache: the lambda below is one code object across the cases
    fn = torch.compile(lambda x: _cascade.row_sum(x * 1.5, lanes), dynamic=True, fullgraph=True)
    for rows in (1, 3, 40):
        x = spread_rows(n, n + rows, rows=rows)
        x[0] = -0.0  # a row of -0: +0 however the sums start
        assert_bitwise_equal(fn(x), (x * 1.5).sum(-1), f"n={n} rows={rows}")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_compiled_rms_norm_at_wide_rows(dtype):
    """RMSNorm forward and backward in a compiled graph at a row length with a level-1 cascade and leftovers (1,100)
    and a head_dim (128), against the eager op; the last token's gradient is zero with weights of both signs, so its
    backward row sums are sums of +0 and -0."""
    for n, weight_sign in ((1100, 1.0), (128, -1.0)):
        g = torch.Generator().manual_seed(n)
        x = (torch.randn(2, 9, n, generator=g) * 3).to(dtype)
        w = (weight_sign * (torch.rand(n, generator=g) + 0.5) * torch.where(torch.arange(n) % 7 == 0, -1, 1)).to(dtype)
        mask = torch.ones(2, 9, 1, dtype=dtype)
        mask[:, -1] = 0

        def fn(x, w, mask=mask):
            return ops.rms_norm(x * 1.1, w, 1e-6, "round_before_weight", dtype) * mask

        results = []
        for compiled in (False, True):
            torch._dynamo.reset()
            leaves = [t.detach().clone().requires_grad_() for t in (x, w)]
            out = (torch.compile(fn, fullgraph=True) if compiled else fn)(*leaves)
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype))
            results.append((out.detach(), *(leaf.grad for leaf in leaves)))
        for name, a, b in zip(("output", "x grad", "weight grad"), results[1], results[0], strict=True):
            assert_bitwise_equal(a, b, f"{dtype} n={n} {name}")


def test_which_rows_a_compiled_model_sums_in_tensor_ops(lanes):
    """fp32 CPU rows shorter than ATen's grain: written in tensor ops; a longer row (ATen may split a single one over
    threads: another order) and fp64 (gradcheck) stay opaque ATen calls over the stored tensors."""
    assert _traced._fusable_sum(torch.empty(3, 4096)) == lanes
    assert _traced._fusable_sum(torch.empty(1, _aten.GRAIN)) is None
    assert _traced._fusable_sum(torch.empty(3, 256, dtype=torch.float64)) is None


COLUMN_ROWS = [1, 2, 3, 4, 5, 15, 16, 17, 63, 64, 65, 255, 256, 257, 1023, 1025, 4097, 70000]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [FP32, BF16, FP16])
def test_column_sum_is_atens(lanes, dtype, threads):
    """A weight's gradient, summed over every token: serial below ATen's grain, split over threads above it."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n in (4 * lanes, 8 * lanes, 32 * lanes, 128 * lanes):
            assert _cascade.columns_in_order(n, dtype, lanes) == ((128 // dtype.itemsize) % (4 * lanes) == 0)
            if not _cascade.columns_in_order(n, dtype, lanes):
                continue
            for rows in COLUMN_ROWS:
                if rows * n > 2e7:
                    continue
                x = spread_rows(n, rows, rows=rows, dtype=dtype)
                x[:, 1] = -0.0  # a column of -0: +0, as ATen's output starts
                expected = x.sum_to_size(n)
                assert_bitwise_equal(_cascade.column_sum(x.float()).to(dtype), expected, f"n={n} rows={rows}")
    finally:
        torch.set_num_threads(before)


def test_columns_outside_whole_blocks_stay_atens_calls(lanes):
    """Columns past the last whole block of 4 W take ATen's interleaved cascade: the written order declines them."""
    assert not _cascade.columns_in_order(4 * lanes + 8, FP32, lanes)
    assert not _traced._fusable_columns(torch.empty(5, 4 * lanes + 8), (4 * lanes + 8,))
    assert not _traced._fusable_columns(torch.empty(5, 4 * lanes), (1, 4 * lanes))  # not a weight's shape
    assert _traced._fusable_columns(torch.empty(2, 5, 4 * lanes, dtype=BF16), (4 * lanes,))


@pytest.mark.slow
def test_compiled_column_sum_is_atens(lanes):
    torch._dynamo.reset()
    fn = torch.compile(lambda x: _cascade.column_sum(x.float() * 1.5).to(x.dtype), dynamic=True, fullgraph=True)
    for rows in (1, 5, 300, 5000):
        for dtype in (FP32, BF16):
            x = spread_rows(8 * lanes, rows, rows=rows, dtype=dtype)
            x[:, 0] = -0.0
            assert_bitwise_equal(
                fn(x),
                (x.float() * 1.5).to(dtype).sum_to_size(8 * lanes)
                if dtype == FP32
                else (x.float() * 1.5).sum_to_size(8 * lanes).to(dtype),
                f"rows={rows} {dtype}",
            )
