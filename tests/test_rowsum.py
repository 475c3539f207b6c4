"""The row-sum kernels (roundalign/ops/_rowsum.c) equal ATen's sums bit for bit.

They restate ATen's summation order for a compiled model's RMSNorm; the reference here is ATen itself, the eager
formulas' own reductions: ``x32.pow(2).sum(-1)`` and the backward's ``sum(grad_normed * x32)``. Row lengths cover
each branch of ATen's order: shorter than one vector, whole vectors with leftovers, groups of four vectors with
leftover vectors, and rows long enough for the cascade's upper levels (from 16 x 4 x W elements), with rows of
special values (zeros of both signs, infinities, NaN, subnormals) among ordinary ones.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from helpers import assert_bitwise_equal, sprinkle
from roundalign import native
from roundalign.numerics.formulas import rstd_aten
from roundalign.ops import _rowsum, _traced

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
LENGTHS = [*range(1, 70), 127, 128, 129, 255, 256, 300, 511, 512, 513, 1023, 1024, 1025, 2047, 2049, 4100, 16389]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    loaded = _rowsum.kernels()
    assert loaded is not None, (
        f"the row-sum kernels must build and match ATen on the suite's machines: {_rowsum._state}"
    )
    return loaded


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
        assert_bitwise_equal(_rowsum.row_sums(x), x.to(FP32).pow(2).sum(-1), f"{dtype} n={n}")


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
        assert_bitwise_equal(_rowsum.row_sums(x, grad, w, rounded_product), expected, f"{dtype} n={n}")


def test_in_model_ops_with_and_without_kernels(monkeypatch):
    """The in-model ops give the same bits by the kernels and by ATen's blocked calls, on 3-d activations."""
    x = _rows(4 * 37 * 3, BF16, 1, rows=1).reshape(4, 3, 37)
    grad, w = _rows(37, BF16, 2, rows=12).reshape(4, 3, 37), _rows(37, BF16, 3, rows=1)[0].abs() + 0.5
    by_kernels = (_traced.rms_rstd_rows(x, 1e-6), _traced.rms_row_dot_rows(grad, w, x, True))
    monkeypatch.setitem(_rowsum._state, "lib", None)
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
        assert _rowsum.row_sums(x) is None
        torch.set_num_threads(1)
        assert_bitwise_equal(_rowsum.row_sums(x), x.float().pow(2).sum(-1))
    finally:
        torch.set_num_threads(threads)
    assert _rowsum.row_sums(x.double()) is None  # float64 (gradcheck): ATen's calls


def test_off_by_environment(monkeypatch):
    monkeypatch.setattr(_rowsum, "_state", {})
    monkeypatch.setenv(_rowsum.ENV, "0")
    assert _rowsum.row_sums(torch.ones(3, 8, dtype=BF16)) is None
    assert _rowsum._state["why"] == f"${_rowsum.ENV}=0"


def test_no_compiler_falls_back_to_aten_with_one_warning(monkeypatch, tmp_path):
    def no_compiler():
        raise RuntimeError("no C or C++ compiler found (install gcc, or set CXX or CC)")

    monkeypatch.setenv("ROUNDALIGN_CACHE_DIR", str(tmp_path))  # nothing cached to load
    monkeypatch.setattr(native, "compiler", no_compiler)
    monkeypatch.setattr(_rowsum, "_state", {})
    x = _rows(300, BF16, 4)
    with pytest.warns(RuntimeWarning, match="no C or C.. compiler found.*the same bits"):
        assert _rowsum.row_sums(x) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once, not per call
        assert_bitwise_equal(_traced.rms_rstd_rows(x, 1e-6), rstd_aten(x.float(), 1e-6))
