"""Build, cache and call Fair Cast's CPU kernels (``_native.c``): one pass per export instead of a handful.

A stochastic or error-feedback export in torch ops is several element-wise passes, and computing the noise is
slower still; the C kernels do each mode in one pass, at about the cost of the plain cast (docs/sync.md, Cost). They
are compiled once per machine (``roundalign.native``; cached in ``$ROUNDALIGN_CACHE_DIR/sync-kernels``). A whole
state_dict is cut into as many contiguous runs of work as torch has threads (``run_many``) and handed to one C call,
which runs them on torch's own OpenMP threads (where torch ships libgomp; elsewhere, one call per run from a Python
thread pool, ctypes releasing the GIL). An export larger than the cache (``STREAM_BYTES``) writes its served copy
with streaming stores, which skip reading each output line from memory before filling it.

Where no compiler works, ``kernels()`` is None and export.py runs the torch formulas (the same bits, slower) after
one RuntimeWarning; ``ROUNDALIGN_SYNC_KERNELS=0`` asks for that path on purpose.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from roundalign import native

ENV = "ROUNDALIGN_SYNC_KERNELS"
SOURCE = Path(__file__).with_name("_native.c")
_FLAGS = native.FLAGS
_MIN_SPLIT = 1 << 16  # elements per thread below which one call does all the work (a thread hand-off costs more)
# Served bytes from which an export streams its output past the cache: beyond any L3 it will not be read from there
# (and a cache-resident output, a small model's, is cheaper left in it for whoever reads it next).
STREAM_BYTES = 1 << 27

_state: dict = {}  # "lib": the loaded library or None, "why": the reason it is None
_pool: list = []  # [ThreadPoolExecutor, its size, the pid that made it]


def _build() -> ctypes.CDLL:
    openmp, gomp = native.openmp()
    lib = native.build(SOURCE, "sync-kernels", "libroundalign_sync", [*_FLAGS, *openmp], gomp)
    u32, i64, u64, ptr = ctypes.c_uint32, ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p
    lib.roundalign_sr_bf16.argtypes = [ptr, ptr, i64, u64, u32, u32, u32]  # one tensor: what the tests call
    lib.roundalign_sr_bf16.restype = None
    lib.roundalign_words.argtypes = [ptr, i64, u64, u32, u32, u32]  # grid.py's uniform words
    lib.roundalign_words.restype = None
    lib.roundalign_sync_threads.argtypes, lib.roundalign_sync_threads.restype = [], ctypes.c_int
    for kind in _ITEMS:
        getattr(lib, f"roundalign_{kind}_runs").argtypes = [i64, ptr, ptr, i64]
        getattr(lib, f"roundalign_{kind}_runs").restype = None
    return lib


def kernels() -> ctypes.CDLL | None:
    """The compiled kernels, or None (with one RuntimeWarning saying why) where they cannot be built or are off."""
    if "lib" not in _state:
        if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
            _state.update(lib=None, why=f"${ENV}=0")
        else:
            try:
                _state.update(lib=_build(), why=None)
            except Exception as exc:  # no compiler, a failed build, an unloadable library
                _state.update(lib=None, why=str(exc))
                warnings.warn(
                    f"roundalign.sync: the compiled export kernels are unavailable ({exc}); stochastic and "
                    "error-feedback exports run the torch formulas instead (the same bits, several times slower). "
                    f"Install a C compiler (gcc) to get them, or set {ENV}=0 to silence this.",
                    RuntimeWarning,
                    stacklevel=3,
                )
    return _state["lib"]


# Work item columns: where the element count is and which columns move when an item is cut (pointer, element size).
_ITEMS = {
    "sr_bf16": {"n": 2, "pointers": ((0, 4), (1, 2)), "first": 3},
    "ef_bf16": {"n": 3, "pointers": ((0, 4), (1, 4), (2, 2)), "first": None},
}
_ITEMS["sr_fp16"], _ITEMS["ef_fp16"] = _ITEMS["sr_bf16"], _ITEMS["ef_bf16"]  # the same columns, 2-byte outputs


def run_many(kind: str, items: list[tuple[int, ...]]) -> None:
    """Run ``roundalign_<kind>_runs`` over work items (one per tensor), balanced over torch's threads.

    Items larger than a thread's share are cut into pieces on 32-element boundaries (the bf16 noise layout's groups),
    each piece's pointers and first element moved along; then each thread takes a contiguous run of pieces. A whole
    state_dict costs one C call (one per thread without OpenMP), not one per tensor.
    """
    spec = _ITEMS[kind]
    if not items:
        return
    total = sum(item[spec["n"]] for item in items)
    parts = max(1, min(torch.get_num_threads(), total // _MIN_SPLIT))
    share = (-(-total // parts) + 31) // 32 * 32
    pieces = []
    for item in items:
        n, done = item[spec["n"]], 0
        while done < n:
            take = min(share, n - done)
            piece = list(item)
            for col, size in spec["pointers"]:
                piece[col] += size * done
            piece[spec["n"]] = take
            if spec["first"] is not None:
                piece[spec["first"]] += done
            pieces.append(piece)
            done += take
    runs, current, filled = [], [], 0  # contiguous runs of about `share` elements each
    for piece in pieces:
        current.append(piece)
        filled += piece[spec["n"]]
        if filled >= share:
            runs.append(current)
            current, filled = [], 0
    if current and len(runs) == parts:
        runs[-1] += current  # a remainder smaller than a share: the last thread takes it
    elif current:
        runs.append(current)
    lib = kernels()
    fn = getattr(lib, f"roundalign_{kind}_runs")
    desc = torch.tensor([piece for run in runs for piece in run], dtype=torch.int64)
    starts = torch.tensor([0, *itertools.accumulate(len(run) for run in runs)], dtype=torch.int64)
    stream = int(2 * total >= STREAM_BYTES)  # every served dtype is 2 bytes
    if len(runs) == 1 or lib.roundalign_sync_threads():
        fn(len(runs), starts.data_ptr(), desc.data_ptr(), stream)
    else:
        _in_threads(fn, [(1, starts.data_ptr() + 8 * k, desc.data_ptr(), stream) for k in range(len(runs))])


def _in_threads(fn, calls: list[tuple]) -> None:
    """``fn(*call)`` for every call at once, one pool thread each (ctypes releases the GIL)."""
    if not _pool or _pool[1:] != [len(calls), os.getpid()]:
        if _pool and _pool[2] == os.getpid():
            _pool[0].shutdown(wait=False)
        _pool[:] = [ThreadPoolExecutor(len(calls), thread_name_prefix="roundalign-sync"), len(calls), os.getpid()]
    for _ in _pool[0].map(lambda call: fn(*call), calls):  # re-raises a call's exception here
        pass


def words(key: tuple[int, int], c1: int, first: int, n: int) -> torch.Tensor | None:
    """``noise.threefry2x32``'s first word of blocks ``first .. first + n - 1`` (int64 holding uint32), computed by
    the compiled kernel; None where the kernels are unavailable (the caller computes them in torch)."""
    lib = kernels()
    if lib is None:
        return None
    out = torch.empty(n, dtype=torch.int32)
    if n:
        lib.roundalign_words(out.data_ptr(), n, first, key[0], key[1], c1)
    return out.to(torch.int64) & 0xFFFFFFFF
