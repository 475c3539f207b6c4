"""The C restatement of ATen's SiLU backward (roundalign/ops/_aten.c) gives ATen's bits; the in-model ops' blocked
ATen calls (the fallbacks) give the eager formulas' bits.

The kernel stands in for ATen's call inside a compiled model; the reference here is ATen itself, the eager formula's
own call: ``Eager.silu_backward_of_product`` on every 16-bit gate value, at sizes that put ATen's scalar elements at
different places, with one and two threads. Special values (zeros of both signs, infinities, NaN, subnormals) among
ordinary ones. (The row sums of a compiled model's RMSNorm: tests/test_cascade_sum.py.)
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_bitwise_equal, spread_rows, sprinkle
from roundalign import native
from roundalign.numerics.formulas import EAGER, rstd_aten
from roundalign.ops import _aten, _traced

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(scope="module", autouse=True)
def kernels():
    silu = _aten._kernel("SiLU backward", _aten._silu_width)
    assert silu is not None, f"the kernel must build and match ATen here: {_aten._state}"


@pytest.mark.parametrize("rounded_product", [True, False])
def test_in_model_row_sums_by_blocks(monkeypatch, rounded_product):
    """The opaque row-sum ops (where _cascade cannot say ATen's order) by ATen's blocked calls (blocks of 5 rows, the
    last ragged), on 3-d activations, against the eager formulas."""
    monkeypatch.setattr(_traced, "_BLOCK_BYTES", 5 * 37 * 4)
    x = spread_rows(4 * 37 * 3, 1, rows=1, dtype=BF16).reshape(4, 3, 37)
    grad = spread_rows(37, 2, rows=12, dtype=BF16).reshape(4, 3, 37)
    w = spread_rows(37, 3, rows=1, dtype=BF16)[0].abs() + 0.5
    assert_bitwise_equal(_traced.rms_rstd_rows(x, 1e-6), rstd_aten(x.float(), 1e-6), "rstd")
    grad_normed = (grad * w).float() if rounded_product else grad.float() * w.float()
    expected = EAGER.row_dot(grad_normed, x.float(), grad, w, x, rounded_product)
    assert_bitwise_equal(_traced.rms_row_dot_rows(grad, w, x, rounded_product), expected, "row dot")


def test_off_by_environment(monkeypatch):
    monkeypatch.setattr(_aten, "_state", {})
    monkeypatch.setenv(_aten.ENV, "0")
    ones = torch.ones(3, 8, dtype=BF16)
    assert _aten.silu_backward_of_product(ones, ones, ones) is None
    assert _aten._state["why_SiLU backward"] == f"${_aten.ENV}=0"


def test_no_compiler_falls_back_to_aten_with_one_warning(monkeypatch, tmp_path):
    def no_compiler():
        raise RuntimeError("no C or C++ compiler found (install gcc, or set CXX or CC)")

    monkeypatch.setenv("ROUNDALIGN_CACHE_DIR", str(tmp_path))  # nothing cached to load
    monkeypatch.setattr(native, "compiler", no_compiler)
    monkeypatch.setattr(_aten, "_state", {})
    x = spread_rows(300, 4, dtype=BF16)
    unavailable = "SiLU backward kernel is unavailable .no C or C.. compiler found.*the same bits"
    with pytest.warns(RuntimeWarning, match=unavailable):
        assert _aten.silu_backward_of_product(x, x, x) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once, not per call
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
            # both of SwiGLU's gradients, the gate's written over grad, as a compiled model runs it; the up
            # gradient against eager's formula (F.silu of the widened gate, on the whole tensor)
            over = grad.clone()
            gate_grad, up_grad = _aten.silu_backward_of_product(over, up, gate, out=over, with_up=True)
            assert gate_grad is over
            assert_bitwise_equal(over, expected, f"{dtype} n={n}, over grad")
            assert_bitwise_equal(up_grad, (grad.float() * F.silu(gate.float())).to(dtype), f"{dtype} n={n}, up")
    finally:
        torch.set_num_threads(before)


def test_silu_in_model_op_with_and_without_kernel(monkeypatch):
    monkeypatch.setattr(_traced, "_BLOCK_BYTES", 4000)  # 500 elements a block, the last ragged
    g = torch.Generator().manual_seed(6)
    grad, up, gate = (torch.randn(3, 5, 301, generator=g).to(BF16) for _ in range(3))
    by_kernel = _traced.silu_backward_of_product_blocks(grad, up, gate)
    expected = EAGER.swiglu_backward(grad, up, gate)
    strided = torch.randn(3, 301, 5, generator=g).to(BF16).transpose(1, 2)  # not contiguous: computed, then copied

    def swiglu_backward_(grad):  # the in-place op a compiled model runs, on a copy of grad
        over = grad.clone() if grad.is_contiguous() else grad.clone().transpose(1, 2).contiguous().transpose(1, 2)
        up_grad = torch.ops.roundalign.swiglu_backward_(over, up, gate)
        return over, up_grad

    for kernel in (True, False):
        if not kernel:
            monkeypatch.setitem(_aten._state, "SiLU backward", None)
        assert_bitwise_equal(by_kernel, _traced.silu_backward_of_product_blocks(grad, up, gate))
        for mine, theirs in zip(swiglu_backward_(grad), expected, strict=True):
            assert_bitwise_equal(mine, theirs, f"kernel {kernel}")
        for mine, theirs in zip(swiglu_backward_(strided), EAGER.swiglu_backward(strided, up, gate), strict=True):
            assert_bitwise_equal(mine, theirs, f"kernel {kernel}, strided grad")
    assert_bitwise_equal(by_kernel, EAGER.silu_backward_of_product(grad, up, gate))
