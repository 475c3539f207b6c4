"""Fair Cast's counter-based noise and compiled export kernels: known answers, one stream on every path, shards.

The independent references are Random123's published known-answer vectors for Threefry-2x32-20 and the numpy
restatement of the documented stream in tests/formulas.py; the compiled kernels (roundalign/sync/_native.c) and the
torch formulas (roundalign/sync/noise.py, export.py) are each checked against them and against each other.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from roundalign import native
from roundalign.sync import Exporter, ExportState, _native, export_bf16, noise, tensor_seed
from tests import formulas

# Random123 (DEShawResearch) kat_vectors, threefry2x32_20: (counter, key) -> output, the same vectors JAX tests.
KNOWN_ANSWERS = [
    ((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6B200159, 0x99BA4EFE)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
    ((0x243F6A88, 0x85A308D3), (0x13198A2E, 0x03707344), (0xC4923A9C, 0x483DF7A0)),
]


@pytest.mark.parametrize("counter, key, want", KNOWN_ANSWERS)
def test_threefry_known_answers(counter, key, want):
    key64 = key[0] | key[1] << 32
    x0, x1 = noise.threefry2x32(key64, torch.tensor([counter[0]]), counter[1])
    assert (int(x0), int(x1)) == want
    y0, y1 = formulas.threefry2x32(key64, [counter[0]], counter[1])
    assert (int(y0[0]), int(y1[0])) == want


def _kernels():
    lib = _native.kernels()
    assert lib is not None, f"the compiled export kernels must build on the suite's machines: {_native._state}"
    return lib


@pytest.mark.parametrize("first, n", [(0, 1), (0, 1000), (5, 333), (31, 1), (100_003, 70_001), (7, 129), (2**33, 77)])
def test_compiled_kernels_are_the_documented_stream(first, n):
    lib, key, step = _kernels(), 0xDEADBEEF12345678, 3
    g = torch.Generator().manual_seed(n)
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, generator=g)
    bits[bits.view(torch.float32).isnan()] = 0  # NaN: served as the cast serves it, checked in test_sync_export
    out = torch.empty(n, dtype=torch.int16)
    lib.roundalign_sr_bf16(bits.data_ptr(), out.data_ptr(), n, first, key & 0xFFFFFFFF, key >> 32, 4 * step)
    index = torch.arange(first, first + n)
    want = ((bits.long() & 0xFFFFFFFF) + formulas.sr_noise_bf16(key, step, index)) >> 16  # add below bf16, truncate
    assert torch.equal(out.long() & 0xFFFF, want & 0xFFFF)
    assert torch.equal(noise.bf16_noise(key, step, first, n), formulas.sr_noise_bf16(key, step, index))
    # The torch formulas of fp16's words and of stream 1 (its tiny values' draws); the fp16 kernel is checked against
    # them in test_kernels_and_torch_formulas_export_the_same_bits and test_sync_export's stream tests.
    if first + n <= 1 << 32:  # fp16's stream covers 2^32 elements
        assert torch.equal(noise.fp16_words(key, step, index), formulas.sr_noise_fp16(key, step, index))
        assert torch.equal(noise.bf16_noise_at(key, step, index), formulas.sr_noise_bf16(key, step, index))
        assert torch.equal(noise.tiny_draws(key, step, index), formulas.tiny_draws(key, step, index))


def _specials(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-140, 128, (n,), generator=g).float())
    x[::101] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.4e38, -3.4e38, 2.0**-149]).repeat(
        (x[::101].numel() + 7) // 8
    )[: x[::101].numel()]
    return x


def _with_path(path: str, monkeypatch, fn):
    monkeypatch.setattr(_native, "_state", {})
    if path == "torch":
        monkeypatch.setenv(_native.ENV, "0")
    else:
        monkeypatch.delenv(_native.ENV, raising=False)
    try:
        return fn()
    finally:
        monkeypatch.setattr(_native, "_state", {})
        monkeypatch.delenv(_native.ENV, raising=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("threads", [1, 2])
def test_kernels_and_torch_formulas_export_the_same_bits(dtype, threads, monkeypatch):
    # Every mode on specials (zeros of both signs, inf, NaN, overflow, subnormals) over a tensor large enough to be
    # split across threads, at an odd offset, with a residual carried over two steps.
    _kernels()
    x = _specials(3 * _native._MIN_SPLIT + 13, 0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # how many pieces the kernels cut a tensor into

    native = _with_path("kernels", monkeypatch, lambda: _every_mode(x, dtype))
    reference = _with_path("torch", monkeypatch, lambda: _every_mode(x, dtype))
    for a, b in zip(native, reference, strict=True):
        assert torch.equal(a, b)


def _weight_like(n: int, seed: int) -> torch.Tensor:
    """Weights as a model has them (N(0, 0.02^2), so nearly every run of 32 lies in fp16's normal range, the
    kernels' common path), with a few runs that leave it at every kind of edge, each alone among ordinary values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 0.02
    x[x.abs() < 2.0**-13] = 0.01  # no value below fp16's normal range except the planted ones
    edges = [2.0**-14, -(2.0**-14), 2.0**-14 * (1 - 2.0**-24), 2.0**-17, 2.0**-17 * (1 - 2.0**-24), 2.0**-24,
             2.0**-30, 2.0**-149, 0.0, -0.0, 65504.0, 65519.996, 65520.0, 65536.0, -65536.0, 3.0e38,
             float("inf"), -float("inf"), float("nan")]  # fmt: skip
    at = torch.arange(len(edges)) * 4099 + 77  # each far from the others: its own run of 32 in its own thread's part
    x[at] = torch.tensor(edges)
    x.view(torch.int32)[at[-1] + 64] = 0x7F800001  # a NaN whose payload is one bit: noise must not reach it
    x.view(torch.int32)[at[-1] + 128] = -0x00000001  # -NaN, every payload bit set
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("stream", [False, True], ids=["cached", "streamed"])
def test_weight_like_values_export_the_formulas_bits(dtype, threads, stream, monkeypatch):
    # The kernels' common path (fp16: 13 noise bits for a run of values in the normal range) and its edges (a run
    # with one value below 2^-14, zeros, NaN, overflow), with the served copy written through the cache or around it
    # (streamed stores, what a large export does): the torch formulas' bits, residual included.
    _kernels()
    x = _weight_like(3 * _native._MIN_SPLIT + 13, 5)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(_native, "STREAM_BYTES", 0 if stream else 1 << 62)
    native = _with_path("kernels", monkeypatch, lambda: _every_mode(x, dtype))
    reference = _with_path("torch", monkeypatch, lambda: _every_mode(x, dtype))
    for a, b in zip(native, reference, strict=True):
        assert torch.equal(a, b)


def test_kernels_built_without_openmp_run_on_their_own_threads(monkeypatch, tmp_path):
    # Where torch ships no libgomp the kernels build without OpenMP and run_many calls one run per Python thread:
    # the same bits, split over two threads.
    _kernels()
    x = _weight_like(3 * _native._MIN_SPLIT + 13, 6)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    with_openmp = [_every_mode(x, dtype) for dtype in (torch.bfloat16, torch.float16)]
    assert _native.kernels().roundalign_sync_threads() == (native.openmp() != ([], ()))
    monkeypatch.setenv("ROUNDALIGN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "openmp", lambda: ([], ()))
    monkeypatch.setattr(_native, "_state", {})
    monkeypatch.setattr(_native, "_pool", [])
    assert _native.kernels().roundalign_sync_threads() == 0
    without = [_every_mode(x, dtype) for dtype in (torch.bfloat16, torch.float16)]
    assert _native._pool and _native._pool[1] == 2  # the runs went to two pool threads
    for a, b in zip(sum(with_openmp, []), sum(without, []), strict=True):
        assert torch.equal(a, b)


def _every_mode(x: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """Two stochastic exports at an odd offset and two error-feedback steps of ``x``: their bits, residual included."""
    s, ef = ExportState.seeded(9), ExportState()
    outs = [export_bf16(x, "stochastic", s, dtype, offset=12_345) for _ in range(2)]
    outs += [export_bf16(x * (1 + k * 2.0**-10), "error-feedback", ef, dtype) for k in range(2)]
    return [o.view(torch.int16) for o in outs] + [ef.residual.view(torch.int32)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("flag", ["-mno-f16c", "-mno-avx512f", "-mno-avx"])
def test_kernels_built_for_older_x86_serve_the_same_bits(flag, dtype, monkeypatch, tmp_path):
    # The kernels adapt to the CPU they are built for: fp16's conversions use F16C where it is there (else integer
    # RNE), and AVX-512's 32 registers take 8 Threefry chains (else 4); without AVX the vectors are SSE's. Builds
    # without them serve the same bits, specials, weight-like runs and fp16's values below 2^-17 included, with the
    # served copy streamed past the cache.
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("F16C and AVX-512 are x86 extensions: this machine builds only the portable code")
    _kernels()
    x = torch.cat([_specials(3 * _native._MIN_SPLIT + 13, 3), _weight_like(2 * _native._MIN_SPLIT, 3)])
    monkeypatch.setattr(_native, "STREAM_BYTES", 0)
    native = _every_mode(x, dtype)
    monkeypatch.setenv("ROUNDALIGN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_native, "_FLAGS", [*_native._FLAGS, flag])
    monkeypatch.setattr(_native, "_state", {})
    assert _native.kernels() is not None, _native._state
    assert len(list((tmp_path / "sync-kernels").glob("*.so"))) == 1  # built with the flag, not the cached build
    older = _every_mode(x, dtype)
    for a, b in zip(native, older, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("path", ["kernels", "torch"])
def test_a_shard_exports_as_its_slice_of_the_whole(dtype, path, monkeypatch):
    # The counter-based stream's promise: export_bf16(whole[a:b], offset=a) == export_bf16(whole)[a:b], bit for bit,
    # for cuts anywhere (inside a 32-element group, one element long), fp16's tiny-range draws included.
    x = _specials(100_003, 1)
    x[500:600] *= 2.0**-40  # fp16's tiny range in a later shard
    whole = _with_path(path, monkeypatch, lambda: export_bf16(x, "stochastic", ExportState(key=77, step=5), dtype))
    edges = [0, 1, 31, 32, 550, 551, 65_537, x.numel()]
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        part = _with_path(
            path, monkeypatch, lambda a=a, b=b: export_bf16(x[a:b], "stochastic", ExportState(77, 5), dtype, offset=a)
        )
        assert torch.equal(part.view(torch.int16), whole[a:b].view(torch.int16)), (a, b)


def test_fresh_noise_every_step_is_unbiased_over_steps():
    # One value between two bf16 neighbours, exported 4,000 times through one state: the noise must be fresh at each
    # step (a stream that repeated across steps would serve the same neighbour every time). Bernstein, 1e-9.
    import math

    x = torch.full((8,), 1.0 + 2.0**-9)  # p(up) = 1/4 at bf16 spacing 2^-7
    state, ups = ExportState.seeded(3), torch.zeros(8)
    steps = 4000
    for _ in range(steps):
        ups += (export_bf16(x, "stochastic", state).float() > 1.0).float()
    log_term = math.log(2.0 / 1e-9)
    bound = log_term / 3 + math.sqrt(log_term**2 / 9 + 2 * log_term * steps * 0.25 * 0.75)
    assert bool(((ups - steps * 0.25).abs() < bound).all()), ups


def test_build_is_cached_and_a_missing_compiler_falls_back_with_one_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("ROUNDALIGN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(_native.ENV, raising=False)
    monkeypatch.setattr(_native, "_state", {})
    assert _native.kernels() is not None
    built = list((tmp_path / "sync-kernels").glob("*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(_native, "_state", {})
    assert _native.kernels() is not None  # a second process: loads the cached build, compiles nothing
    assert [p.stat().st_mtime_ns for p in (tmp_path / "sync-kernels").glob("*.so")] == [stamp]

    def no_compiler():
        raise RuntimeError("no C or C++ compiler found (install gcc, or set CXX or CC)")

    monkeypatch.setattr(native, "compiler", no_compiler)
    monkeypatch.setattr(_native, "_state", {})
    x = _specials(5000, 2)
    with pytest.warns(RuntimeWarning, match="no C or C.. compiler found.*the same bits"):
        fallback = export_bf16(x, "stochastic", ExportState.seeded(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once, not per call
        export_bf16(x, "error-feedback", ExportState())
    monkeypatch.setattr(_native, "_state", {})
    monkeypatch.undo()
    _native._state.clear()
    assert torch.equal(
        fallback.view(torch.int16), export_bf16(x, "stochastic", ExportState.seeded(1)).view(torch.int16)
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mode", ["stochastic", "error-feedback"])
@pytest.mark.parametrize("threads", [1, 2])
def test_exporter_batched_call_is_export_bf16_per_tensor(mode, threads, dtype, monkeypatch):
    # Exporter.export hands a whole bf16 state_dict to the kernels at once (work balanced over threads, tensors cut
    # across thread boundaries): the same bits as export_bf16 tensor by tensor, over steps, empty tensors included.
    _kernels()
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(4)
    shapes = {"a.weight": (300, 700), "b.bias": (7,), "c.empty": (0, 3), "d.weight": (513, 129), "e.scalar": ()}
    masters = [{n: torch.randn(s, generator=g) * 0.02 for n, s in shapes.items()} for _ in range(3)]
    for m in masters:
        m["d.weight"][100:140] *= 2.0**-40  # fp16's tiny range, in a tensor the threads cut
    exporter = Exporter(mode, seed=5, dtype=dtype)
    states = {n: ExportState.seeded(tensor_seed(5, n)) if mode == "stochastic" else ExportState() for n in shapes}
    for m in masters:
        got = exporter.export(m)
        for name, t in m.items():
            want = export_bf16(t, mode, states[name], dtype)
            assert got[name].shape == want.shape and torch.equal(got[name].view(torch.int16), want.view(torch.int16))
