"""Optional dependencies in one place: which of roundalign's extras brings each, and the check that says so.

The core needs only torch, transformers, numpy and safetensors. The command line's tables and plots, TensorBoard
events and the TRL integration are extras (``pyproject.toml``); a real engine is not an extra at all, because it
lives in its own environment (docs/real-engines.md). Every command that needs one of them asks here, so the
message always names the extra, or for an engine, the environment to run in.
"""

from __future__ import annotations

import importlib.util
import sys

from roundalign.errors import MissingDependency

# import name -> the extra that installs it (pyproject.toml [project.optional-dependencies])
EXTRAS = {
    "rich": "cli",
    "matplotlib": "cli",
    "tensorboard": "tensorboard",
    "trl": "trl",
    "accelerate": "trl",
    "datasets": "trl",
    "reasoning_gym": "gym",
}


def available(module: str) -> bool:
    """Whether ``module`` can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return False


def require(module: str, purpose: str) -> None:
    """``MissingDependency`` naming the extra that brings ``module``, when it is not installed."""
    if not available(module):
        raise MissingDependency(module, EXTRAS[module], purpose)


def require_engine(engine: str, purpose: str, fix: str) -> None:
    """``MissingDependency`` when a real engine is not importable in this Python: ``fix`` says where to run."""
    if not available(engine):
        raise MissingDependency(
            engine, purpose=purpose, install=f"it is not importable in this Python ({sys.executable}); {fix}"
        )


__all__ = ["EXTRAS", "available", "require", "require_engine"]
