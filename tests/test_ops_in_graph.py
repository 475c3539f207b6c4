"""Inside a compiled graph (``torch.compile`` with Inductor's default config) every op equals the eager op bit for
bit, forward and backward, while Inductor fuses it with the stock code around it (``roundalign.ops._traced``).

Each case compiles ``consumer(op(producer(inputs)))``: the producer and consumer are stock 16-bit element-wise ops
(``x * 1.1``, ``y * 1.3``), the ones whose rounding Inductor drops when it fuses them, so the case also checks
that an op reads its inputs as stored and hands on outputs as rounded. The reference is the same function run
eagerly with the eager ops, whose formulas tests/test_ops.py checks against independent ones. Compiling takes
seconds per case, hence ``slow``.

The in-model reductions and SiLU's backward run as C restatements of ATen's kernels (roundalign/ops/_aten.c), or,
where those are off, as ATen's calls a block at a time; the cases run the second with blocks of a few rows or
elements, the last one ragged, so that every block edge is crossed (``ROUNDALIGN_ATEN_KERNELS=0`` runs them here).
"""

from __future__ import annotations

import sys

import pytest
import torch

from helpers import assert_bitwise_equal, sprinkle, tie_prone_bf16
from roundalign import ops
from roundalign.profiles import ResidualRule, RMSNormRule, RopeRounding, SwiGLURule

pytestmark = pytest.mark.slow
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    # 4,000 fp32 bytes: 5 rows of 200 (rms_norm's 111 rows: 22 blocks and a ragged one), 500 SwiGLU elements
    monkeypatch.setattr(sys.modules["roundalign.ops._traced"], "_BLOCK_BYTES", 4000)


def _values(shape, seed: int, dtype=BF16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 2).to(BF16)
    x = torch.where(torch.rand(shape, generator=g) < 0.2, tie_prone_bf16(shape, g), x)
    return sprinkle(x, g, 0.002).to(dtype)


def _check(fn, inputs, what: str):
    """``fn(*inputs)`` eager and compiled: outputs and input gradients bitwise equal."""
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        run = torch.compile(fn, fullgraph=True) if compiled else fn
        outs = run(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        g = torch.Generator().manual_seed(7)
        grads = [torch.randn(o.shape, generator=g).to(o.dtype) for o in outs]
        torch.autograd.backward(outs, grads)
        results.append(([o.detach() for o in outs], [leaf.grad for leaf in leaves]))
    (eager_out, eager_grad), (comp_out, comp_grad) = results
    for i, (a, b) in enumerate(zip(comp_out, eager_out, strict=True)):
        assert_bitwise_equal(a, b, f"{what} output {i}")
    for i, (a, b) in enumerate(zip(comp_grad, eager_grad, strict=True)):
        assert (a is None) == (b is None), f"{what} grad {i}"
        if a is not None:
            assert_bitwise_equal(a, b, f"{what} grad {i}")


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("rule", [r.value for r in RMSNormRule] + ["fused_into_rope"])
def test_rms_norm(rule, dtype):
    def fn(x, w):
        return ops.rms_norm(x * 1.1, w, 1e-6, rule, dtype) * 1.3

    _check(fn, (_values((3, 37, 200), 1, dtype), _values((200,), 2, dtype)), f"rms_norm {rule} {dtype}")


@pytest.mark.parametrize("rule", [r.value for r in ResidualRule])
def test_residual_add(rule):
    def fn(a, h):
        rounded, x = ops.residual_add(a * 1.1, h * 1.1, rule)
        if x is rounded:  # normalize_rounded_sum: one tensor; two uses would add their gradients as stock code
            return rounded * 1.3  # does, which Inductor fuses in fp32 (docs/design.md, section 6)
        return rounded * 1.3, x * 1.3

    _check(fn, (_values((4, 9, 96), 3), _values((4, 9, 96), 4)), f"residual_add {rule}")


@pytest.mark.parametrize("residual_rule", [r.value for r in ResidualRule])
@pytest.mark.parametrize("norm_rule", [r.value for r in RMSNormRule])
def test_add_rms_norm(norm_rule, residual_rule):
    """The norm of the fp32 sum S (its value at S, its gradient at R) fused with its neighbours."""

    def fn(a, h, w):
        y, rounded = ops.add_rms_norm(a * 1.1, h * 1.1, w, 1e-6, norm_rule, residual_rule)
        # R itself: the norm's backward keeps it, so Inductor stores it, and a stock op fused after that store may
        # read the unrounded sum (emulate_precision_casts=False, as for stock code); in a model, R's readers are
        # the next residual add and the norm's backward, which widen it as stored.
        return y * 1.3, rounded

    inputs = (_values((4, 9, 96), 5), _values((4, 9, 96), 6), _values((96,), 7))
    _check(fn, inputs, f"add_rms_norm {norm_rule}/{residual_rule}")


@pytest.mark.parametrize("cos_dtype", [BF16, FP32])
@pytest.mark.parametrize("rounding", [r.value for r in RopeRounding])
def test_rope(rounding, cos_dtype):
    def fn(q, cos, sin):
        x = (q * 1.1).transpose(1, 2)  # (B, H, T, D), as the attention hands it over
        return ops.rope(x, cos.unsqueeze(1), sin.unsqueeze(1), rounding, BF16) * 1.3

    angles = torch.rand(2, 11, 32, generator=torch.Generator().manual_seed(5)) * 40
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(cos_dtype), torch.cat([angles.sin()] * 2, -1).to(cos_dtype)
    _check(fn, (_values((2, 11, 3, 64), 6), cos, sin), f"rope {rounding} {cos_dtype}")


def test_rope_of_an_fp32_norm_output():
    def fn(q, w, cos, sin):
        normed = ops.rms_norm(q * 1.1, w, 1e-6, "fused_into_rope", BF16)  # fp32, rounded by RoPE
        return ops.rope(normed.transpose(1, 2), cos.unsqueeze(1), sin.unsqueeze(1), "once", BF16)

    angles = torch.rand(2, 11, 32, generator=torch.Generator().manual_seed(8)) * 40
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(BF16), torch.cat([angles.sin()] * 2, -1).to(BF16)
    _check(fn, (_values((2, 11, 3, 64), 9), _values((64,), 10), cos, sin), "q-norm into rope")


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("rule", [r.value for r in SwiGLURule])
def test_swiglu(rule, dtype):
    def fn(gate, up):
        return ops.swiglu(gate * 1.1, up * 1.1, rule) * 1.3

    _check(fn, (_values((3, 7, 301), 11, dtype), _values((3, 7, 301), 12, dtype)), f"swiglu {rule} {dtype}")


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_swiglu_under_a_projection(dtype):
    """As in a model: SwiGLU's output goes through a linear, so its incoming gradient is a GEMM's output buffer,
    which the compiled backward writes the gate's gradient over (``roundalign.ops._traced``)."""

    def fn(gate, up, weight):
        return ops.swiglu(gate, up, "once") @ weight

    w = _values((301, 64), 13, dtype) / 8
    _check(fn, (_values((3, 7, 301), 11, dtype), _values((3, 7, 301), 12, dtype), w), f"swiglu, projected, {dtype}")


def test_swiglu_as_the_graph_output_leaves_the_callers_gradient_alone():
    """The compiled SwiGLU backward writes the gate's gradient over its incoming gradient; where that gradient is
    the one the caller passed to ``backward`` (SwiGLU's output is the graph's), the caller's tensor keeps its values
    and the gradients are eager's."""
    gate, up = _values((3, 7, 301), 11), _values((3, 7, 301), 12)
    grad = _values((3, 7, 301), 13)
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        leaves = [gate.clone().requires_grad_(), up.clone().requires_grad_()]

        def fn(g, u):
            return ops.swiglu(g, u, "once")

        passed = grad.clone()
        (torch.compile(fn, fullgraph=True) if compiled else fn)(*leaves).backward(passed)
        assert_bitwise_equal(passed, grad, f"the caller's gradient, compiled={compiled}")
        results.append([leaf.grad for leaf in leaves])
    for mine, eager in zip(results[1], results[0], strict=True):
        assert_bitwise_equal(mine, eager, "compiled gradient")


@pytest.mark.parametrize("rounding", [r.value for r in RopeRounding])
def test_rope_cos_and_sin_are_recomputed_in_the_backward_as_stocks_are(rounding):
    # cos and sin computed in the graph from the positions and rounded to bf16, as HF's rotary embedding does: the
    # compiled backward recomputes them rather than saving them, for stock's RoPE and for ours (whose backward reads
    # them through roundalign::widen_saved, which AOTAutograd's partitioner must count as pointwise for that).
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))

    def stock(x, cos, sin):
        return x * cos + torch.cat([-x[..., 32:], x[..., :32]], -1) * sin

    def ours(x, cos, sin):
        return ops.rope(x, cos, sin, rounding, BF16)

    def fn(q, positions, rope):
        emb = torch.cat([positions[:, :, None].float() * inv_freq] * 2, -1)
        cos, sin = emb.cos().to(BF16).unsqueeze(1), emb.sin().to(BF16).unsqueeze(1)
        return rope((q * 1.1).transpose(1, 2), cos, sin) * 1.3

    def saved_bytes(rope) -> int:
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        torch._dynamo.reset()
        q = _values((2, 40, 3, 64), 11).requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = torch.compile(lambda q, p: fn(q, p, rope), fullgraph=True)(q, torch.arange(40).expand(2, 40))
        out.float().sum().backward()
        return total

    cos_and_sin = 2 * 2 * 40 * 64 * 2  # what saving them would cost
    mine, theirs = saved_bytes(ours), saved_bytes(stock)
    assert mine < theirs + cos_and_sin // 2, (mine, theirs)
    _check(lambda q, p: fn(q, p, ours), (_values((2, 40, 3, 64), 12), torch.arange(40).expand(2, 40)), "rope+cos")
