"""Build, cache and call Fair Cast's CPU kernels (``_native.c``): one pass per export instead of a handful.

A bf16 stochastic or error-feedback export in torch ops is several element-wise passes, and drawing the noise is
slower still; the C kernels do each mode in one pass, at about the cost of the plain cast (docs/sync.md, Cost). They
are compiled once per machine with the C++ compiler Inductor uses (``$CXX``, else g++; the fused ops need it too),
into ``$ROUNDALIGN_CACHE_DIR`` (default ``~/.cache/roundalign``) under a name that hashes the source, the compiler
and the CPU's flags, so an upgrade or another CPU never loads a stale or foreign build. A tensor is split into as many
contiguous ranges as torch has threads; ctypes releases the GIL during each call, so the ranges run in parallel.

Where no compiler works, ``kernels()`` is None and export.py runs the torch formulas (the same bits, slower) after
one RuntimeWarning; ``ROUNDALIGN_SYNC_KERNELS=0`` asks for that path on purpose.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ENV = "ROUNDALIGN_SYNC_KERNELS"
SOURCE = Path(__file__).with_name("_native.c")
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-strict-aliasing", "-shared", "-fPIC", "-x", "c"]
_MIN_SPLIT = 1 << 16  # elements per thread below which a tensor is exported by one call (thread hand-off costs more)

_state: dict = {}  # "lib": the loaded library or None, "why": the reason it is None
_pool: list = []  # [ThreadPoolExecutor, its size, the pid that made it]


def _compiler() -> str:
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return get_cpp_compiler()
    except Exception:  # no Inductor toolchain: a plain C compiler still does
        import shutil

        for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
            if name and shutil.which(name):
                return name
        raise RuntimeError("no C or C++ compiler found (install gcc, or set CXX or CC)") from None


def _cpu_signature() -> str:
    """What a -march=native build depends on: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))][:2]
    except OSError:
        lines = []
    return "\n".join([platform.machine(), platform.processor(), *lines])


def cache_dir() -> Path:
    root = os.environ.get("ROUNDALIGN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "roundalign")
    return Path(root) / "sync-kernels"


def _build() -> ctypes.CDLL:
    compiler = _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    digest = hashlib.sha256(
        b"\0".join([SOURCE.read_bytes(), " ".join(_FLAGS).encode(), version.encode(), _cpu_signature().encode()])
    ).hexdigest()[:16]
    target = cache_dir() / f"libroundalign_sync-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: processes that build at once never load a half-written file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            done = subprocess.run([compiler, *_FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"{compiler} failed on {SOURCE.name}: {done.stderr.strip()[-2000:]}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(target))
    u32, i64, u64, ptr = ctypes.c_uint32, ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p
    lib.roundalign_sr_bf16.argtypes = [ptr, ptr, i64, u64, u32, u32, u32]
    lib.roundalign_sr_bf16.restype = None
    lib.roundalign_ef_bf16.argtypes = [ptr, ptr, ptr, i64, ctypes.c_int]
    lib.roundalign_ef_bf16.restype = None
    lib.roundalign_words.argtypes = [ptr, i64, u64, u32, u32, u32]
    lib.roundalign_words.restype = None
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


def _ranges(n: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` pieces of ``n`` elements, one per torch thread, cut on 4-element blocks."""
    parts = max(1, min(torch.get_num_threads(), n // _MIN_SPLIT))
    step = (-(-n // parts) + 3) // 4 * 4  # ceil(n / parts), rounded up to whole blocks
    return [(s, min(n, s + step)) for s in range(0, n, step)] if n else []


def run(call, n: int) -> None:
    """``call(start, stop)`` for each of ``_ranges(n)``, in parallel threads when there is more than one piece."""
    pieces = _ranges(n)
    if len(pieces) <= 1:
        for a, b in pieces:
            call(a, b)
        return
    # One pool per process and size: a pool inherited through fork() has no threads in the child and would hang.
    if not _pool or _pool[1:] != [len(pieces), os.getpid()]:
        if _pool and _pool[2] == os.getpid():
            _pool[0].shutdown(wait=False)
        _pool[:] = [ThreadPoolExecutor(len(pieces), thread_name_prefix="roundalign-sync"), len(pieces), os.getpid()]
    for _ in _pool[0].map(lambda ab: call(*ab), pieces):  # re-raises a piece's exception here
        pass
