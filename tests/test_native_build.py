"""``roundalign.native.build``: a failed build is a clear error whatever bytes the compiler prints, and a library named
by path is linked, not read as C source (the SiLU kernel links torch's own libgomp that way)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from roundalign import native
from roundalign.ops import _aten


def test_a_failed_build_names_the_source_even_when_the_compiler_prints_raw_bytes(monkeypatch, tmp_path):
    monkeypatch.setenv("ROUNDALIGN_CACHE_DIR", str(tmp_path))
    source = tmp_path / "broken.c"
    source.write_bytes(b"\x7fELF\xa0\x92 not C\n")  # gcc quotes these bytes back: not UTF-8
    with pytest.raises(RuntimeError, match="failed on broken.c"):
        native.build(source, "test-build", "libbroken")


def test_the_silu_kernel_shares_torchs_openmp_runtime():
    """One OpenMP runtime in the process: a second libgomp's workers would spin against torch's."""
    gomp = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    assert gomp.exists(), "torch's CPU wheel ships libgomp; without it the kernel runs its ranges in turn"
    lib, _ = _aten._kernel("SiLU backward", _aten._silu_width)
    assert b"libgomp.so.1" in Path(lib._name).read_bytes()  # linked: its thread ranges run in parallel
    loaded = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libgomp" in line}
    assert loaded == {str(gomp)}, loaded
    ctypes.CDLL(str(gomp))  # the same soname: no second copy
