"""Fair Cast onto a quantization grid (``roundalign.sync.grid``, ``Exporter(..., scheme=)``), against the definitions.

The references are written here scalar by scalar from the documented rule (docs/quantization.md, "Fair Cast on the
grid"): the value rounded is ``x = clamp(f32(f32(m / scale) + zp), lo, hi)`` with the scheme's scale and zero point
(which the RNE export computes, tested against compressed-tensors in tests/test_quant.py); its two neighbours on
the grid (integers, or E4M3 values enumerated from the format's definition); the exact probability
``(x - a) / (b - a)`` as a ``Fraction``; the draw from the Threefry words of ``noise.py`` (tested against the
published known-answer vectors in tests/test_sync_noise.py). Nothing here calls the code under test to compute an
expected value.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import pytest
import torch

from roundalign.quant import checkpoint
from roundalign.quant.grid import quantize_weight
from roundalign.quant.schemes import SCHEMES
from roundalign.sync import Exporter, noise, tensor_seed
from roundalign.sync.grid import served_weights

NAME = "model.layers.0.mlp.up_proj.weight"
GRID_SCHEMES = ("w8a8-int8", "w4a16-g32-zp", "w4a16-g32", "fp8")


def f32(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", v))[0]


def e4m3_values() -> list[float]:
    """Every non-negative finite E4M3FN value, from the format: subnormals m/8 * 2^-6, normals (1 + m/8) * 2^(e-7)
    for biased exponents 1..15, without the NaN pattern (e=15, m=7)."""
    values = [m / 8 * 2.0**-6 for m in range(8)]
    values += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8) if (e, m) != (15, 7)]
    return sorted(values)


E4M3 = e4m3_values()


def neighbours(x: float, fp8: bool) -> tuple[float, float]:
    """``a <= |x| <= b``, adjacent on the grid (``a == b`` where ``|x|`` is on it)."""
    ax = abs(x)
    if not fp8:
        return float(math.floor(ax)), float(math.ceil(ax))
    a = max(v for v in E4M3 if v <= ax)
    b = min(v for v in E4M3 if v >= ax)
    return a, b


def grid_step(master: torch.Tensor, grid, scheme) -> torch.Tensor:
    """The grid's spacing at each weight, in weight units: the scale (int grids), or the scale times E4M3's spacing
    at ``|w / scale|`` (2^(e - 3) in binade e, 2^-9 among the subnormals)."""
    size = master.shape[1] // grid.scale.shape[1]
    scale = grid.scale.float().repeat_interleave(size, dim=1)
    if scheme.weights != "fp8":
        return scale
    x = (master / scale).abs().clamp_min(2.0**-6)
    return scale * torch.exp2(torch.floor(torch.log2(x)) - 3)


def draw(p: Fraction, key: int, step: int, g: int) -> bool:
    """The documented draw of element ``g``: the first word of Threefry block ``g`` (stream 0) against ``p * 2^32``
    for ``p >= 2^-8``; below that, ``Bernoulli(M / 2^24) AND (-E fair flips all 0)`` for ``p = M * 2^(E - 24)``,
    from the five words of streams 1 to 3 (noise.tiny_draws' layout: x0, x1 of stream 1, x0, x1 of 2, x0 of 3)."""
    if p == 0:
        return False
    if p >= Fraction(1, 256):
        word = int(noise.threefry2x32(key, torch.tensor([g]), 4 * step)[0][0])
        return Fraction(word, 2**32) < p
    words = []
    for stream in (1, 2, 3):
        x0, x1 = noise.threefry2x32(key, torch.tensor([g]), 4 * step + stream)
        words += [int(x0[0]), int(x1[0])]
    mantissa, exponent = math.frexp(float(p))  # p is an fp32 value here: exact
    m = int(mantissa * 2**24)
    if not (words[0] & 0xFFFFFF) < m:
        return False
    flips = -exponent
    for word in words[1:5]:
        take = min(flips, 31)
        if (word & 0x7FFFFFFF) >> (31 - take):
            return False
        flips -= take
    return True


def reference_stochastic(master: torch.Tensor, scheme_name: str, key: int, step: int) -> list[float]:
    """Each element's served value (``(code - zp) * scale``), from the rule, one element at a time."""
    scheme = SCHEMES[scheme_name]
    grid = quantize_weight(master, scheme)  # scales and zero points: the RNE export's (tested in test_quant.py)
    lo, hi = scheme.grid
    out_rows, width = master.shape
    size = width // grid.scale.shape[1]
    served = []
    for i in range(out_rows):
        for j in range(width):
            scale = float(grid.scale[i, j // size])
            zp = 0 if grid.zero_point is None else int(grid.zero_point[i, j // size])
            x = f32(f32(float(master[i, j]) / scale) + zp)
            x = min(max(x, lo), hi)
            a, b = neighbours(x, scheme.weights == "fp8")
            p = Fraction(0) if a == b else (Fraction(abs(x)) - Fraction(a)) / (Fraction(b) - Fraction(a))
            assert float(p) == float(f32(float(p))), "the probability is an fp32 value"
            mag = b if draw(p, key, step, i * width + j) else a
            served.append((math.copysign(mag, x) - zp) * scale)
    return served


@pytest.mark.parametrize("scheme", GRID_SCHEMES)
def test_stochastic_export_draws_each_code_by_the_rule(scheme):
    torch.manual_seed(0)
    master = torch.randn(32, 64) * 0.02
    master[0, :4] = torch.tensor([1e-9, -3e-7, 0.0, 2.5e-6])  # tiny values: the dyadic draw
    exporter = Exporter("stochastic", seed=3, scheme=scheme)
    for step in range(2):
        served = served_weights(exporter.export({NAME: master}), SCHEMES[scheme])[NAME]
        if SCHEMES[scheme].weight_only:  # the engine dequantizes to bf16 before its GEMM
            expected = torch.tensor(reference_stochastic(master, scheme, tensor_seed(3, NAME), step)).bfloat16()
            expected = expected.view(master.shape)
            assert torch.equal(served, expected.float())
        else:
            expected = torch.tensor(
                reference_stochastic(master, scheme, tensor_seed(3, NAME), step), dtype=torch.float64
            )
            expected = expected.view(master.shape)
            assert torch.equal(served.double(), expected)


@pytest.mark.parametrize("scheme", GRID_SCHEMES)
def test_stochastic_export_is_unbiased_on_the_grid(scheme):
    """The mean of many exports of one master converges to it at the binomial rate, element by element (weight-only
    schemes: to the bf16 rounding of the grid point mix, checked on the codes' own grid)."""
    torch.manual_seed(1)
    master = torch.randn(32, 64) * 0.02
    sch = SCHEMES[scheme]
    grid = quantize_weight(master, sch)
    size = 64 // grid.scale.shape[1]
    scale = grid.scale.float().repeat_interleave(size, dim=1)
    exporter, n = Exporter("stochastic", seed=0, scheme=scheme), 400
    total = torch.zeros_like(master, dtype=torch.float64)
    for _ in range(n):
        served = checkpoint.split(exporter.export({NAME: master}), sch)[0][NAME.removesuffix(".weight")]
        total += served.dequantize(torch.float32).double()  # exact: (code - zp) * scale on the grid
    zp = 0.0 if grid.zero_point is None else grid.zero_point.float().repeat_interleave(size, dim=1)
    lo, hi = sch.grid
    inside = ((master / scale + zp) > lo) & ((master / scale + zp) < hi)
    step = grid_step(master, grid, sch)  # bounds each draw's deviation
    z = ((total / n - master.double()) / (step.double() / (2 * math.sqrt(n))))[inside]
    assert inside.float().mean() > 0.9
    assert z.abs().max() < 6, float(z.abs().max())  # a fixed seed: deterministic, and far inside the tail


@pytest.mark.parametrize("scheme", GRID_SCHEMES)
def test_error_feedback_conserves_exactly_and_stays_bounded(scheme):
    torch.manual_seed(2)
    master = torch.randn(32, 64) * 0.02
    sch = SCHEMES[scheme]
    exporter = Exporter("error-feedback", scheme=scheme)
    residual = torch.zeros_like(master)
    grid = quantize_weight(master, sch)
    size = 64 // grid.scale.shape[1]
    scale = grid_step(master, grid, sch)
    served_sum = torch.zeros_like(master, dtype=torch.float64)
    steps = 64
    for _ in range(steps):
        v = master + residual  # fl32(m + e): the law's one rounding
        served = served_weights(exporter.export({NAME: master}), sch)[NAME]
        new = exporter._states[NAME].residual
        kept = new != 0
        # exact conservation where the residual is kept: served + e_new == v
        assert torch.equal((served + new)[kept], v[kept])
        assert (new.abs() <= 0.5 * scale * (1 + 2**-7) + 2**-8 * served.abs()).all()  # half a step (+ bf16 dequant)
        residual = new.clone()
        served_sum += served.double()
    # the served copy's running mean tracks the master to within a step over the run, wherever the grid reaches
    # it (a row's largest weight sits half a step past the last code: clamped, its residual dropped each time)
    zp = 0.0 if grid.zero_point is None else grid.zero_point.float().repeat_interleave(size, dim=1)
    lo, hi = sch.grid
    x = master / grid.scale.float().repeat_interleave(size, dim=1) + zp
    inside = (x > lo + 0.5) & (x < hi - 0.5)
    error = (served_sum / steps - master.double()).abs()
    assert (error <= scale.double() / steps * 1.01 + 2**-8 * master.abs())[inside].all()


def test_round_to_nearest_is_the_checkpoint_of_the_bf16_copy():
    torch.manual_seed(3)
    master = {NAME: torch.randn(32, 64) * 0.02, "model.norm.weight": torch.randn(64)}
    for scheme in GRID_SCHEMES:
        exported = Exporter("rne", scheme=scheme).export(master)
        reference = checkpoint.served_state_dict(master, SCHEMES[scheme])
        assert exported.keys() == reference.keys()
        assert all(torch.equal(exported[k], reference[k]) for k in reference)


def test_an_exporter_resumes_bitwise_from_its_state_dict():
    torch.manual_seed(4)
    master = {NAME: torch.randn(32, 64) * 0.02, "model.norm.weight": torch.randn(64)}
    for sync in ("stochastic", "error-feedback"):
        a = Exporter(sync, seed=5, scheme="w8a8-int8")
        a.export(master)
        b = Exporter(sync, seed=5, scheme="w8a8-int8")
        b.load_state_dict(a.state_dict())
        moved = {k: v + 1e-4 for k, v in master.items()}
        one, two = a.export(moved), b.export(moved)
        assert all(torch.equal(one[k], two[k]) for k in one)
        with pytest.raises(ValueError, match="scheme='w8a8-int8'"):
            Exporter(sync, seed=5).load_state_dict(a.state_dict())


def test_a_small_update_reaches_the_grid_only_by_fair_cast():
    """Weights on the grid (a master the served copy holds exactly) drifting by 1/100 of a grid step per export,
    40 exports: round-to-nearest serves none of the drift (no weight crosses its rounding midpoint), while the
    served copy's mean over the exports follows the master's under stochastic rounding and error feedback (the
    share of the mean drift served is about 1: SR is unbiased at every export, EF's error stays within a step)."""
    torch.manual_seed(5)
    sch = SCHEMES["w8a8-int8"]
    # Codes below 32 on a power-of-two scale: the master is exact in bf16 too (the RNE export quantizes the bf16
    # cast) and within an eighth of a step of it while it drifts. Column 0 holds each row's largest weight (127.5
    # steps, compressed-tensors' half-step range), which does not move, so the scale stays 2^-8.
    codes = torch.randint(-31, 32, (64, 128)).float()
    codes[:, 0] = 127.5
    master, step = codes * 2.0**-8, 2.0**-8
    direction = torch.sign(torch.randn_like(master))
    direction[:, 0] = 0
    share = {}
    for sync in ("rne", "stochastic", "error-feedback"):
        exporter, served_sum, master_sum, first = Exporter(sync, seed=0, scheme=sch), 0.0, 0.0, None
        for t in range(40):  # the drift reaches 0.39 of a step: below the 7/16 where the bf16 cast rounds up
            m = master + direction * (t * step / 100)
            served = served_weights(exporter.export({NAME: m}), sch)[NAME].double()
            first = served if first is None else first
            served_sum, master_sum = served_sum + served, master_sum + m.double()
        moved, drift = served_sum / 40 - first, master_sum / 40 - master.double()
        share[sync] = float((moved * drift).sum() / (drift * drift).sum())
    assert share["rne"] == 0.0
    assert 0.9 < share["stochastic"] < 1.1 and 0.9 < share["error-feedback"] < 1.1, share


def test_grid_export_errors():
    master = {NAME: torch.randn(32, 64) * 0.02}
    with pytest.raises(ValueError, match="bfloat16"):
        Exporter("stochastic", dtype=torch.float16, scheme="w8a8-int8")
    bad = {NAME: master[NAME].clone()}
    bad[NAME][0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        Exporter("stochastic", scheme="w8a8-int8").export(bad)
    with pytest.raises(Exception, match="group size"):
        Exporter("stochastic", scheme="w4a16").export({NAME: torch.randn(32, 96)})
    # a scheme the engine quantizes itself at load: Fair Cast is on the bf16 copy it loads
    served = Exporter("stochastic", scheme="fp8-online").export(master)
    assert served.keys() == master.keys() and served[NAME].dtype == torch.bfloat16


def test_the_reference_engine_serves_the_exported_codes():
    """A weight-only engine serving exported codes computes as the bf16 engine whose weights are those codes
    dequantized (the weight vLLM's 4-bit kernel multiplies by): an independent path through the engine."""
    from roundalign.engine import Engine
    from tests.test_engine_matches_trainer import trainer_model

    model = trainer_model("qwen3", num_hidden_layers=1)
    master = {k: v.detach().float() for k, v in model.state_dict().items()}
    scheme = SCHEMES["w4a16-g32-zp"]
    served = Exporter("stochastic", seed=1, scheme=scheme).export(master)
    quantized = Engine(model, profile="vllm-reference-kernels+quantization=w4a16-g32-zp")
    quantized.load_weights(served)
    plain = Engine(model, profile="vllm-reference-kernels")
    plain.load_weights({k: v.bfloat16() for k, v in served_weights(served, scheme).items()})
    rne = Engine(model, profile="vllm-reference-kernels+quantization=w4a16-g32-zp")
    ids = list(range(5, 45))
    got = quantized.score([ids[:3]], [ids[3:]], mode="prefill")[0]
    assert torch.equal(got, plain.score([ids[:3]], [ids[3:]], mode="prefill")[0])
    assert not torch.equal(got, rne.score([ids[:3]], [ids[3:]], mode="prefill")[0])
    with pytest.raises(Exception, match="sync='rne'"):
        quantized.load_weights(served, sync="stochastic")
