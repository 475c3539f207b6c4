"""Shared pytest setup. Keep this generic: helpers live in tests/helpers.py, references in tests/formulas.py."""

import sys
from pathlib import Path

# Make tests/helpers.py and tests/formulas.py importable whatever pytest's import mode is.
_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


def _inductor_cache_for_this_source() -> None:
    """Point Inductor's on-disk cache at a folder keyed by the ops' source, the thread count and the CPU's kernels.

    Inductor's FX graph cache key does not cover a custom op's fake kernel, so a graph cached by an older version of
    ``roundalign.ops`` can be reused after the ops change (seen here: stale strides in a backward op). Nor does it
    cover the thread count: a graph compiled in a 2-thread process and reused under ``OMP_NUM_THREADS=1`` reduced
    in another order than the same graph compiled there (seen here: the inductor backend's hidden-state capture no
    longer matched its plain forward). A cache per (source, threads, CPU capability) keeps warm runs fast and never
    mixes them. An explicit TORCHINDUCTOR_CACHE_DIR wins.
    """
    import hashlib
    import os
    import tempfile

    import torch

    ops = Path(__file__).resolve().parents[1] / "src" / "roundalign" / "ops"
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(ops.glob("*.py")))).hexdigest()[:12]
    where = f"{torch.get_num_threads()}t-{torch.backends.cpu.get_cpu_capability().lower()}"
    cache = os.path.join(tempfile.gettempdir(), f"roundalign-inductor-{digest}-{where}")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache)


_inductor_cache_for_this_source()
