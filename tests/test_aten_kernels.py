"""The C restatements of ATen's kernels (roundalign/ops/_aten.c) give ATen's bits.

They stand in for ATen's calls inside a compiled model; the reference here is ATen itself, the eager formulas' own
calls. Row sums: ``x32.pow(2).sum(-1)`` and the backward's ``sum(grad_normed * x32)``, at row lengths that cover
each branch of ATen's order (shorter than one vector, whole vectors with leftovers, groups of four vectors with
leftover vectors, rows long enough for the cascade's upper levels, from 16 x 4 x W elements). SiLU's backward:
``Eager.silu_backward_of_product`` (ATen's silu_backward on the whole tensor) on every 16-bit gate value, at sizes
that put ATen's scalar elements at different places, with one and two threads. Special values (zeros of both signs,
infinities, NaN, subnormals) among ordinary ones.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from helpers import assert_bitwise_equal, sprinkle
from roundalign import native
from roundalign.numerics.formulas import EAGER, rstd_aten
from roundalign.ops import _aten, _traced

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
LENGTHS = [*range(1, 70), 127, 128, 129, 255, 256, 300, 511, 512, 513, 1023, 1024, 1025, 2047, 2049, 4100, 16389]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    rows, silu = _aten._kernel("row sums", _aten._rows_width), _aten._kernel("SiLU backward", _aten._silu_width)
    assert rows is not None and silu is not None, f"the kernels must build and match ATen here: {_aten._state}"


def _rows(n: int, dtype, seed: int, rows: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # exponents spread over 2^-6..2^6 within a row: sums of 16-bit squares of one scale are often exact in fp32,
    # whatever the order, and would hide an order's error
    spread = torch.exp2(torch.randint(-6, 7, (rows, n), generator=g).float())
    x = (torch.randn(rows, n, generator=g) * spread * torch.logspace(-2, 2, rows).unsqueeze(1)).to(dtype)
    if dtype != FP32 and n > 4:  # special values in the last row only: the others stay finite, so compared as sums
        x[-1] = sprinkle(x[-1:], g, 0.05)[0]
    return x


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
def test_sum_of_squares(dtype):
    for n in LENGTHS:
        x = _rows(n, dtype, n)
        assert_bitwise_equal(_aten.row_sums(x), x.to(FP32).pow(2).sum(-1), f"{dtype} n={n}")


@pytest.mark.parametrize("weight_dtype", ["same", FP32])
@pytest.mark.parametrize("rounded_product", [True, False])
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_sum_of_products(dtype, rounded_product, weight_dtype):
    """RMSNorm backward's row sum: grad_normed = r(grad * w) (a 16-bit product) or grad32 * w32, times x32."""
    for n in LENGTHS:
        x, grad = _rows(n, dtype, n), _rows(n, dtype, n + 1000)
        w = (torch.rand(n, generator=torch.Generator().manual_seed(n)) + 0.5).to(
            dtype if weight_dtype == "same" else FP32
        )
        if rounded_product:
            grad_normed = (grad * w).to(FP32)  # 16-bit mul when w is 16-bit, else promoted to fp32
        else:
            grad_normed = grad.to(FP32) * w.to(FP32)
        expected = (grad_normed * x.to(FP32)).sum(-1)
        assert_bitwise_equal(_aten.row_sums(x, grad, w, rounded_product), expected, f"{dtype} n={n}")


def test_in_model_ops_with_and_without_kernels(monkeypatch):
    """The in-model ops give the same bits by the kernels and by ATen's blocked calls (blocks of 5 rows, the last
    ragged), on 3-d activations."""
    monkeypatch.setattr(_traced, "_BLOCK_BYTES", 5 * 37 * 4)
    x = _rows(4 * 37 * 3, BF16, 1, rows=1).reshape(4, 3, 37)
    grad, w = _rows(37, BF16, 2, rows=12).reshape(4, 3, 37), _rows(37, BF16, 3, rows=1)[0].abs() + 0.5
    by_kernels = (_traced.rms_rstd_rows(x, 1e-6), _traced.rms_row_dot_rows(grad, w, x, True))
    monkeypatch.setitem(_aten._state, "row sums", None)
    by_aten = (_traced.rms_rstd_rows(x, 1e-6), _traced.rms_row_dot_rows(grad, w, x, True))
    assert_bitwise_equal(by_kernels[0], by_aten[0], "rstd")
    assert_bitwise_equal(by_kernels[0], rstd_aten(x.float(), 1e-6), "rstd against the eager formula")
    assert_bitwise_equal(by_kernels[1], by_aten[1], "row dot")


def test_declines_what_aten_sums_otherwise():
    """A single row of 32,768 elements or more is split over threads by ATen (another order): no kernel call."""
    x = torch.ones(1, 40000, dtype=BF16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert _aten.row_sums(x) is None
        torch.set_num_threads(1)
        assert_bitwise_equal(_aten.row_sums(x), x.float().pow(2).sum(-1))
    finally:
        torch.set_num_threads(threads)
    assert _aten.row_sums(x.double()) is None  # float64 (gradcheck): ATen's calls


def test_off_by_environment(monkeypatch):
    monkeypatch.setattr(_aten, "_state", {})
    monkeypatch.setenv(_aten.ENV, "0")
    ones = torch.ones(3, 8, dtype=BF16)
    assert _aten.row_sums(ones) is None
    assert _aten.silu_backward_of_product(ones, ones, ones) is None
    assert _aten._state["why_row sums"] == _aten._state["why_SiLU backward"] == f"${_aten.ENV}=0"


def test_no_compiler_falls_back_to_aten_with_one_warning(monkeypatch, tmp_path):
    def no_compiler():
        raise RuntimeError("no C or C++ compiler found (install gcc, or set CXX or CC)")

    monkeypatch.setenv("ROUNDALIGN_CACHE_DIR", str(tmp_path))  # nothing cached to load
    monkeypatch.setattr(native, "compiler", no_compiler)
    monkeypatch.setattr(_aten, "_state", {})
    x = _rows(300, BF16, 4)
    with pytest.warns(RuntimeWarning, match="no C or C.. compiler found.*the same bits"):
        assert _aten.row_sums(x) is None
    with pytest.warns(RuntimeWarning, match="SiLU backward kernel is unavailable .no C or C.. compiler found"):
        assert _aten.silu_backward_of_product(x, x, x) is None  # one warning per kernel
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once, not per call
        assert_bitwise_equal(_traced.rms_rstd_rows(x, 1e-6), rstd_aten(x.float(), 1e-6))
        assert_bitwise_equal(_traced.silu_backward_of_product_blocks(x, x, x), EAGER.silu_backward_of_product(x, x, x))


SILU_SIZES = [1, 15, 16, 17, 31, 33, 1000, 32768, 32769, 65536 + 13, 3 * 32768 + 45, 200_003]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_silu_backward_of_product(dtype, threads):
    """Every gate value, tiled so that each size puts other values on ATen's scalar elements (the ends of each
    thread's range), against ATen's silu_backward on the whole tensor."""
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    g = torch.Generator().manual_seed(5)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n in SILU_SIZES:
            gate = every[torch.randperm(every.numel(), generator=g)].repeat(n // every.numel() + 1)[:n]
            grad, up = (sprinkle(torch.randn(n, generator=g).to(dtype), g, 0.01) for _ in range(2))
            expected = EAGER.silu_backward_of_product(grad, up, gate)
            assert_bitwise_equal(_aten.silu_backward_of_product(grad, up, gate), expected, f"{dtype} n={n}")
    finally:
        torch.set_num_threads(before)


def test_silu_in_model_op_with_and_without_kernel(monkeypatch):
    monkeypatch.setattr(_traced, "_BLOCK_BYTES", 4000)  # 500 elements a block, the last ragged
    g = torch.Generator().manual_seed(6)
    grad, up, gate = (torch.randn(3, 5, 301, generator=g).to(BF16) for _ in range(3))
    by_kernel = _traced.silu_backward_of_product_blocks(grad, up, gate)
    monkeypatch.setitem(_aten._state, "SiLU backward", None)
    assert_bitwise_equal(by_kernel, _traced.silu_backward_of_product_blocks(grad, up, gate))
    assert_bitwise_equal(by_kernel, EAGER.silu_backward_of_product(grad, up, gate))
