"""Load a script from benchmarks/ as a module, for the tests that smoke-run the benchmark suites.

benchmarks/ is a folder of scripts, not a package: a script imports its siblings (``from _machine import ...``)
the way Python allows when it runs as ``python benchmarks/<script>.py``, with its own folder first on
``sys.path``. Loading one by path from a test needs that folder on ``sys.path`` too.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    """benchmarks/<name>.py as the module ``bench_<name>`` (registered in sys.modules: dataclasses look it up)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
