"""Export an fp32 master to the rollout engine's bf16 (or fp16) copy: RNE, stochastic rounding, error feedback.

An RL trainer keeps fp32 master weights and serves a low-precision copy to its rollout engine every step. The usual
export, ``master.to(torch.bfloat16)``, rounds to nearest even (RNE): an update smaller than half a bf16 ulp of the
weight (``|dw| < |w|/256`` roughly) never reaches the served copy until enough of them pile up in the master, so the
engine samples from a policy that lags the trainer. Fair Cast (Gao & Gao) exports without that bias:

- ``"rne"``: ``served = r(master)``, the plain cast, as every framework does today.
- ``"stochastic"``: unbiased stochastic rounding (SR). For ``a < x < b`` adjacent in the target dtype, ``served = b``
  with probability ``(x - a) / (b - a)`` exactly, else ``a``; so ``E[served] = x`` and every update reaches the
  engine in expectation. The noise comes from a seeded CPU generator per tensor (``ExportState.generator``).
- ``"error-feedback"`` (EF): ``v = master + residual``, ``served = r(v)``, ``residual = v - served`` (exact in fp32,
  Sterbenz). What one export drops is added back at the next, so the served copy's running sum tracks the master's
  (sigma-delta modulation); deterministic, with one fp32 residual per weight as state.

``r(.)`` is round-to-nearest-even; the rounding points are the explicit ``.to(dtype)`` casts below. SR in bf16 is
the classic bit trick (add 16 random bits below the bf16 mantissa, truncate); fp16, whose grid does not line up
with fp32's exponent for small values, adds random bits below the fp16 grid point by point and draws tiny values
(below fp16's smallest subnormal) with an exact Bernoulli. Non-finite masters pass through as a plain cast does.
Overflow: a finite value above the largest finite of the target rounds up to ``inf`` with the probability it would
round up to the next power of two (``2^128`` for bf16, ``2^16`` for fp16); values at or above that are ``inf``,
as with RNE near the top. Error feedback cannot carry an infinite residual, so where the served value is not finite
its residual is reset to zero.

``Exporter`` applies one sync mode to a whole HF-named state_dict each step, with per-tensor state seeded from
``(seed, name)`` by SHA-256, so exports do not depend on dict order or ``PYTHONHASHSEED``.

Cost (docs/sync.md, Cost, has the figures). Each mode is a handful of in-place element-wise passes; on the CPU they
run chunk by chunk (``_CHUNK`` elements), so that every pass after the first reads from cache, into the output and
a few scratch buffers allocated once per tensor. Chunking changes no bit: every element's result depends only on
its own value and its own noise. What remains beyond the cast is inherent to each mode:

- SR: the noise, one 32-bit Mersenne Twister word per element from the tensor's CPU generator, element k taking the
  k-th word. That stream is part of the contract (``roundalign.integrations.verl`` exports FSDP shards by skipping
  ahead in it by element count), and drawing it is most of SR's time.
- EF: the fp32 residual, read and written once per export, more than doubles the memory traffic of the cast
  (14 bytes per element against 6).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from roundalign.numerics.dtypes import LOW_PRECISION

MODES = ("rne", "stochastic", "error-feedback")
EXPORT_DTYPES = LOW_PRECISION  # what a served copy can be

_STATE_FORMAT = 1  # bump when Exporter.state_dict() changes shape


@dataclass
class ExportState:
    """The per-tensor state of one exported tensor (what its next export depends on besides the master)."""

    generator: torch.Generator | None = None  # stochastic: the seeded CPU generator this tensor's noise comes from
    residual: torch.Tensor | None = None  # error-feedback: fp32, the master's part not yet served (updated in place)

    @classmethod
    def seeded(cls, seed: int) -> ExportState:
        """A state with a CPU generator seeded with ``seed`` (what ``export_bf16(..., "stochastic", state)`` needs)."""
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        generator = torch.Generator(device="cpu")
        generator.manual_seed(seed)
        return cls(generator=generator)


def _check_sync(sync: str) -> None:
    if sync not in MODES:
        raise ValueError(f"unknown sync mode {sync!r}; the modes are: {', '.join(MODES)}")


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in EXPORT_DTYPES:
        names = ", ".join(str(d) for d in EXPORT_DTYPES)
        raise ValueError(f"export dtype must be one of {names}, got {dtype}")


def _check_master(master: torch.Tensor, what: str = "master") -> None:
    if not isinstance(master, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(master).__name__}")
    if master.dtype != torch.float32:
        kind = "a low-precision" if master.dtype in LOW_PRECISION else "a"
        raise TypeError(
            f"{what} is {kind} {master.dtype} tensor; pass the fp32 master (the trainer's float32 weights): exporting "
            "from an already rounded or non-fp32 copy rounds twice or not at all"
        )


_CHUNK = 1 << 17  # elements per pass on the CPU: a chunk's fp32/int32 buffers (512 KiB each) stay in cache


def _chunk(numel: int, device: torch.device) -> int:
    """How many elements each pass takes at a time: cache-sized on the CPU, the whole tensor elsewhere.

    Every mode is a few element-wise passes. Over a whole large tensor each pass would stream it from memory again;
    chunk by chunk (``tensor.split(_chunk(...))``: views, made in one call), the later passes read what the first
    left in cache and the scratch buffers are allocated once. A GPU runs each pass as one kernel, where chunking
    would only add launches.
    """
    return max(1, min(numel, _CHUNK if device.type == "cpu" else numel))


def _all_finite(minmax: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether every chunk whose ``torch.aminmax`` is listed was all finite: one sync for the whole tensor.

    aminmax is one read of a chunk while it is in cache; NaN propagates through min and max, and an inf shows in
    one of them (``isfinite`` would write a mask per element).
    """
    return bool(torch.isfinite(torch.stack([x for pair in minmax for x in pair])).all())


def _flat(master: torch.Tensor) -> torch.Tensor:
    return master.reshape(-1)  # a view for a contiguous master (the usual case), else one copy


def _take_noise(words: torch.Tensor, bits: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """Fill int32 CPU ``words`` with one generator word per element, keep the low ``bits``: uniform in [0, 2^bits).

    ``random_()`` on int32 takes one 32-bit Mersenne Twister word per element, as ``torch.randint(0, 2**bits)`` does
    for ``bits <= 24`` (its value is the word modulo ``2**bits``; randint draws differently from ``2**30`` up), and
    keeps 31 of its bits: the same low ``bits`` from the same stream position, so the noise (and each element's
    place in the stream, which ``roundalign.integrations.verl`` skips ahead by) is randint's, for less (randint pays
    a 64-bit modulo per element: 9 against 5.5 ns an element here). tests/test_sync_export.py pins this. The
    generator's word rate is what stochastic export costs beyond the cast (docs/sync.md, Cost).
    """
    words.random_(generator=generator).bitwise_and_((1 << bits) - 1)
    return words if device.type == "cpu" else words.to(device)  # GPU master: noise crosses to it (untested here)


def _uniform_bits(numel: int, bits: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """``numel`` independent uniform integers in ``[0, 2**bits)`` as int32 (a power-of-two range: exactly uniform)."""
    noise = torch.randint(0, 1 << bits, (numel,), generator=generator, dtype=torch.int32)
    return noise.to(device)


def _restore_non_finite(flat: torch.Tensor, out: torch.Tensor) -> None:
    """Non-finite masters are served as the plain cast serves them (inf + noise stays inf; a NaN's might not)."""
    bad = ~torch.isfinite(flat)
    out[bad] = flat[bad].to(out.dtype)


def _stochastic_bf16(master: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    # bf16 is the top 16 bits of fp32. Adding a uniform integer in [0, 2^16) to the low 16 bits carries into bit 16
    # with probability exactly low16 / 2^16 = (|x| - a) / (b - a); truncating then gives b on a carry, a otherwise.
    # fp32 is sign-magnitude, so on the int32 view the same add moves a negative value away from zero, and a carry
    # into the exponent lands on the next binade's first value (or inf past the largest finite), which is right.
    flat = _flat(master)
    if not flat.numel():
        return master.to(torch.bfloat16)  # nothing to draw
    out = torch.empty(flat.numel(), dtype=torch.bfloat16, device=master.device)
    size = _chunk(flat.numel(), master.device)
    words = torch.empty(size, dtype=torch.int32)  # on the CPU: the generator's side
    minmax = []
    for chunk, bits, served in zip(
        flat.split(size), flat.view(torch.int32).split(size), out.view(torch.int16).split(size), strict=True
    ):
        noise = _take_noise(words[: chunk.numel()], 16, generator, master.device)
        noise.add_(bits)  # the stochastic rounding point: bits + noise, in place on the noise
        served.copy_(noise.bitwise_right_shift_(16))  # truncation: the bf16 is the top half (int32 -> int16)
        minmax.append(torch.aminmax(chunk))
    if not _all_finite(minmax):  # a NaN's payload + noise can carry into the exponent or the sign
        _restore_non_finite(flat, out)
    return out.reshape(master.shape)


def _bernoulli_dyadic(y: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One exact Bernoulli(y) draw per element of fp32 ``y`` in (0, 1), however many bits y's fraction has.

    ``y = M * 2^(E - 24)`` with a 24-bit integer ``M`` (frexp), ``E <= 0``. ``Bernoulli(M / 2^24)`` and
    ``Bernoulli(2^E)`` (``-E`` fair coin flips all coming up 0) are independent, and their AND has probability
    ``y`` exactly. ``-E <= 124`` for fp32 inputs, so four 31-bit words cover the flips.
    """
    mantissa, exponent = torch.frexp(y)
    m = (mantissa * 16777216.0).to(torch.int64)  # exact: mantissa has 24 significant bits
    accept = _uniform_bits(y.numel(), 24, generator, y.device).to(torch.int64) < m
    flips = (-exponent).to(torch.int64)  # zero bits still required
    for _ in range(4):
        take = flips.clamp(max=31)
        word = _uniform_bits(y.numel(), 31, generator, y.device).to(torch.int64)
        accept &= (word >> (31 - take)) == 0  # the top `take` bits of the word are all zero
        flips = flips - take
    return accept


def _tiny(bits: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """The indices, in order, of the fp32 values (int32 ``bits``) with ``0 < |x| < 2^-24``: fp16's tiny range.

    They are few, and a comparison that writes a bool per element is slow on the CPU (as slow as ten int32 passes),
    so an int32 key's minimum per block of ``block`` elements first finds the blocks that hold one.
    """
    key = (bits - 1).bitwise_and_(0x7FFFFFFF)  # |x| - 1 as an int; +0 and -0 map to the top instead of -1
    whole = key.numel() // block * block
    found = (key[:whole].view(-1, block).amin(1) < 0x337FFFFF).nonzero().squeeze(1).tolist()  # 2^-24 = 0x33800000
    pieces = [(key[b * block : (b + 1) * block] < 0x337FFFFF).nonzero().squeeze(1) + b * block for b in found]
    pieces.append((key[whole:] < 0x337FFFFF).nonzero().squeeze(1) + whole)
    return torch.cat(pieces)


def _stochastic_fp16(master: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    # fp16 keeps 11 significant bits down to 2^-14, then a fixed grid of 2^-24 (subnormals). Work on fp32 bits:
    # drop d low bits by adding uniform noise in [0, 2^d) and truncating, exactly as for bf16 (sign-magnitude again),
    # with d = 13 in fp16's normal range (and above it: 2^16 and up becomes inf in the final cast) and
    # d = 13 + (-14 - e) below it (e = |x|'s binary exponent), which stays <= 23 for |x| >= 2^-24. Below 2^-24 the
    # neighbours are 0 and 2^-24 and p = |x| * 2^24 can have up to ~125 fraction bits: an exact Bernoulli.
    # The draws: one word per element, whose low d bits are its noise, then the Bernoulli words of the tiny ones in
    # index order, after the main pass.
    flat = _flat(master)
    if not flat.numel():
        return master.to(torch.float16)  # nothing to draw
    out = torch.empty(flat.numel(), dtype=torch.float16, device=master.device)
    size = _chunk(flat.numel(), master.device)
    words = torch.empty(size, dtype=torch.int32)
    scratch = torch.empty(size, dtype=torch.int32, device=master.device)  # exponents, then the low-bit masks
    top = torch.tensor([1 << 23], dtype=torch.int32, device=master.device)
    exponents = []  # per chunk: the least and largest biased fp32 exponent
    for chunk_bits, served in zip(flat.view(torch.int32).split(size), out.split(size), strict=True):
        n = chunk_bits.numel()
        noise = _take_noise(words[:n], 23, generator, master.device)  # d <= 23 bits of it are used
        e = torch.bitwise_right_shift(chunk_bits, 23, out=scratch[:n]).bitwise_and_(0xFF)  # biased exponent of |x|
        exponents.append(torch.aminmax(e))  # 255: inf/nan; below 103: zero or |x| < 2^-24
        # 2^d = 2^(126 - e) for e in [103, 113] (2^-24 <= |x| < 2^-14), 2^13 above, 2^23 below: 2^23 >> (e - 103).
        low = torch.bitwise_right_shift(top, e.clamp_(103, 113).sub_(103), out=e).sub_(1)  # the low d bits
        noise.bitwise_and_(low).add_(chunk_bits)  # uniform in [0, 2^d), added below fp16's grid point
        rounded = noise.bitwise_or_(low).bitwise_xor_(low).view(torch.float32)  # truncation: the rounding point
        served.copy_(rounded)  # exact on fp16's grid; 2^16 and above -> inf
    lo, hi = torch.stack([torch.stack(pair) for pair in exponents]).unbind(1)
    bits = flat.view(torch.int32)
    tiny = [_tiny(bits[i * size : (i + 1) * size]) + i * size for i in (lo < 103).nonzero().squeeze(1).tolist()]
    tiny = torch.cat(tiny) if tiny else torch.zeros(0, dtype=torch.int64, device=master.device)
    if tiny.numel():
        up = _bernoulli_dyadic(flat[tiny].abs() * 16777216.0, generator)  # exact: a power-of-two scale, no overflow
        # The sign back (also -0 for a negative value that rounds to 0); exact on the grid.
        out[tiny] = torch.copysign(torch.where(up, 2.0**-24, 0.0), flat[tiny]).to(torch.float16)
    if bool((hi == 255).any()):  # a NaN's payload + noise can carry into the exponent or the sign
        _restore_non_finite(flat, out)
    return out.reshape(master.shape)


def _error_feedback(master: torch.Tensor, state: ExportState, dtype: torch.dtype) -> torch.Tensor:
    residual = state.residual
    if residual is not None:
        if not isinstance(residual, torch.Tensor) or residual.dtype != torch.float32:
            raise TypeError("ExportState.residual must be an fp32 tensor (or None to start from zeros)")
        if residual.shape != master.shape:
            raise ValueError(
                f"ExportState.residual has shape {tuple(residual.shape)} but the master has {tuple(master.shape)}; "
                "each tensor needs its own ExportState (a fresh ExportState() starts from a zero residual)"
            )
        if residual.device != master.device:
            raise ValueError(f"ExportState.residual is on {residual.device} but the master is on {master.device}")
        residual = residual.contiguous()  # the state's own buffer, updated in place (a strided one is copied once)
    else:
        residual = torch.empty(
            master.shape, dtype=torch.float32, device=master.device
        )  # zeros: v = master, sign of zero included
    flat, v = _flat(master), residual.view(-1)
    out = torch.empty(flat.numel(), dtype=dtype, device=master.device)
    size = _chunk(flat.numel(), master.device)
    # The served chunk widened back to fp32 (exact), so that the subtraction is fp32 - fp32: a mixed-dtype operand
    # takes torch's slower casting loop. Not needed where the whole tensor is one piece (a GPU).
    wide = torch.empty(size, dtype=torch.float32) if master.device.type == "cpu" else None
    for m, vc, served in zip(flat.split(size), v.split(size), out.split(size), strict=True):
        if state.residual is None:
            vc.copy_(m)
        else:
            vc.add_(m)  # v = fl32(residual + master) = fl32(master + residual), the law's one rounding
        served.copy_(vc)  # served = r(v), RNE: the rounding point
        # residual = v - served, exact in fp32 (Sterbenz: served is within half a target ulp of v).
        vc.sub_(served if wide is None else wide[: vc.numel()].copy_(served))
        # Where served is not finite (overflow, inf/nan master) no finite residual can carry the difference: restart
        # that weight from zero. The residual is non-finite exactly there (finite - inf = -inf; inf - inf, nan: nan).
        vc.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    state.residual = residual
    return out.reshape(master.shape)


def export_bf16(
    master: torch.Tensor,
    sync: str = "rne",
    state: ExportState | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Export an fp32 master tensor as a new ``dtype`` (bf16 or fp16) tensor for the rollout engine.

    ``sync`` (the sync mode, ``--sync`` on the command line): ``"rne"`` (``master.to(dtype)``), ``"stochastic"``
    (unbiased SR with noise from
    ``state.generator``; make the state with ``ExportState.seeded(seed)`` and keep it across steps) or
    ``"error-feedback"`` (``v = master + state.residual``, ``served = v.to(dtype)``, ``state.residual = v - served``;
    ``ExportState()`` starts from a zero residual). Each tensor needs its own state. The master may live on any
    device; SR draws its noise on the CPU generator and moves it there.
    """
    _check_sync(sync)
    _check_dtype(dtype)
    _check_master(master)
    if state is not None and not isinstance(state, ExportState):
        raise TypeError(f"state must be an ExportState or None, got {type(state).__name__}")
    if sync == "rne":
        return master.to(dtype)
    if sync == "stochastic":
        if state is None or state.generator is None:
            raise ValueError(
                "stochastic export needs a seeded generator per tensor: pass state=ExportState.seeded(seed) and keep "
                "that state for this tensor across steps"
            )
        if state.generator.device.type != "cpu":
            raise ValueError(f"ExportState.generator must be a CPU generator, got one on {state.generator.device}")
        if dtype == torch.bfloat16:
            return _stochastic_bf16(master, state.generator)
        return _stochastic_fp16(master, state.generator)
    if state is None:
        raise ValueError(
            "error-feedback export keeps a residual per tensor: pass state=ExportState() and keep that state for this "
            "tensor across steps"
        )
    return _error_feedback(master, state, dtype)


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of tensor ``name`` under exporter seed ``seed``: SHA-256, stable across runs and hosts."""
    digest = hashlib.sha256(f"roundalign.sync:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class Exporter:
    """Exports a whole HF-named state_dict each step with one sync mode, keeping one ExportState per tensor name.

    ``Exporter("stochastic", seed=0).export(master)`` returns ``{name: served}``. Stochastic states are seeded from
    ``(seed, name)`` (``tensor_seed``), so the result does not depend on dict order, and the same seed gives bitwise
    the same exports. Every call must carry the same names and shapes as the first: error feedback keeps a residual
    per tensor and would lose it (or apply it to the wrong weights) if a tensor came and went.
    """

    def __init__(self, sync: str = "rne", seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> None:
        _check_sync(sync)
        _check_dtype(dtype)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        self.sync, self.seed, self.dtype = sync, seed, dtype
        self.steps = 0
        self._shapes: dict[str, tuple[int, ...]] | None = None  # fixed by the first export
        self._states: dict[str, ExportState] = {}

    def _new_state(self, name: str) -> ExportState | None:
        if self.sync == "stochastic":
            return ExportState.seeded(tensor_seed(self.seed, name))
        return ExportState() if self.sync == "error-feedback" else None

    def _check_names(self, master: Mapping[str, torch.Tensor]) -> None:
        if not isinstance(master, Mapping):
            raise TypeError(f"master must be a dict of name -> fp32 tensor, got {type(master).__name__}")
        for name, tensor in master.items():
            if not isinstance(name, str):
                raise TypeError(f"tensor names must be str, got {name!r}")
            _check_master(tensor, f"master[{name!r}]")
        if self._shapes is None:
            return
        missing = sorted(set(self._shapes) - set(master))
        extra = sorted(set(master) - set(self._shapes))
        reshaped = sorted(n for n in master if n in self._shapes and tuple(master[n].shape) != self._shapes[n])
        if missing or extra or reshaped:
            parts = [f"missing {_few(missing)}"] * bool(missing) + [f"new {_few(extra)}"] * bool(extra)
            parts += [f"reshaped {_few(reshaped)}"] * bool(reshaped)
            raise ValueError(
                f"Exporter.export got a different set of tensors than its first call ({'; '.join(parts)}): every "
                "step must export the same names and shapes, or error feedback would lose residuals (and stochastic "
                "noise streams would move to other tensors). Use a new Exporter for a different model."
            )

    def export(self, master: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{name: fp32 master}`` -> ``{name: served tensor in self.dtype}``, in the input's order."""
        self._check_names(master)  # everything is checked before any state moves, so a bad call changes nothing
        if self._shapes is None:
            self._shapes = {name: tuple(t.shape) for name, t in master.items()}
            self._states = {name: self._new_state(name) for name in master}
        served = {name: export_bf16(t, self.sync, self._states[name], self.dtype) for name, t in master.items()}
        self.steps += 1
        return served

    def state_dict(self) -> dict:
        """Everything needed to resume bitwise: settings, shapes, generator states and residuals (copies)."""
        generators, residuals = {}, {}
        for name, state in self._states.items():
            if state is not None and state.generator is not None:
                generators[name] = state.generator.get_state()
            if state is not None and state.residual is not None:
                residuals[name] = state.residual.detach().clone()
        shapes = None if self._shapes is None else {name: list(shape) for name, shape in self._shapes.items()}
        return {
            "format": _STATE_FORMAT, "mode": self.sync,  # "mode": the state format's key since format 1
            "seed": self.seed, "dtype": _dtype_name(self.dtype),
            "steps": self.steps, "shapes": shapes, "generators": generators, "residuals": residuals,
        }  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``'s output; the mode, seed and dtype must be this exporter's."""
        if not isinstance(state, Mapping) or state.get("format") != _STATE_FORMAT:
            raise ValueError("not an Exporter.state_dict() of this roundalign version (missing or unknown 'format')")
        mine = {"mode": self.sync, "seed": self.seed, "dtype": _dtype_name(self.dtype)}
        differ = [f"{k}={state.get(k)!r} (this exporter: {v!r})" for k, v in mine.items() if state.get(k) != v]
        if differ:
            raise ValueError(f"state_dict is from a differently configured Exporter: {', '.join(differ)}")
        shapes = None if state["shapes"] is None else {n: tuple(s) for n, s in state["shapes"].items()}
        states = {}
        for name, shape in (shapes or {}).items():
            st = self._new_state(name)
            if name in state["generators"]:
                st.generator.set_state(state["generators"][name])
            if name in state["residuals"]:
                residual = state["residuals"][name]
                if tuple(residual.shape) != shape or residual.dtype != torch.float32:
                    raise ValueError(f"state_dict residual of {name!r} is not an fp32 tensor of shape {shape}")
                st.residual = residual.detach().clone()
            states[name] = st
        self._shapes, self._states, self.steps = shapes, states, int(state["steps"])


def _few(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
