"""The fused kernels' machinery (``roundalign.ops._fused``): one kernel per signature serves every size, odd layouts
give the eager bits, the default falls back with one warning where nothing can compile, and the disk cache's key
follows roundalign's sources.

Bitwise equality of every op and rule is tests/test_ops_compiled.py's; here the inputs are chosen to stress what a
kernel compiled once with symbolic sizes must get right. Compiling takes seconds, hence ``slow``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import roundalign
from helpers import assert_bitwise_equal
from models import build, loss_and_grads, token_ids
from roundalign import compile_key, ops
from roundalign.ops import _fused, rms_norm
from roundalign.ops.rms_norm import _rms_norm_compiled_op
from roundalign.ops.rope import _rope_compiled_op

pytestmark = pytest.mark.slow
BF16 = torch.bfloat16


def _both(fn, *inputs):
    """(eager, fused) outputs and input gradients of ``fn(*inputs, compiled=...)``."""
    results = []
    for compiled in (False, True):
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        out = fn(*leaves, compiled=compiled)
        out.backward(torch.linspace(-2, 2, out.numel()).reshape(out.shape).to(out.dtype))
        results.append((out.detach(), [leaf.grad for leaf in leaves]))
    return results


def _assert_same(fn, *inputs, what=""):
    (out_e, grads_e), (out_f, grads_f) = _both(fn, *inputs)
    assert_bitwise_equal(out_f, out_e, f"{what} output")
    for i, (a, b) in enumerate(zip(grads_f, grads_e, strict=True)):
        assert (a is None) == (b is None)
        if a is not None:
            assert_bitwise_equal(a, b, f"{what} grad {i}")


def test_one_kernel_serves_every_row_count_even_after_a_square_first_call():
    """Sizes are symbolic, each dim its own symbol: a first call whose rows equal its width (256 x 256) must not
    teach the kernel that they are equal."""
    w = torch.randn(256).to(BF16)

    def norm(x, w, compiled):
        return ops.rms_norm(x, w, 1e-6, "round_after_weight", compiled=compiled)

    for rows in (256, 300, 7, 1):
        _assert_same(norm, torch.randn(rows, 256).to(BF16), w, what=f"{rows} rows")
    mine = {  # this test's kernels: round_after_weight, bf16 rows of >= 2 (a 1-row input is its own signature)
        sigs
        for (_, consts, sigs) in _rms_norm_compiled_op._fwd_kernels._cache
        if consts[1] == "round_after_weight" and sigs[0][0] == BF16 == sigs[1][0] and sigs[0][2] == (False, False)
    }
    assert len(mine) == 1, mine


def test_layouts_views_slices_and_empty_inputs():
    def norm(x, w, compiled):
        return ops.rms_norm(x, w, 1e-6, "round_before_weight", compiled=compiled)

    base = torch.randn(6, 40, 128).to(BF16)
    w = torch.randn(64).to(BF16)
    _assert_same(norm, base[:, :, :64], w, what="a slice (rows not dense)")
    _assert_same(norm, base.reshape(6, 40, 2, 64).transpose(1, 2), w, what="a transposed view")
    empty = ops.rms_norm(torch.empty(0, 64, dtype=BF16), w, 1e-6, "round_before_weight", compiled=True)
    assert empty.shape == (0, 64)

    def rope(x, cos, sin, compiled):
        return ops.rope(x, cos, sin, "once", BF16, compiled)

    angles = torch.rand(1, 9, 16) * 30
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(BF16), torch.cat([angles.sin()] * 2, -1).to(BF16)
    q = torch.randn(3, 9, 4, 32).to(BF16)  # (B, T, H, D), as the projection writes it
    _assert_same(rope, q.transpose(1, 2), cos.unsqueeze(1), sin.unsqueeze(1), what="rope, cos shared by the batch")
    _assert_same(rope, q.transpose(1, 2).contiguous(), cos.unsqueeze(1), sin.unsqueeze(1), what="rope, contiguous")
    layouts = {key[2][0][3] for key in _rope_compiled_op._fwd_kernels._cache}
    assert len(layouts) == 2  # the transposed and the contiguous q each got their kernel


def test_default_falls_back_to_the_eager_ops_with_one_warning(monkeypatch):
    ids = token_ids(length=9)
    reference = roundalign.apply(build("qwen3"), "vllm", compile_ops=False)
    monkeypatch.setenv(_fused.ENV, "1")  # apply's own default (the suite's conftest turns it off elsewhere)
    monkeypatch.setitem(_fused._available, "cpu", "no C++ compiler for Inductor on the CPU (test)")
    monkeypatch.setattr(_fused, "_warned", set())
    with pytest.warns(RuntimeWarning, match="running the eager ops: no C\\+\\+ compiler"):
        model = roundalign.apply(build("qwen3"), "vllm")
    assert not any(m._roundalign_compile_ops for m in model.modules() if hasattr(type(m), "_roundalign_compile_ops"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only: a second apply does not warn again
        roundalign.apply(build("qwen3"), "vllm")
    logits, grads = loss_and_grads(model, ids)
    logits_ref, grads_ref = loss_and_grads(reference, ids)
    assert torch.equal(logits, logits_ref)
    assert all(torch.equal(grads[k], grads_ref[k]) for k in grads_ref)
    with pytest.raises(RuntimeError, match=r"compile_ops=True\) needs Inductor to compile for cpu"):
        roundalign.apply(build("qwen3"), "vllm", compile_ops=True)


def test_the_environment_turns_the_default_off(monkeypatch):
    monkeypatch.setenv(_fused.ENV, "0")
    model = roundalign.apply(build("qwen3"), "vllm")
    assert not any(m._roundalign_compile_ops for m in model.modules() if hasattr(type(m), "_roundalign_compile_ops"))
    monkeypatch.setenv(_fused.ENV, "1")
    model = roundalign.apply(build("qwen3"), "vllm")
    assert all(m._roundalign_compile_ops for m in model.modules() if hasattr(type(m), "_roundalign_compile_ops"))


@pytest.fixture
def no_cache_key_tag():
    """torch.compile's cache key tag as a fresh process has it (ours added at import), restored afterwards."""
    with torch.compiler.config.patch(cache_key_tag=""):
        yield


def test_the_disk_cache_key_follows_roundalign_sources(monkeypatch, tmp_path, no_cache_key_tag):
    """A second build of one kernel loads it from Inductor's cache; with other sources (another SOURCE_KEY) it
    compiles anew instead of reusing the stale one."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x, w = torch.randn(5, 48).to(BF16), torch.randn(48).to(BF16)
    formula = _rms_norm_compiled_op._fwd_kernels.fn

    def build_once():
        counters.clear()
        kernels = _fused.Kernels("rms_norm_cache_test", formula)
        out = kernels.run((x, w), (1e-6, "round_after_weight", BF16))
        assert out is not None
        return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]

    assert build_once() == (0, 1)
    assert build_once() == (1, 0)
    monkeypatch.setattr(compile_key, "SOURCE_KEY", "0" * 16)
    assert build_once() == (0, 1)


def test_a_compiled_graph_that_calls_our_ops_is_keyed_on_their_sources(monkeypatch, tmp_path, no_cache_key_tag):
    """torch.compile of code that calls an op (as model.compile() of an aligned model does): a second compile loads
    the graph from Inductor's cache, and after a change of roundalign's sources (another SOURCE_KEY) it compiles
    anew, since the cache key alone does not see an op's backward, fake kernel or lowering."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x, w = torch.randn(4, 64).to(BF16), torch.randn(64).to(BF16)

    def loss(x, w):
        return rms_norm(x * 2, w, 1e-6, "round_after_weight").float().square().sum()

    def compile_once():
        counters.clear()
        torch._dynamo.reset()
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        torch.compile(loss)(xx, ww).backward()
        assert torch.equal(ww.grad, grad_ref)
        return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]

    ww = w.clone().requires_grad_()
    loss(x, ww).backward()
    grad_ref = ww.grad
    assert compile_once() == (0, 2)  # forward and backward graphs
    assert compile_once() == (2, 0)
    monkeypatch.setattr(compile_key, "SOURCE_KEY", "0" * 16)
    assert compile_once() == (0, 2)


def test_the_cache_key_tag_keeps_the_users_and_holds_one_source_key(monkeypatch, no_cache_key_tag):
    torch.compiler.config.cache_key_tag = "my-run"
    compile_key.key_compiles()
    compile_key.key_compiles()
    assert torch.compiler.config.cache_key_tag == f"my-run-roundalign-{compile_key.SOURCE_KEY}"
    monkeypatch.setattr(compile_key, "SOURCE_KEY", "0" * 16)
    compile_key.key_compiles()
    assert torch.compiler.config.cache_key_tag == "my-run-roundalign-0000000000000000"
    torch.compiler.config.cache_key_tag = "roundalign-nightly"  # a user's tag that merely starts like ours
    compile_key.key_compiles()
    assert torch.compiler.config.cache_key_tag == "roundalign-nightly-roundalign-0000000000000000"


def test_source_key_changes_with_a_source(tmp_path):
    files = []
    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text(f"# {name}\n")
        files.append(tmp_path / name)
    before = compile_key.source_key(files)
    files[1].write_text("# b.py, edited\n")
    assert compile_key.source_key(files) != before


def test_the_source_key_covers_every_module_that_registers_an_op():
    """Every roundalign module that defines a torch.library op (or its fake, backward or lowering) is hashed."""
    import re
    from pathlib import Path

    root = Path(roundalign.__file__).parent
    registering = {
        p for p in root.rglob("*.py") if re.search(r"torch\.library\.(custom_op|Library|register_fake)", p.read_text())
    }
    assert registering
    assert registering <= set(compile_key.sources())
