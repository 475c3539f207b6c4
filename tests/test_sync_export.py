"""roundalign.sync export: RNE, stochastic rounding (bf16 and fp16) and error feedback, against formulas.

The stochastic-rounding references do not reuse the bit tricks of the code: the two neighbours of x come from a
sorted table of every finite value of the target dtype (all 2^16 bit patterns decoded), with a virtual next value
past the largest finite (2^128 for bf16, 2^16 for fp16) standing for inf, and p = (x - a) / (b - a) in float64.
Statistical checks use Bernstein's inequality with a stated false-failure probability; the draws are seeded, so a
run is deterministic, and the bound only says the threshold was derived, not tuned.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import subprocess
import sys

import pytest
import torch

from roundalign.sync import EXPORT_DTYPES, MODES, Exporter, ExportState, export_bf16
from roundalign.sync.export import _CHUNK
from tests import formulas

DELTA = 1e-9  # false-failure probability allowed per statistical check
VIRTUAL_TOP = {torch.bfloat16: 2.0**128, torch.float16: 2.0**16}  # the "next value" past the largest finite


def bernstein_deviation(variance: float, delta: float = DELTA) -> float:
    """t with P(|S - E S| >= t) <= delta for a sum S of independent terms within 1 of their means, total variance V.

    Bernstein: P(|S - ES| >= t) <= 2 exp(-t^2 / (2 (V + t/3))). Setting the right side to delta and solving the
    quadratic t^2 - (2L/3) t - 2 L V = 0 with L = ln(2/delta) gives t = L/3 + sqrt(L^2/9 + 2 L V).
    """
    log_term = math.log(2.0 / delta)
    return log_term / 3.0 + math.sqrt(log_term**2 / 9.0 + 2.0 * log_term * variance)


def grid(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of ``dtype`` in float64, sorted, plus the virtual ±top for inf."""
    codes = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    values = codes.view(dtype).double()
    values = values[torch.isfinite(values)].unique()  # +0 and -0 merge
    top = VIRTUAL_TOP[dtype]
    return torch.cat([torch.tensor([-top], dtype=torch.float64), values, torch.tensor([top], dtype=torch.float64)])


def neighbours(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a, b, p): a <= x <= b adjacent in ``dtype`` (inf as the virtual top), P(b) = p, all float64."""
    g = grid(dtype)
    x64 = x.double()
    hi = torch.searchsorted(g, x64, right=False)  # first grid value >= x
    b = g[hi]
    exact = b == x64
    a = torch.where(exact, b, g[(hi - 1).clamp(min=0)])
    p = torch.where(exact, torch.zeros_like(x64), (x64 - a) / (b - a))  # exact: b - a is a power of two
    return a, b, p


def as_float64(served: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Served values in float64 with ±inf mapped to the virtual ±top, to compare with the grid."""
    v = served.double()
    top = VIRTUAL_TOP[dtype]
    return torch.where(torch.isinf(v), torch.copysign(torch.full_like(v, top), v), v)


def sr_test_values(dtype: torch.dtype) -> torch.Tensor:
    """Values that exercise SR: ordinary, negative, near powers of two, representable, subnormal, near overflow."""
    torch.manual_seed(0)
    f32max = torch.finfo(torch.float32).max
    common = [
        1.0 + 2.0**-20, 1.0 - 2.0**-20, -1.0 - 2.0**-20, 2.0**10 * (1 - 2.0**-22), -(2.0**-5) * (1 + 2.0**-18),
        0.1, -0.1, 1.0 / 3.0, -2.0 / 3.0, 1.0, -0.5, 3.0, 0.0, -0.0, 2.0**-149, -(2.0**-149), 1e-39, -3e-40, 1e-45,
    ]  # fmt: skip
    if dtype == torch.bfloat16:
        bmax = torch.finfo(torch.bfloat16).max
        special = [bmax, -bmax, f32max, -f32max, 3.3961e38, 1.5 * 2.0**-133, 2.0**-126 * (1 - 2.0**-20), 2.0**-126]
    else:
        special = [
            65504.0, 65510.0, 65519.0, 65520.0, 65535.99, -65520.0, 2.0**-14 * (1 + 2.0**-12),
            2.0**-14 * (1 - 2.0**-12), 2.0**-24, 2.0**-25, -(2.0**-25), 3 * 2.0**-26, 2.0**-30, 5 * 2.0**-33,
            2.0**-40, -(2.0**-27), 1e-7, -3e-6,
        ]  # fmt: skip
    rand = torch.randn(24) * torch.logspace(-6, 3, 24)
    return torch.cat([torch.tensor(common + special, dtype=torch.float32), rand.float()])


@pytest.mark.parametrize("dtype", EXPORT_DTYPES, ids=str)
def test_rne_is_the_plain_cast(dtype):
    x = torch.cat([sr_test_values(dtype), torch.tensor([float("inf"), -float("inf"), float("nan"), 1e30, -1e30])])
    bits = torch.int16
    assert torch.equal(export_bf16(x, "rne", dtype=dtype).view(bits), x.to(dtype).view(bits))
    out = export_bf16(x, dtype=dtype)
    assert out.data_ptr() != x.data_ptr() and out.dtype == dtype


@pytest.mark.parametrize("dtype", EXPORT_DTYPES, ids=str)
def test_stochastic_returns_a_neighbour_and_is_unbiased(dtype):
    x = sr_test_values(dtype)
    n_draws = 4000
    out = export_bf16(x.repeat(n_draws, 1), "stochastic", ExportState.seeded(1), dtype)  # independent noise each
    assert out.dtype == dtype and out.shape == (n_draws, x.numel())
    a, b, p = neighbours(x, dtype)
    got = as_float64(out, dtype)
    # Only ever one of the two neighbours; a representable x stays itself; the sign never flips (-0 stays -0).
    assert bool(((got == a) | (got == b)).all())
    assert torch.equal(torch.signbit(out), torch.signbit(x).expand_as(out))
    went_up = (got == b) & (b != a)
    count = went_up.sum(dim=0).double()
    assert bool((count[p == 0] == 0).all())
    # P(b) = p per element: count ~ Binomial(N, p); Bernstein with variance N p (1 - p), per column.
    for j in range(x.numel()):
        pj = float(p[j])
        bound = bernstein_deviation(n_draws * pj * (1 - pj))
        assert abs(float(count[j]) - n_draws * pj) <= bound, (float(x[j]), pj, float(count[j]))
        # The mean of the exports then converges to x: |mean - x| = (b - a) |count / N - p|.
        if math.isfinite(float(out[:, j].double().sum())):
            mean = float(out[:, j].double().mean())  # exact sum: <= 11 significant bits times 4000 draws
            assert abs(mean - float(x[j])) <= (float(b[j]) - float(a[j])) * bound / n_draws


@pytest.mark.parametrize("dtype", EXPORT_DTYPES, ids=str)
def test_stochastic_non_finite_and_overflow(dtype):
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e30, -1e30])
    out = export_bf16(x.repeat(50, 1), "stochastic", ExportState.seeded(2), dtype)
    # inf/nan pass through like the cast; 1e30 is past the virtual top of fp16 (always inf) but not of bf16.
    assert bool((out[:, 0] == float("inf")).all()) and bool((out[:, 1] == -float("inf")).all())
    assert bool(out[:, 2].isnan().all())
    if dtype == torch.float16:
        assert bool((out[:, 3] == float("inf")).all()) and bool((out[:, 4] == -float("inf")).all())
    # Near the top, rounding up past the largest finite gives inf, with the probability of reaching the virtual top.
    top = torch.finfo(dtype).max
    half = top + (VIRTUAL_TOP[dtype] - top) / 2  # p = 1/2 exactly
    out = export_bf16(torch.full((4000,), half, dtype=torch.float32), "stochastic", ExportState.seeded(3), dtype)
    infs = int(torch.isinf(out).sum())
    assert bool(((out == top) | (out == float("inf"))).all())
    assert abs(infs - 2000) <= bernstein_deviation(4000 * 0.25)


# -- the noise streams and the chunked passes, bit for bit -------------------------------------------------------------

NAN_PAYLOADS = [0x7F800001, 0x7FBFFFFF, 0x7FFFFFFF, -1, -8323073]  # NaNs whose payload + noise would carry or truncate


def many_chunks(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """fp32 values over 2 1/2 of the export's CPU chunks: many scales and both signs, zeros, fp16's subnormal and
    tiny range, values past the largest finite, and non-finite ones (NaNs with awkward payloads) spread over the
    chunks, so that every pass meets chunk edges and the non-finite fix-up happens in a later chunk than the first."""
    g = torch.Generator().manual_seed(seed)
    n = 2 * _CHUNK + _CHUNK // 2 + 7
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 20, (n,), generator=g).float())
    x[::997] = 0.0
    x[1::1009] = -0.0
    x[2::1013] = torch.finfo(dtype).max * 1.0001
    x[3::1019] = -torch.finfo(dtype).max * 1.0001
    x[_CHUNK + 5] = float("inf")
    x[2 * _CHUNK + 11] = -float("inf")
    nans = torch.tensor(NAN_PAYLOADS, dtype=torch.int32).view(torch.float32)
    x[_CHUNK + 100 : _CHUNK + 100 + nans.numel()] = nans
    return x


def sr_reference(x: torch.Tensor, noise: torch.Tensor, bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SR of finite fp32 ``x`` given each element's noise, uniform in [0, 2^bits), as float64 (inf past the top).

    The neighbour away from zero is taken iff ``noise >= 2^bits * (1 - p_away)``: probability ``p_away`` exactly
    when ``p_away * 2^bits`` is an integer (the noise has enough bits). Neighbours and p come from the grid table.
    """
    a, b, p = neighbours(x, dtype)
    positive = x > 0
    away, near = torch.where(positive, b, a), torch.where(positive, a, b)
    p_away = torch.where(positive, p, 1.0 - p)
    scale = torch.exp2(bits.double())
    assert bool((p_away * scale == (p_away * scale).round()).all())  # the noise resolves p exactly
    up = noise.double() >= scale * (1.0 - p_away)
    top = VIRTUAL_TOP[dtype]
    value = torch.where(up, away, near)
    return torch.where(value.abs() == top, torch.copysign(torch.full_like(value, float("inf")), value), value)


@pytest.fixture(params=["kernels", "torch"])
def sync_path(request, monkeypatch):
    """Each stream test runs twice: with the compiled CPU kernels (required here: the suite's machines have gcc) and
    with the torch formulas that run where no compiler is found and on GPUs."""
    from roundalign.sync import _native

    monkeypatch.setattr(_native, "_state", {})
    if request.param == "torch":
        monkeypatch.setenv(_native.ENV, "0")
    else:
        monkeypatch.delenv(_native.ENV, raising=False)
        assert _native.kernels() is not None, _native._state.get("why")
    return request.param


def test_stochastic_bf16_is_the_reference_given_the_stream(sync_path):
    # The documented stream (formulas.sr_noise_bf16, numpy from Threefry's definition): element g's noise depends on
    # (key, step, g) alone, whatever the chunking and threading; each export is a new step.
    x = many_chunks(torch.bfloat16, 0)
    state = ExportState.seeded(21)
    export_bf16(x, "stochastic", state)  # step 0
    out = export_bf16(x, "stochastic", state)  # step 1: fresh noise
    assert state.step == 2
    noise = formulas.sr_noise_bf16(21, 1, torch.arange(x.numel()))
    finite = torch.isfinite(x)
    want = sr_reference(x[finite], noise[finite], torch.full((int(finite.sum()),), 16), torch.bfloat16)
    got = out[finite].double()
    assert torch.equal(got, want) and torch.equal(torch.signbit(out[finite]), torch.signbit(x[finite]))
    # Non-finite values are served as the plain cast serves them, NaN payloads included (none carried into inf/0).
    assert torch.equal(out[~finite].isnan(), x[~finite].isnan())
    assert torch.equal(out[torch.isinf(x)], x[torch.isinf(x)].to(torch.bfloat16))
    # The shape comes back and a strided master (copied once) is served like its contiguous copy.
    m = x[: 500 * 600].reshape(500, 600)
    assert torch.equal(
        export_bf16(m.t(), "stochastic", ExportState.seeded(4)).view(torch.int16),
        export_bf16(m.t().contiguous(), "stochastic", ExportState.seeded(4)).view(torch.int16),
    )


def test_stochastic_fp16_is_the_reference_given_the_stream(sync_path):
    # fp16's stream: element g's word (formulas.sr_noise_fp16), whose low d bits are its noise, d = log2 of fp16's
    # spacing over fp32's at x (13 in fp16's normal range, more below 2^-14, over 16 below 2^-17: the word's high
    # half); the exact Bernoulli draws of the values
    # below 2^-24 take streams 1 to 3 (checked statistically elsewhere, and for layout independence in test_sync_noise).
    x = many_chunks(torch.float16, 1)
    x = torch.where(x.abs() < 2.0**-26, x * 2.0**-30, x)  # more values in the tiny range
    out = export_bf16(x, "stochastic", ExportState.seeded(22), torch.float16)
    words = formulas.sr_noise_fp16(22, 0, torch.arange(x.numel()))
    _, exponent = torch.frexp(x.abs())  # |x| = f * 2^E, f in [1/2, 1): fp32 spacing 2^(E - 24)
    bits = torch.where(x.abs() < 2.0**-14, -exponent, 13)  # fp16 spacing: 2^-24 below 2^-14, else 2^(E - 11)
    bits = bits.clamp(max=30)  # a defined shift for the tiny ones (not checked bit for bit)
    noise = words & ((torch.ones_like(bits) << bits) - 1)
    tiny = x.abs() < 2.0**-24
    check = torch.isfinite(x) & (x.abs() < 2.0**16) & ~(tiny & (x != 0))
    assert int(tiny.sum()) > 100 and int((check & (x.abs() < 2.0**-14)).sum()) > 1000
    assert int((check & (x.abs() < 2.0**-17) & (x != 0)).sum()) > 1000  # the words' high half in use (d > 16)
    want = sr_reference(x[check], noise[check], bits[check], torch.float16)
    assert torch.equal(out[check].double(), want)
    assert torch.equal(torch.signbit(out[check | tiny]), torch.signbit(x[check | tiny]))
    a, b, _ = neighbours(x[tiny], torch.float16)
    assert bool(((out[tiny].double() == a) | (out[tiny].double() == b)).all())
    over = torch.isfinite(x) & (x.abs() >= 2.0**16)
    assert torch.equal(out[over], x[over].to(torch.float16))  # +-inf: past the virtual top
    assert torch.equal(out[~torch.isfinite(x)].isnan(), x[~torch.isfinite(x)].isnan())


@pytest.mark.parametrize("dtype", EXPORT_DTYPES, ids=str)
def test_error_feedback_over_many_chunks_is_the_formula(dtype, sync_path):
    x = many_chunks(dtype, 2)
    state, residual = ExportState(), None
    g = torch.Generator().manual_seed(3)
    for step in range(3):
        master = x + step * 2.0**-12 * torch.randn(x.shape, generator=g) * x.abs()
        v = master.clone() if residual is None else master + residual  # the first v is the master, -0 included
        served = export_bf16(master, "error-feedback", state, dtype)
        want = v.to(dtype)
        nan = want.isnan()
        assert torch.equal(served.isnan(), nan) and torch.equal(
            served[~nan].view(torch.int16), want[~nan].view(torch.int16)
        )
        finite = torch.isfinite(want)
        residual = torch.where(finite, v - want.float(), torch.zeros_like(v))  # reset where served is not finite
        assert torch.equal(state.residual.view(torch.int32), residual.view(torch.int32))
    # A strided master and a strided residual in the state: the same exports as contiguous ones.
    m = x[: 500 * 600].reshape(500, 600)
    one, two = ExportState(residual=torch.zeros(500, 600).t()), ExportState(residual=torch.zeros(600, 500))
    for _ in range(2):
        assert torch.equal(
            export_bf16(m.t(), "error-feedback", one, dtype).view(torch.int16),
            export_bf16(m.t().contiguous(), "error-feedback", two, dtype).view(torch.int16),
        )
    assert torch.equal(one.residual.view(torch.int32), two.residual.view(torch.int32))


@pytest.mark.parametrize("dtype", EXPORT_DTYPES, ids=str)
def test_error_feedback_conserves_exactly(dtype):
    torch.manual_seed(4)
    state = ExportState()
    scales = torch.logspace(-8, 2, 64).repeat_interleave(8)  # includes fp16 subnormal magnitudes
    residual_prev = torch.zeros(scales.numel())
    served_sum = torch.zeros(scales.numel(), dtype=torch.float64)
    master_sum = torch.zeros_like(served_sum)
    v_abs_sum = torch.zeros_like(served_sum)
    steps = 12
    for _ in range(steps):
        master = torch.randn(scales.numel()) * scales
        served = export_bf16(master, "error-feedback", state, dtype)
        v = master + residual_prev  # fl32(master + residual), written from the formula
        assert torch.equal(served, v.to(dtype))  # served = RNE(v)
        assert state.residual.dtype == torch.float32
        assert torch.equal(served.float() + state.residual, v)  # conservation, exact (Sterbenz)
        residual_prev = state.residual.clone()
        served_sum += served.double()
        master_sum += master.double()
        v_abs_sum += v.double().abs()
    # Telescoping: served_t + r_t = m_t + r_{t-1} + e_t with |e_t| <= 2^-24 |v_t| (one fp32 rounding per step), so
    # |sum served + r_T - sum m| <= 2^-24 sum |v_t|; float64 sums of `steps` terms add <= steps 2^-53 per magnitude.
    gap = (served_sum + residual_prev.double() - master_sum).abs()
    bound = 2.0**-24 * v_abs_sum + steps * 2.0**-52 * (served_sum.abs() + master_sum.abs() + v_abs_sum)
    assert bool((gap <= bound).all())


def test_error_feedback_dithers_a_constant_master():
    # Sigma-delta: for a constant master between two bf16 values, the served copy alternates between them so that
    # its running sum tracks steps * x: |sum_t s_t - T x| = |r_T - sum_t e_t| <= |r_T| + T 2^-24 max|v|.
    x = torch.tensor([1.0 + 0.3 * 2.0**-7, -2.0 - 0.75 * 2.0**-6])
    state, served = ExportState(), []
    steps = 40
    for _ in range(steps):
        served.append(export_bf16(x, "error-feedback", state).double())
    served = torch.stack(served)
    a, b, _ = neighbours(x, torch.bfloat16)
    assert bool(((served == a) | (served == b)).all()) and bool((served.min(0).values < served.max(0).values).all())
    err = (served.sum(0) - steps * x.double()).abs()
    assert bool((err <= state.residual.double().abs() + steps * 2.0**-24 * 4.0).all())


def test_error_feedback_non_finite_and_overflow_reset_the_residual():
    state = ExportState()
    x = torch.tensor([float("inf"), float("nan"), 3.4e38, 1.0 + 2.0**-9])  # 3.4e38 rounds past bf16's top
    served = export_bf16(x, "error-feedback", state)
    assert served[0] == float("inf") and served[1].isnan() and served[2] == float("inf")
    assert torch.equal(state.residual, torch.tensor([0.0, 0.0, 0.0, 2.0**-9]))
    served = export_bf16(torch.ones(4), "error-feedback", state)  # finite again: no NaN carried over
    assert bool(torch.isfinite(served).all()) and bool(torch.isfinite(state.residual).all())


# -- Exporter ---------------------------------------------------------------------------------------------------------


def _masters(steps: int, seed: int = 5) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    base = {"model.embed_tokens.weight": torch.randn(64, 16, generator=g), "model.norm.weight": torch.ones(16),
            "lm_head.weight": torch.randn(64, 16, generator=g) * 0.02}  # fmt: skip
    return [{n: t + k * 1e-4 * torch.randn(t.shape, generator=g) for n, t in base.items()} for k in range(steps)]


def _bits(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.view(torch.int16) for n, t in sd.items()}


def _same(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> bool:
    return x.keys() == y.keys() and all(torch.equal(_bits(x)[n], _bits(y)[n]) for n in x)


@pytest.mark.parametrize("dtype", EXPORT_DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_exporter_state_dict_round_trip_continues_bitwise(mode, dtype):
    masters = _masters(5)
    exporter = Exporter(mode, seed=7, dtype=dtype)
    for m in masters[:3]:
        exporter.export(m)
    buffer = io.BytesIO()
    torch.save(exporter.state_dict(), buffer)  # through a real checkpoint file format
    in_memory = exporter.state_dict()  # kept as is while the exporter moves on: must be a copy, not a view
    tail = [exporter.export(m) for m in masters[3:]]
    buffer.seek(0)
    for state in (torch.load(buffer, weights_only=True), in_memory):
        resumed = Exporter(mode, seed=7, dtype=dtype)
        resumed.load_state_dict(state)
        assert all(_same(x, resumed.export(m)) for x, m in zip(tail, masters[3:], strict=True))
        assert resumed.steps == exporter.steps == 5


def test_exporter_same_seed_same_bits_any_dict_order():
    masters = _masters(3)
    one, two, other = Exporter("stochastic", seed=1), Exporter("stochastic", seed=1), Exporter("stochastic", seed=2)
    for m in masters:
        reversed_m = dict(reversed(list(m.items())))
        x, y, z = one.export(m), two.export(reversed_m), other.export(m)
        assert _same(x, {n: y[n] for n in x})
        assert not _same(x, z)


def test_exporter_does_not_depend_on_pythonhashseed():
    # Per-tensor seeds come from hashlib, so another PYTHONHASHSEED must give the same bits.
    script = (
        "import hashlib, torch\n"
        "from roundalign.sync import Exporter\n"
        "g = torch.Generator().manual_seed(0)\n"
        "m = {n: torch.randn(32, generator=g) for n in ('a.weight', 'b.weight', 'c.bias')}\n"
        "out = Exporter('stochastic', seed=3).export(m)\n"
        "print(hashlib.sha256(b''.join(out[n].view(torch.int16).numpy().tobytes() for n in sorted(out))).hexdigest())\n"
    )
    other = "54321" if os.environ.get("PYTHONHASHSEED") == "12345" else "12345"  # not this process's hash seed
    env = {**os.environ, "PYTHONHASHSEED": other}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    here = io.StringIO()
    with contextlib.redirect_stdout(here):
        exec(script, {})
    assert run.stdout.strip() == here.getvalue().strip() != ""


def test_exporter_rejects_a_changed_tensor_set_and_changes_nothing():
    masters = _masters(3)
    exporter, twin = Exporter("error-feedback"), Exporter("error-feedback")
    exporter.export(masters[0]), twin.export(masters[0])
    dropped = {n: t for n, t in masters[1].items() if n != "lm_head.weight"}
    with pytest.raises(ValueError, match="missing lm_head.weight.*error feedback would lose residuals"):
        exporter.export(dropped)
    with pytest.raises(ValueError, match="new extra.*error feedback would lose residuals"):
        exporter.export({**masters[1], "extra": torch.zeros(2)})
    with pytest.raises(ValueError, match="reshaped model.norm.weight"):
        exporter.export({**masters[1], "model.norm.weight": torch.ones(17)})
    with pytest.raises(TypeError, match="pass the fp32 master"):
        exporter.export({**masters[1], "model.norm.weight": torch.ones(16, dtype=torch.bfloat16)})
    assert _same(exporter.export(masters[1]), twin.export(masters[1]))  # the failed calls moved no state


def test_exporter_load_state_dict_checks_its_configuration():
    state = Exporter("stochastic", seed=1).state_dict()
    with pytest.raises(ValueError, match="mode='stochastic'"):
        Exporter("error-feedback", seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=1"):
        Exporter("stochastic", seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="format"):
        Exporter().load_state_dict({})


def test_exporter_loads_format_1_except_a_stochastic_stream():
    # Format 1 (before the counter-based noise) kept Mersenne Twister states: a stochastic stream cannot continue, and
    # says so; error feedback's residuals and RNE's settings did not change and load.
    masters = _masters(3)
    ef = Exporter("error-feedback", seed=1)
    ef.export(masters[0])
    old = {**ef.state_dict(), "format": 1, "generators": {}}
    resumed = Exporter("error-feedback", seed=1)
    resumed.load_state_dict(old)
    assert _same(resumed.export(masters[1]), ef.export(masters[1]))
    stochastic = {**Exporter("stochastic", seed=1).state_dict(), "format": 1, "generators": {}}
    with pytest.raises(ValueError, match="counter-based noise.*start a new Exporter"):
        Exporter("stochastic", seed=1).load_state_dict(stochastic)


# -- bad input --------------------------------------------------------------------------------------------------------


def test_export_bad_input_errors():
    x = torch.randn(4)
    with pytest.raises(ValueError, match="unknown sync mode 'sr'.*rne, stochastic, error-feedback"):
        export_bf16(x, "sr")
    with pytest.raises(TypeError, match="pass the fp32 master"):
        export_bf16(torch.arange(4), "rne")
    with pytest.raises(TypeError, match="low-precision torch.bfloat16.*pass the fp32 master"):
        export_bf16(x.to(torch.bfloat16), "rne")
    with pytest.raises(TypeError, match="pass the fp32 master"):
        export_bf16(x.double(), "rne")
    with pytest.raises(ValueError, match="export dtype must be one of torch.bfloat16, torch.float16"):
        export_bf16(x, "rne", dtype=torch.float32)
    for state in (None, ExportState()):
        with pytest.raises(ValueError, match=r"ExportState\.seeded\(seed\)"):
            export_bf16(x, "stochastic", state)
    for key in (-1, 1 << 64):
        with pytest.raises(ValueError, match=r"key is an int in \[0, 2\*\*64\)"):
            ExportState.seeded(key)
    with pytest.raises(ValueError, match=r"step 1073741824 is outside \[0, 2\*\*30\).*new Exporter"):
        export_bf16(x, "stochastic", ExportState(key=1, step=1 << 30))
    with pytest.raises(ValueError, match=r"reaches element 4294967300 .* covers 4294967296 elements in torch.float16"):
        export_bf16(x, "stochastic", ExportState.seeded(1), torch.float16, offset=1 << 32)
    for offset in (-1, 1.5, True):
        with pytest.raises(ValueError, match="offset must be an int >= 0"):
            export_bf16(x, "stochastic", ExportState.seeded(1), offset=offset)
    with pytest.raises(ValueError, match=r"state=ExportState\(\)"):
        export_bf16(x, "error-feedback")
    with pytest.raises(ValueError, match=r"residual has shape \(5,\) but the master has \(4,\)"):
        export_bf16(x, "error-feedback", ExportState(residual=torch.zeros(5)))
    with pytest.raises(TypeError, match="ExportState or None"):
        export_bf16(x, "stochastic", {"generator": None})
    with pytest.raises(ValueError, match="unknown sync mode"):
        Exporter("nearest")
    with pytest.raises(ValueError, match="export dtype"):
        Exporter(dtype=torch.float8_e4m3fn)
