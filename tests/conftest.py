"""Shared pytest setup. Keep this generic: helpers live in tests/helpers.py, references in tests/formulas.py."""

import sys
from pathlib import Path

# Make tests/helpers.py and tests/formulas.py importable whatever pytest's import mode is.
_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


def _inductor_cache_for_this_source() -> None:
    """Point Inductor's on-disk cache at a folder keyed by the ops' source.

    Inductor's FX graph cache key does not cover a custom op's fake kernel, so a graph cached by an older version of
    ``roundalign.ops`` can be reused after the ops change (seen here: stale strides in a backward op). A cache per
    source hash keeps warm runs fast and never mixes versions. An explicit TORCHINDUCTOR_CACHE_DIR wins.
    """
    import hashlib
    import os
    import tempfile

    ops = Path(__file__).resolve().parents[1] / "src" / "roundalign" / "ops"
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(ops.glob("*.py")))).hexdigest()[:12]
    cache = os.path.join(tempfile.gettempdir(), f"roundalign-inductor-{digest}")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache)


_inductor_cache_for_this_source()
