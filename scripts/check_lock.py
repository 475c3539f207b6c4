#!/usr/bin/env python3
"""Compare an environment with a lock file, and a lock file with the inputs it was compiled from. Standard library only.

The project's venvs install from the lock files in requirements/ (``make install``, ``make vllm``), so a newcomer, CI
and a developer run the same versions. Two things can still drift, and this finds both:

- the environment: a package installed by hand, upgraded by another install, or left over from an older lock
  (``python scripts/check_lock.py requirements/trainer.lock``, run with the venv's Python);
- the lock: ``pyproject.toml``'s dependencies or a ``requirements/*.in`` file edited without ``make lock``. The lock's
  first line holds a hash of its inputs, written by ``scripts/lock.sh`` (``--inputs-only`` checks just that).

Exit status 0 when both agree, 1 with one line per difference otherwise. ``--json`` prints the installed set.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import re
import sys
import sysconfig
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQ = ROOT / "requirements"
# Each lock and the files it is compiled from, besides pyproject.toml's [project] table (the trainer lock only).
LOCKS = {
    "trainer": ("trainer.in", "trainer-overrides.txt", "trainer-excludes.txt"),
    "vllm": ("vllm.in", "vllm-excludes.txt"),
    "verl": ("verl.in", "verl-overrides.txt", "verl-excludes.txt"),
}
# Installed by the venv itself or by `pip install -e .`, never by the lock.
NOT_LOCKED = {"pip", "setuptools", "wheel", "roundalign"}
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")
_HASH_LINE = "# inputs-sha256: "


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_name(lock: Path) -> str:
    name = lock.name.removesuffix(".lock")
    if name not in LOCKS:
        raise SystemExit(f"{lock}: not one of the project's locks ({', '.join(f'{n}.lock' for n in LOCKS)})")
    return name


def inputs_hash(name: str) -> str:
    """sha256 over what the lock is compiled from: pyproject's [project] table (trainer) and the requirements files."""
    h = hashlib.sha256()
    if name == "trainer":
        project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        keys = ("requires-python", "dependencies", "optional-dependencies")
        h.update(json.dumps({k: project.get(k) for k in keys}, sort_keys=True).encode())
    for file in LOCKS[name]:
        h.update(file.encode() + b"\0" + (REQ / file).read_bytes() + b"\0")
    return h.hexdigest()


def read_lock(lock: Path) -> tuple[dict[str, str], str | None]:
    """``{canonical name: version}`` and the recorded inputs hash."""
    pins, recorded = {}, None
    for line in lock.read_text().splitlines():
        if line.startswith(_HASH_LINE):
            recorded = line[len(_HASH_LINE) :].strip()
        m = _PIN.match(line)
        if m:
            pins[canonical(m.group(1))] = m.group(2)
    return pins, recorded


def installed() -> dict[str, str]:
    """``{canonical name: version}`` of what is installed in this environment's site-packages.

    Only there: not every ``sys.path`` entry, because setuptools puts its own vendored copies (packaging, zipp,
    importlib-metadata, jaraco.*) on ``sys.path`` once imported, and those are part of setuptools, not installs."""
    dirs = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    return {canonical(d.metadata["Name"]): d.version for d in md.distributions(path=dirs) if d.metadata["Name"]}


def check_inputs(lock: Path) -> list[str]:
    _, recorded = read_lock(lock)
    want = inputs_hash(lock_name(lock))
    if recorded != want:
        return [
            f"{lock.name} is stale: pyproject.toml's dependencies or requirements/{lock_name(lock)}* changed since it "
            "was compiled; run `make lock` and commit the result"
        ]
    return []


def check_environment(lock: Path) -> list[str]:
    pins, _ = read_lock(lock)
    have = installed()
    problems = []
    for name, version in sorted(pins.items()):
        if name not in have:
            problems.append(f"{name}=={version} is locked but not installed")
        elif have[name] != version:
            problems.append(f"{name} is {have[name]}, the lock says {version}")
    for name in sorted(set(have) - set(pins) - NOT_LOCKED):
        problems.append(f"{name}=={have[name]} is installed but not in {lock.name}")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lock", type=Path, help="requirements/trainer.lock, vllm.lock or verl.lock")
    parser.add_argument("--inputs-only", action="store_true", help="check only that the lock matches its inputs")
    parser.add_argument("--print-hash", action="store_true", help="print the inputs hash (scripts/lock.sh)")
    parser.add_argument("--json", action="store_true", help="print this environment's {name: version} and exit")
    args = parser.parse_args(argv)
    if args.json:
        print(json.dumps(installed(), sort_keys=True))
        return 0
    if args.print_hash:
        print(inputs_hash(lock_name(args.lock)))
        return 0
    problems = check_inputs(args.lock)
    if not args.inputs_only:
        problems += check_environment(args.lock)
    for line in problems:
        print(f"{args.lock.name}: {line}", file=sys.stderr)
    if problems and not args.inputs_only:
        print(f"fix: `make clean-venv install vllm` rebuilds the venvs from the locks ({sys.prefix})", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
