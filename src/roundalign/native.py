"""Build and cache roundalign's small C kernels (Fair Cast's export, a compiled model's ATen restatements).

Each kernel file is compiled once per machine with the C++ compiler Inductor uses (``$CXX``, else g++; the fused ops
need it too) into ``$ROUNDALIGN_CACHE_DIR`` (default ``~/.cache/roundalign``), under a name that hashes the source,
the flags, the compiler's version and the CPU's flags, so an upgrade or another CPU never loads a stale or foreign
build. Processes that build at once each write beside the target and rename, so none loads a half-written file.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

# -ffp-contract=off: no product is fused into an add (an FMA rounds once where torch's kernels round twice).
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-strict-aliasing", "-shared", "-fPIC", "-x", "c"]


def compiler() -> str:
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return get_cpp_compiler()
    except Exception:  # no Inductor toolchain: a plain C compiler still does
        for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
            if name and shutil.which(name):
                return name
        raise RuntimeError("no C or C++ compiler found (install gcc, or set CXX or CC)") from None


def cpu_signature() -> str:
    """What a -march=native build depends on: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))][:2]
    except OSError:
        lines = []
    return "\n".join([platform.machine(), platform.processor(), *lines])


def cache_root() -> Path:
    return Path(os.environ.get("ROUNDALIGN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "roundalign"))


def openmp() -> tuple[list[str], tuple[str, ...]]:
    """Compiler flags and link arguments for a kernel that runs on torch's own OpenMP threads: ``-fopenmp`` linked
    to the libgomp torch ships and has loaded (the same soname, so one runtime and one thread pool; a second pool
    would spin against torch's workers). ``([], ())`` where torch ships none (the kernel then builds without
    OpenMP, and its ``#pragma omp`` lines are ignored)."""
    import torch

    gomp = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    if not gomp.exists():
        return [], ()
    return ["-fopenmp"], (str(gomp), f"-Wl,-rpath,{gomp.parent}")


def build(source: Path, subdir: str, stem: str, flags: list[str] = FLAGS, libs: tuple[str, ...] = ()) -> ctypes.CDLL:
    """``source`` compiled with ``flags``, linked with ``libs`` (once; cached in ``cache_root() / subdir``), loaded."""
    cc = compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    digest = hashlib.sha256(
        b"\0".join(
            [source.read_bytes(), " ".join([*flags, *libs]).encode(), version.encode(), cpu_signature().encode()]
        )
    ).hexdigest()[:16]
    target = cache_root() / subdir / f"{stem}-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            # "-x none" after the source: libraries named by path are linked, not read as the flags' language
            command = [cc, *flags, str(source), "-x", "none", "-o", tmp, *libs]
            done = subprocess.run(command, capture_output=True, text=True, errors="replace")
            if done.returncode:
                raise RuntimeError(f"{cc} failed on {source.name}: {done.stderr.strip()[-2000:]}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(target))
