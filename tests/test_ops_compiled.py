"""The compiled variant of every op (``compiled=True``; ``apply(..., compile_ops=True)``) equals the eager op bit
for bit: outputs and gradients, for every rule, on odd shapes, on every bf16 value, and on tie-prone and special
values (inf, NaN, subnormals).

The eager ops are themselves tested against the independent formulas (tests/test_ops.py, tests/test_ops_grad.py);
here the claim is that Inductor, with explicit casts kept (``emulate_precision_casts``), changes no bit. Compiling
takes a few seconds per op and rule, hence ``slow``.
"""

from __future__ import annotations

import pytest
import torch

from helpers import all_bf16, assert_bitwise_equal, sprinkle, tie_prone_bf16
from roundalign import ops
from roundalign.profiles import ResidualRule, RMSNormRule, RopeRounding, SwiGLURule

pytestmark = pytest.mark.slow
BF16, FP32 = torch.bfloat16, torch.float32
EPS = 1e-6


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _both(fn, inputs, seed: int = 0):
    """(outputs, input gradients) of ``fn(*inputs, compiled=c)`` for c = False, True, with one random grad_output."""
    results = []
    for compiled in (False, True):
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        outs = fn(*leaves, compiled=compiled)
        outs = outs if isinstance(outs, tuple) else (outs,)
        g = gen(seed)
        grads = [torch.randn(o.shape, generator=g).to(o.dtype) for o in outs]
        torch.autograd.backward(outs, grads)
        results.append(([o.detach() for o in outs], [leaf.grad for leaf in leaves if leaf.requires_grad]))
    return results


def assert_same(fn, inputs, what: str):
    (eager_out, eager_grad), (comp_out, comp_grad) = _both(fn, inputs)
    for i, (a, b) in enumerate(zip(comp_out, eager_out, strict=True)):
        assert_bitwise_equal(a, b, f"{what} output {i}")
    for i, (a, b) in enumerate(zip(comp_grad, eager_grad, strict=True)):
        if a is None or b is None:  # an input the op does not differentiate (RoPE's cos/sin)
            assert a is None and b is None, f"{what} grad {i}"
        else:
            assert_bitwise_equal(a, b, f"{what} grad {i}")
    assert any(g is not None for g in comp_grad)


def _values(shape, seed: int) -> torch.Tensor:
    """Random normal values with a fifth tie-prone and a few specials, in bf16."""
    g = gen(seed)
    x = (torch.randn(shape, generator=g) * 2).to(BF16)
    ties = tie_prone_bf16(shape, g)
    x = torch.where(torch.rand(shape, generator=g) < 0.2, ties, x)
    return sprinkle(x, g, 0.002)


@pytest.mark.parametrize("rule", [r.value for r in RMSNormRule] + ["fused_into_rope"])
@pytest.mark.parametrize("shape", [(3, 37, 200), (1, 5, 1024)])
def test_rms_norm(rule, shape):
    x = _values(shape, 1)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=gen(2))).to(BF16)
    assert_same(lambda x, w, compiled: ops.rms_norm(x, w, EPS, rule, compiled=compiled), (x, w), rule)


@pytest.mark.parametrize("rule", ["normalize_fp32_sum", "round_at_attention", "never_round", "normalize_rounded_sum"])
def test_residual_add(rule):
    a, h = _values((2, 33, 300), 3), _values((2, 33, 300), 4)
    assert_same(lambda a, h, compiled: ops.residual_add(a, h, rule, compiled=compiled), (a, h), rule)


@pytest.mark.parametrize("residual_rule", [r.value for r in ResidualRule])
@pytest.mark.parametrize("norm_rule", [r.value for r in RMSNormRule])
def test_add_rms_norm(norm_rule, residual_rule):
    a, h = _values((2, 33, 300), 8), _values((2, 33, 300), 9)
    w = (1 + 0.5 * torch.randn(300, generator=gen(10))).to(BF16)
    assert_same(
        lambda a, h, w, compiled: ops.add_rms_norm(a, h, w, EPS, norm_rule, residual_rule, compiled=compiled),
        (a, h, w),
        f"add_rms_norm {norm_rule}/{residual_rule}",
    )


def test_add_rms_norm_from_an_fp32_residual():
    a = _values((2, 33, 300), 5)
    h32 = torch.randn((2, 33, 300), generator=gen(6)) * 3  # the fp32 S a never_round engine carries
    w = (1 + 0.5 * torch.randn(300, generator=gen(7))).to(BF16)
    assert_same(
        lambda a, h, w, compiled: ops.add_rms_norm(
            a, h, w, EPS, "round_after_weight", "never_round", compiled=compiled
        ),
        (a, h32, w),
        "add_rms_norm",
    )


@pytest.mark.parametrize("rounding", [r.value for r in RopeRounding])
@pytest.mark.parametrize("cos_dtype", [BF16, FP32])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_rope(rounding, cos_dtype, head_dim):
    x = _values((1, 3, 41, head_dim), 8)
    theta = torch.arange(41, dtype=FP32)[:, None] * (1e4 ** -(torch.arange(0, head_dim, 2) / head_dim))
    emb = torch.cat((theta, theta), -1)[None, None]
    cos, sin = emb.cos().to(cos_dtype), emb.sin().to(cos_dtype)
    assert_same(
        lambda x, c, s, compiled: ops.rope(x, c, s, rounding, out_dtype=BF16, compiled=compiled),
        (x, cos, sin),
        f"{rounding}/{cos_dtype}",
    )


def test_rope_of_an_fp32_norm_output():
    """Qwen3's fused_into_rope: RoPE reads the q/k norm's fp32 output and rounds once."""
    x32 = torch.randn((1, 2, 29, 128), generator=gen(9))
    theta = torch.arange(29, dtype=FP32)[:, None] * (1e6 ** -(torch.arange(0, 128, 2) / 128))
    emb = torch.cat((theta, theta), -1)[None, None]
    assert_same(
        lambda x, c, s, compiled: ops.rope(x, c, s, "once", out_dtype=BF16, compiled=compiled),
        (x32, emb.cos(), emb.sin()),
        "fp32 in",
    )


@pytest.mark.parametrize("rule", [r.value for r in SwiGLURule])
def test_swiglu_on_every_bf16_gate(rule):
    """Every bf16 gate value (65536, incl. inf/NaN/subnormals) against 8 up values each: SiLU's last fp32 bits
    decide the "once" rounding, so this is where a different exp/sigmoid in the fused kernel would show."""
    gate = all_bf16().repeat(8).reshape(8, -1)
    up = _values(gate.shape, 10)
    assert_same(lambda g, u, compiled: ops.swiglu(g, u, rule, compiled=compiled), (gate, up), rule)


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("rule", [r.value for r in SwiGLURule])
def test_swiglu_odd_shape(rule, dtype):
    # fp16 has three more mantissa bits than bf16: it showed Inductor's decomposition of SiLU's backward moving one
    # gradient in 6,000 by one unit in the last place, until that backward became an opaque ATen call.
    gate, up = _values((3, 7, 3000 + 13), 11).to(dtype), _values((3, 7, 3000 + 13), 12).to(dtype)
    assert_same(lambda g, u, compiled: ops.swiglu(g, u, rule, compiled=compiled), (gate, up), f"{rule} {dtype}")


@pytest.mark.parametrize(
    "family,profile", [("qwen3", "vllm"), ("qwen3", "sglang"), ("llama", "vllm-eager"), ("qwen3_moe", "aligned")]
)
def test_apply_compile_ops_gives_the_same_model_bitwise(family, profile):
    """``apply(..., compile_ops=True)``: logits and every parameter gradient equal the eager-op model's."""
    import roundalign
    from models import build, loss_and_grads, token_ids

    ids = token_ids(length=17)
    eager = roundalign.apply(build(family), profile, compile_ops=False)
    fused = roundalign.apply(build(family), profile, compile_ops=True)
    assert all(m._roundalign_compile_ops for m in fused.modules() if hasattr(type(m), "_roundalign_compile_ops"))
    logits_e, grads_e = loss_and_grads(eager, ids)
    logits_f, grads_f = loss_and_grads(fused, ids)
    assert_bitwise_equal(logits_f, logits_e, f"{family}/{profile} logits")
    assert grads_f.keys() == grads_e.keys()
    for name in grads_e:
        assert_bitwise_equal(grads_f[name], grads_e[name], name)
    roundalign.apply(fused, profile, compile_ops=False)  # the same profile again: only the switch changes
    assert not any(m._roundalign_compile_ops for m in fused.modules() if hasattr(type(m), "_roundalign_compile_ops"))
