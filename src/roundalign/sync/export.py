"""Export an fp32 master to the rollout engine's bf16 (or fp16) copy: RNE, stochastic rounding, error feedback.

An RL trainer keeps fp32 master weights and serves a low-precision copy to its rollout engine every step. The usual
export, ``master.to(torch.bfloat16)``, rounds to nearest even (RNE): an update smaller than half a bf16 ulp of the
weight (``|dw| < |w|/256`` roughly) never reaches the served copy until enough of them pile up in the master, so the
engine samples from a policy that lags the trainer. Fair Cast (Gao & Gao) exports without that bias:

- ``"rne"``: ``served = r(master)``, the plain cast, as every framework does today.
- ``"stochastic"``: unbiased stochastic rounding (SR). For ``a < x < b`` adjacent in the target dtype, ``served = b``
  with probability ``(x - a) / (b - a)`` exactly, else ``a``; so ``E[served] = x`` and every update reaches the
  engine in expectation. The noise is a counter-based stream per tensor (``noise.py``): a function of the tensor's
  key, its export count and each element's index.
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

Cost (docs/sync.md, Cost, has the figures). On the CPU every SR and EF export is one pass over the weights in
compiled kernels (``_native.c``, built at first use), SR computing its noise in the same pass, and ``Exporter``
hands a whole state_dict to them in one call, run on torch's threads; both cost about what the plain cast does
where the served copy is written into fresh memory, as a large tensor's is.
Elsewhere (GPU masters, a machine without a C compiler) the same arithmetic runs as element-wise torch passes, chunk
by chunk on the CPU (``_CHUNK`` elements) so that every pass after the first reads from cache. Neither chunking nor
threads change a bit: every element's result depends only on its own value, its own noise and (EF) its own residual.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from roundalign.numerics.dtypes import LOW_PRECISION
from roundalign.sync import _native, noise

MODES = ("rne", "stochastic", "error-feedback")
EXPORT_DTYPES = LOW_PRECISION  # what a served copy can be

_STATE_FORMAT = 2  # bump when Exporter.state_dict() changes shape (2: counter-based noise, no generator states)


@dataclass
class ExportState:
    """The per-tensor state of one exported tensor (what its next export depends on besides the master)."""

    key: int | None = None  # stochastic: this tensor's 64-bit noise key (noise.py); ExportState.seeded(seed) sets it
    step: int = 0  # stochastic: how many exports drew noise so far (each export draws a fresh stream)
    residual: torch.Tensor | None = None  # error-feedback: fp32, the master's part not yet served (updated in place)

    @classmethod
    def seeded(cls, seed: int) -> ExportState:
        """A stochastic state with noise key ``seed`` (an int in [0, 2**64)), at step 0."""
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        noise.split_key(seed)  # range check, with the error that names it
        return cls(key=seed)


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


_CHUNK = 1 << 17  # elements per pass of the torch formulas on the CPU: a chunk's buffers (512 KiB each) stay in cache
_FORMULA_CHUNK = 1 << 16  # elements per round of the torch Threefry on the CPU (int64 temporaries stay in cache)


def _chunk(numel: int, device: torch.device) -> int:
    """How many elements each pass of a torch formula takes at a time: cache-sized on the CPU, the whole tensor
    elsewhere (a GPU runs each pass as one kernel, where chunking would only add launches)."""
    return max(1, min(numel, _CHUNK if device.type == "cpu" else numel))


def _flat(master: torch.Tensor) -> torch.Tensor:
    return master.reshape(-1)  # a view for a contiguous master (the usual case), else one copy


def _native_ok(*tensors: torch.Tensor) -> bool:
    """Whether the compiled CPU kernels take these tensors (CPU, contiguous) and are built here."""
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors) and _native.kernels() is not None


def _kind(sync: str, dtype: torch.dtype) -> str:
    """The compiled kernel (``_native.run_many``'s kind) of a sync mode and served dtype."""
    return ("sr_" if sync == "stochastic" else "ef_") + ("bf16" if dtype == torch.bfloat16 else "fp16")


def _sr_item(flat: torch.Tensor, out: torch.Tensor, state: ExportState, offset: int) -> tuple[int, ...]:
    """An SR kernel's work item: the master's bits, the output, the count, the first index, key words, counter."""
    k0, k1 = noise.split_key(state.key)
    return (flat.data_ptr(), out.data_ptr(), flat.numel(), offset, k0, k1, noise.counter_hi(state.step, 0))


def _ef_item(flat: torch.Tensor, residual: torch.Tensor, out: torch.Tensor, fresh: bool) -> tuple[int, ...]:
    """An EF kernel's work item: the master, the residual (read unless fresh, written), the output, the count."""
    return (flat.data_ptr(), residual.data_ptr(), out.data_ptr(), flat.numel(), int(fresh))


def _check_stream(state: ExportState, dtype: torch.dtype, offset: int, numel: int) -> None:
    """SR's state and range are valid, before anything is drawn: a key, a step and elements the stream covers."""
    noise.split_key(state.key)
    noise.counter_hi(state.step, 3)
    limit = noise.MAX_ELEMENTS["bf16" if dtype == torch.bfloat16 else "fp16"]
    if offset + numel > limit:
        raise ValueError(
            f"stochastic export reaches element {offset + numel} of its tensor; one noise stream covers "
            f"{limit} elements in {dtype}: export a larger tensor as parts under different keys"
        )


def _restore_nan(flat: torch.Tensor, out: torch.Tensor) -> None:
    """NaN masters are served as NaN (a NaN's payload + noise could carry into the exponent): in bf16 as 0xFFFF, the
    bits torch's vectorised CPU cast writes and the compiled kernels write (torch's scalar cast writes 0x7FC0, so
    "as the cast does" would depend on a tensor's length); in fp16 as the cast does (payload kept, both ways)."""
    bad = flat.isnan()
    if bool(bad.any()):
        if out.dtype == torch.bfloat16:
            out.view(torch.int16)[bad] = -1
        else:
            out[bad] = flat[bad].to(out.dtype)


def _stochastic_bf16(master: torch.Tensor, state: ExportState, offset: int) -> torch.Tensor:
    # bf16 is the top 16 bits of fp32. Adding a uniform integer in [0, 2^16) to the low 16 bits carries into bit 16
    # with probability exactly low16 / 2^16 = (|x| - a) / (b - a); truncating then gives b on a carry, a otherwise.
    # fp32 is sign-magnitude, so on the int32 view the same add moves a negative value away from zero, and a carry
    # into the exponent lands on the next binade's first value (or inf past the largest finite), which is right.
    flat = _flat(master)
    out = torch.empty(flat.numel(), dtype=torch.bfloat16, device=master.device)
    if flat.numel() and _native_ok(flat):  # one pass, noise and rounding fused: _native.c
        _native.run_many("sr_bf16", [_sr_item(flat, out, state, offset)])
        return out.reshape(master.shape)
    # The same arithmetic in torch ops, chunk by chunk (no compiler, or a GPU master).
    size = max(1, min(flat.numel(), _FORMULA_CHUNK if master.device.type == "cpu" else 1 << 24))
    pieces = zip(flat.view(torch.int32).split(size), out.view(torch.int16).split(size), strict=True)
    for i, (bits, served) in enumerate(pieces):
        first = offset + i * size
        wide = bits.to(torch.int64) & noise.MASK  # the fp32 bits as an unsigned value
        wide += noise.bf16_noise(state.key, state.step, first, bits.numel(), master.device)  # the rounding point
        served.copy_(((wide >> 16) & 0xFFFF).to(torch.int32).to(torch.int16))  # truncation: the top half
    _restore_nan(flat, out)
    return out.reshape(master.shape)


_TINY, _SMALL = 0x33800000, 0x37000000  # the fp32 bits of 2^-24 and of 2^-17


def _below(bits: torch.Tensor, limit: int, block: int = 1024) -> torch.Tensor:
    """The indices, in order, of the fp32 values (int32 ``bits``) with ``0 < |x| < limit`` (``limit`` as fp32 bits).

    They are few, and a comparison that writes a bool per element is slow on the CPU (as slow as ten int32 passes),
    so an int32 key's minimum per block of ``block`` elements first finds the blocks that hold one.
    """
    key = (bits - 1).bitwise_and_(0x7FFFFFFF)  # |x| - 1 as an int; +0 and -0 map to the top instead of -1
    whole = key.numel() // block * block
    found = (key[:whole].view(-1, block).amin(1) < limit - 1).nonzero().squeeze(1).tolist()
    pieces = [(key[b * block : (b + 1) * block] < limit - 1).nonzero().squeeze(1) + b * block for b in found]
    pieces.append((key[whole:] < limit - 1).nonzero().squeeze(1) + whole)
    return torch.cat(pieces)


def _fp16_grid(bits: torch.Tensor, words: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """fp16 SR's rounding point on int32 fp32 ``bits``: the low d bits of int32 ``words`` (overwritten) are added
    below fp16's grid point and truncated; the result (fp32, on fp16's grid, so its cast is exact) is ``words``."""
    e = torch.bitwise_right_shift(bits, 23, out=scratch).bitwise_and_(0xFF)  # biased exponent of |x|
    # 2^d = 2^(126 - e) for e in [103, 113] (2^-24 <= |x| < 2^-14), 2^13 above, 2^23 below: 2^23 >> (e - 103).
    top = torch.tensor([1 << 23], dtype=torch.int32, device=bits.device)
    low = torch.bitwise_right_shift(top, e.clamp_(103, 113).sub_(103), out=e).sub_(1)  # the low d bits
    words.bitwise_and_(low).add_(bits)  # uniform in [0, 2^d), added below fp16's grid point
    return words.bitwise_or_(low).bitwise_xor_(low).view(torch.float32)  # truncation: the rounding point


def _fp16_tiny(flat: torch.Tensor, out: torch.Tensor, tiny: torch.Tensor, state: ExportState, offset: int) -> None:
    """Serve the values below 2^-24 (indices ``tiny``) by their exact Bernoulli draws: 0 or 2^-24, sign kept."""
    if not tiny.numel():
        return
    draws = noise.tiny_draws(state.key, state.step, tiny + offset)  # element g's five words (noise.py)
    up = noise.bernoulli_dyadic(flat[tiny].abs() * 16777216.0, draws)  # exact: a power-of-two scale, no overflow
    # The sign back (also -0 for a negative value that rounds to 0); exact on the grid.
    out[tiny] = torch.copysign(torch.where(up, 2.0**-24, 0.0), flat[tiny]).to(torch.float16)


def _stochastic_fp16(master: torch.Tensor, state: ExportState, offset: int) -> torch.Tensor:
    # fp16 keeps 11 significant bits down to 2^-14, then a fixed grid of 2^-24 (subnormals). Work on fp32 bits:
    # drop d low bits by adding uniform noise in [0, 2^d) and truncating, exactly as for bf16 (sign-magnitude again),
    # with d = 13 in fp16's normal range (and above it: 2^16 and up becomes inf in the final cast) and
    # d = 13 + (-14 - e) below it (e = |x|'s binary exponent), which stays <= 23 for |x| >= 2^-24. Below 2^-24 the
    # neighbours are 0 and 2^-24 and p = |x| * 2^24 can have up to ~125 fraction bits: an exact Bernoulli.
    # The draws (noise.py): element g's noise word, whose low d bits are its noise: bf16's 16-bit part, extended by a
    # stream-3 word only below 2^-17 (d > 16); a tiny element g's Bernoulli takes five words of streams 1 to 3. All
    # depend on g alone, so shards export as the whole does.
    flat = _flat(master)
    if not flat.numel():
        return master.to(torch.float16)  # nothing to draw
    out = torch.empty(flat.numel(), dtype=torch.float16, device=master.device)
    if _native_ok(flat):  # one pass, the values below 2^-17 included: _native.c
        _native.run_many("sr_fp16", [_sr_item(flat, out, state, offset)])
        return out.reshape(master.shape)
    size = _chunk(flat.numel(), master.device)
    words = torch.empty(size, dtype=torch.int32, device=master.device)
    scratch = torch.empty(size, dtype=torch.int32, device=master.device)  # exponents, then the low-bit masks
    extremes = []  # per chunk: the least and largest |x| as int32 bits
    for i, (chunk_bits, served) in enumerate(zip(flat.view(torch.int32).split(size), out.split(size), strict=True)):
        n = chunk_bits.numel()
        part = noise.bf16_noise(state.key, state.step, offset + i * size, n, master.device)  # d <= 16 down to 2^-17
        served.copy_(_fp16_grid(chunk_bits, words[:n].copy_(part), scratch[:n]))  # exact; 2^16 and above -> inf
        extremes.append(torch.aminmax(chunk_bits & 0x7FFFFFFF))
    lo, hi = torch.stack([torch.stack(pair) for pair in extremes]).unbind(1)
    bits = flat.view(torch.int32)
    # Below 2^-17 (zeros aside) the noise needs the word's high half: those elements again, with their whole word.
    small = [_below(bits[i * size : (i + 1) * size], _SMALL) + i * size for i in (lo < _SMALL).nonzero()[:, 0].tolist()]
    small = torch.cat(small) if small else torch.zeros(0, dtype=torch.int64, device=master.device)
    if small.numel():
        whole = noise.fp16_words(state.key, state.step, small + offset).to(torch.int32)  # wraps to int32's bits
        out[small] = _fp16_grid(bits[small], whole, torch.empty_like(whole)).to(torch.float16)
    _fp16_tiny(flat, out, small[(bits[small] & 0x7FFFFFFF) < _TINY], state, offset)  # +-0 is not in `small`
    if bool((hi > 0x7F800000).any()):  # a NaN's payload + noise can carry into the exponent or the sign
        _restore_nan(flat, out)
    return out.reshape(master.shape)


def _error_feedback(master: torch.Tensor, state: ExportState, dtype: torch.dtype) -> torch.Tensor:
    residual = state.residual
    fresh = residual is None
    if not fresh:
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
        residual = torch.empty(master.shape, dtype=torch.float32, device=master.device)  # zeros: v = master
    flat, v = _flat(master), residual.view(-1)
    out = torch.empty(flat.numel(), dtype=dtype, device=master.device)
    if flat.numel() and _native_ok(flat):  # one pass: _native.c
        _native.run_many(_kind("error-feedback", dtype), [_ef_item(flat, v, out, fresh)])
        state.residual = residual
        return out.reshape(master.shape)
    size = _chunk(flat.numel(), master.device)
    # The served chunk widened back to fp32 (exact), so that the subtraction is fp32 - fp32: a mixed-dtype operand
    # takes torch's slower casting loop. Not needed where the whole tensor is one piece (a GPU).
    wide = torch.empty(size, dtype=torch.float32) if master.device.type == "cpu" else None
    for m, vc, served in zip(flat.split(size), v.split(size), out.split(size), strict=True):
        if fresh:
            vc.copy_(m)
        else:
            vc.add_(m)  # v = fl32(residual + master) = fl32(master + residual), the law's one rounding
        served.copy_(vc)  # served = r(v), RNE: the rounding point
        # residual = v - served, exact in fp32 (Sterbenz: served is within half a target ulp of v).
        vc.sub_(served if wide is None else wide[: vc.numel()].copy_(served))
        # Where served is not finite (overflow, inf/nan master) no finite residual can carry the difference: restart
        # that weight from zero. The residual is non-finite exactly there (finite - inf = -inf; inf - inf, nan: nan).
        vc.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    if dtype == torch.bfloat16:
        out.view(torch.int16)[out.isnan()] = -1  # NaN as the compiled kernel serves it (_restore_nan says why)
    state.residual = residual
    return out.reshape(master.shape)


def export_bf16(
    master: torch.Tensor,
    sync: str = "rne",
    state: ExportState | None = None,
    dtype: torch.dtype = torch.bfloat16,
    *,
    offset: int = 0,
) -> torch.Tensor:
    """Export an fp32 master tensor as a new ``dtype`` (bf16 or fp16) tensor for the rollout engine.

    ``sync`` (the sync mode, ``--sync`` on the command line): ``"rne"`` (``master.to(dtype)``), ``"stochastic"``
    (unbiased SR; the noise is a function of ``state.key``, ``state.step`` and each element's index, and
    ``state.step`` advances by one per export: make the state with ``ExportState.seeded(seed)`` and keep it across
    steps) or ``"error-feedback"`` (``v = master + state.residual``, ``served = v.to(dtype)``,
    ``state.residual = v - served``; ``ExportState()`` starts from a zero residual). Each tensor needs its own state.

    ``offset`` (stochastic only): where ``master``'s first element sits in the flat order of the tensor it is part of,
    so that a shard (an FSDP rank's slab of rows) is served bitwise as its slice of the whole tensor's export. The
    master may live on any device; on the CPU the compiled kernels run (one pass), elsewhere the same arithmetic in
    torch ops.
    """
    _check_sync(sync)
    _check_dtype(dtype)
    _check_master(master)
    if state is not None and not isinstance(state, ExportState):
        raise TypeError(f"state must be an ExportState or None, got {type(state).__name__}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset must be an int >= 0 (the master's first element in its whole tensor), got {offset!r}")
    if sync == "rne":
        return master.to(dtype)
    if sync == "stochastic":
        if state is None or state.key is None:
            raise ValueError(
                "stochastic export needs a noise key per tensor: pass state=ExportState.seeded(seed) and keep that "
                "state for this tensor across steps"
            )
        _check_stream(state, dtype, offset, master.numel())
        served = (_stochastic_bf16 if dtype == torch.bfloat16 else _stochastic_fp16)(master, state, offset)
        state.step += 1
        return served
    if state is None:
        raise ValueError(
            "error-feedback export keeps a residual per tensor: pass state=ExportState() and keep that state for this "
            "tensor across steps"
        )
    return _error_feedback(master, state, dtype)


def tensor_seed(seed: int, name: str) -> int:
    """The noise key of tensor ``name`` under exporter seed ``seed``: SHA-256, stable across runs and hosts."""
    digest = hashlib.sha256(f"roundalign.sync:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class Exporter:
    """Exports a whole HF-named state_dict each step with one sync mode, keeping one ExportState per tensor name.

    ``Exporter("stochastic", seed=0).export(master)`` returns ``{name: served}``. Stochastic states are seeded from
    ``(seed, name)`` (``tensor_seed``), so the result does not depend on dict order, and the same seed gives bitwise
    the same exports. Every call must carry the same names and shapes as the first: error feedback keeps a residual
    per tensor and would lose it (or apply it to the wrong weights) if a tensor came and went.

    With a quantization ``scheme`` (``"w8a8-int8"``, ...) it returns the checkpoint tensors a quantized engine
    loads: every linear the scheme quantizes exported onto its grid by the same mode (``sync.grid``), the rest in
    bf16. A scheme the engine quantizes itself at load (``fp8-online``) and ``"none"`` export the bf16 copy.
    """

    def __init__(self, sync: str = "rne", seed: int = 0, dtype: torch.dtype = torch.bfloat16, scheme=None) -> None:
        _check_sync(sync)
        _check_dtype(dtype)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        self.sync, self.seed, self.dtype = sync, seed, dtype
        self.scheme = None if scheme is None else _grid_scheme(scheme, dtype)
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
        if self.scheme is not None:
            served = self._export_grid(master)
        else:
            served = self._export_16(master)
        self.steps += 1
        return served

    def _export_16(self, master: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.sync != "rne" and _native_ok(*master.values()):
            return self._export_compiled(master)
        return {name: export_bf16(t, self.sync, self._states[name], self.dtype) for name, t in master.items()}

    def _export_grid(self, master: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A quantized engine's served checkpoint tensors: every linear the scheme quantizes onto its grid by this
        exporter's mode (``sync.grid``), the rest (embeddings, norms, lm_head, biases) as a 16-bit export."""
        from roundalign.quant import checkpoint
        from roundalign.sync import grid

        linears = [n for n, t in master.items() if checkpoint.is_quantized_linear(n, t)]
        for name in linears:  # every check before any state moves
            self.scheme.check_shape(name.removesuffix(".weight"), *master[name].shape)
            if not bool(master[name].isfinite().all()):
                raise ValueError(
                    f"master[{name!r}] has non-finite values: a quantized engine's scales cannot hold them; find "
                    "where the training diverged (a checkpoint before it) before exporting"
                )
        served = self._export_16({n: t for n, t in master.items() if n not in set(linears)})
        for name in linears:
            q = grid.export_linear(master[name], self.scheme, self.sync, self._states[name])
            served.update(checkpoint.tensors(name.removesuffix(".weight"), q, self.scheme))
        return served

    def _export_compiled(self, master: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``export_bf16`` of every tensor, bit for bit, as one compiled call per thread (no per-tensor Python beyond
        allocating the outputs): what makes a small model's export cost about its cast."""
        if self.sync == "stochastic":  # every check before any state moves, as export_bf16 makes them
            for name, t in master.items():
                _check_stream(self._states[name], self.dtype, 0, t.numel())
        served, items = {}, []
        for name, t in master.items():
            state, out = self._states[name], torch.empty(t.shape, dtype=self.dtype)
            served[name] = out
            if not t.numel():  # an empty tensor: nothing for the kernels to do
                continue
            if self.sync == "stochastic":
                items.append(_sr_item(t, out, state, 0))
            else:
                fresh = state.residual is None
                if fresh:
                    state.residual = torch.empty(t.shape, dtype=torch.float32)  # v = master: written by the kernel
                items.append(_ef_item(t, state.residual, out, fresh))
        _native.run_many(_kind(self.sync, self.dtype), items)
        if self.sync == "stochastic":
            for name in master:
                self._states[name].step += 1
        return served

    def state_dict(self) -> dict:
        """Everything needed to resume bitwise: settings, shapes, the step and residuals (copies).

        The stochastic noise keys follow from the seed and the names, and every tensor is at step ``steps``.
        """
        residuals = {}
        for name, state in self._states.items():
            if state is not None and state.residual is not None:
                residuals[name] = state.residual.detach().clone()
        shapes = None if self._shapes is None else {name: list(shape) for name, shape in self._shapes.items()}
        return {
            "format": _STATE_FORMAT, "mode": self.sync,  # "mode": the state format's key since format 1
            "seed": self.seed, "dtype": _dtype_name(self.dtype), "scheme": str(self.scheme or "none"),
            "steps": self.steps, "shapes": shapes, "residuals": residuals,
        }  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``'s output; the mode, seed and dtype must be this exporter's."""
        if not isinstance(state, Mapping) or state.get("format") not in (1, _STATE_FORMAT):
            raise ValueError("not an Exporter.state_dict() of this roundalign version (missing or unknown 'format')")
        if state["format"] == 1 and state.get("mode") == "stochastic":
            raise ValueError(
                "this stochastic Exporter state is from a roundalign before the counter-based noise (state format 1: "
                "Mersenne Twister generators) and cannot continue that stream bitwise; start a new Exporter (the "
                "served copy of the next step is then rounded afresh, with the same statistics)"
            )  # format 1 in the other modes holds nothing that changed: settings, shapes and residuals
        mine = {"mode": self.sync, "seed": self.seed, "dtype": _dtype_name(self.dtype)}
        mine["scheme"] = str(self.scheme or "none")
        given = {**state, "scheme": state.get("scheme", "none")}  # a state from before quantized export: bf16
        differ = [f"{k}={given.get(k)!r} (this exporter: {v!r})" for k, v in mine.items() if given.get(k) != v]
        if differ:
            raise ValueError(f"state_dict is from a differently configured Exporter: {', '.join(differ)}")
        shapes = None if state["shapes"] is None else {n: tuple(s) for n, s in state["shapes"].items()}
        steps = int(state["steps"])
        states = {}
        for name, shape in (shapes or {}).items():
            st = self._new_state(name)
            if st is not None and st.key is not None:
                st.step = steps
            if name in state["residuals"]:
                residual = state["residuals"][name]
                if tuple(residual.shape) != shape or residual.dtype != torch.float32:
                    raise ValueError(f"state_dict residual of {name!r} is not an fp32 tensor of shape {shape}")
                st.residual = residual.detach().clone()
            states[name] = st
        self._shapes, self._states, self.steps = shapes, states, steps


def _grid_scheme(scheme, dtype: torch.dtype):
    """The quantization scheme an exporter writes the grid of, or None where the engine is served a 16-bit copy:
    the bf16 engine ('none'), and a scheme the engine quantizes itself at load (fp8-online, an emulated GPU format),
    whose Fair Cast is the 16-bit export of the copy it quantizes."""
    from roundalign.quant.schemes import Scheme

    scheme = Scheme.parse(scheme)
    if not scheme.quantized or scheme.from_bf16:
        return None
    if dtype != torch.bfloat16:
        raise ValueError(f"a quantized engine ({scheme}) serves a bf16 model; export with dtype=torch.bfloat16")
    return scheme


def _few(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
