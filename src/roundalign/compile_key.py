"""roundalign's part of torch.compile's cache keys: a hash of the Python that decides what our compiled graphs do.

Inductor's FX graph cache and AOTAutograd's cache (both on disk, ``TORCHINDUCTOR_CACHE_DIR``) key a graph on its
traced code, torch's version and Inductor's config. A graph that calls one of roundalign's ``torch.library`` ops
names the op and no more: its fake kernel, its backward formula, the Inductor lowerings of the rounding primitives
and the partitioner's view of them (``ops/_traced.py``) are Python the key does not see. After an upgrade of
roundalign, a process would load a compiled model's forward and backward, partitioned by the older rules, from the
cache. So every process that registers our ops adds ``SOURCE_KEY``, a hash of those sources, to
``torch.compiler.config.cache_key_tag``, which torch hashes into every compile cache key: a changed source compiles
anew, an unchanged one loads from the cache as before. A tag the user set is kept, ours appended to it.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
_TAG = re.compile(r"roundalign-[0-9a-f]{16}")  # ours: SOURCE_KEY is 16 hex digits


def sources() -> list[Path]:
    """The Python that registers roundalign's ops, their fake kernels, backwards and lowerings, and their formulas."""
    return [
        *sorted((_HERE / "ops").glob("*.py")),
        _HERE / "numerics" / "formulas.py",
        _HERE / "numerics" / "dtypes.py",
        _HERE / "engine" / "attention.py",
        _HERE / "engine" / "gemm.py",
        _HERE / "kernels" / "graph.py",
    ]


def source_key(files) -> str:
    """A short hash of ``files``' names and bytes."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(Path(path).name.encode())
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:16]


SOURCE_KEY = source_key(sources())


def key_compiles() -> None:
    """Put ``roundalign-<SOURCE_KEY>`` into torch.compile's cache key tag (once; cheap to call again).

    Called where our ops are registered and again while a graph that calls them is traced, so a tag the user set
    after importing roundalign still gets ours appended before any cache key of such a graph is computed."""
    config = torch.compiler.config
    ours = f"roundalign-{SOURCE_KEY}"
    tag = config.cache_key_tag
    if ours in tag:
        return
    rest = _TAG.sub("", tag).strip("-")  # another SOURCE_KEY's (a test's), replaced
    config.cache_key_tag = f"{rest}-{ours}" if rest else ours
