#!/usr/bin/env bash
# `make test-latest`: the suite on the newest releases that pyproject.toml and requirements/*.in admit, in throwaway
# venvs, so that the next incompatible release (as transformers 5.25 was for verl's path) is found by a developer,
# not a user. The locks are compiled afresh into a temporary folder (LOCK_UPGRADE=1 scripts/lock.sh, same inputs, same uv), the three
# venvs .venv-latest, .venv-vllm-latest and .venv-verl-latest are built from them (scripts/install-env.sh), what differs from the
# committed locks is printed, and the suite runs there as `make test` runs it, less tests/test_environment_lock.py
# (these venvs differ from the locks on purpose). Nothing committed changes: when the newest set passes and should be
# adopted, run `LOCK_UPGRADE=1 make lock` and commit (docs/environment.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
WORKERS="${TEST_WORKERS:-2}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

LOCK_OUT="$tmp" LOCK_UPGRADE=1 PYTHON="$PYTHON" scripts/lock.sh  # from nothing: the newest of everything
echo "== newest releases against the committed locks"
for name in trainer vllm verl; do
  "$PYTHON" - "$name" "requirements/$name.lock" "$tmp/$name.lock" <<'PY'
import sys
sys.path.insert(0, "scripts")
from check_lock import read_lock
from pathlib import Path
name, (old, _), (new, _) = sys.argv[1], read_lock(Path(sys.argv[2])), read_lock(Path(sys.argv[3]))
lines = [f"  {p}: {old.get(p, '-')} -> {new.get(p, '-')}" for p in sorted(set(old) | set(new)) if old.get(p) != new.get(p)]
print(f"{name}: {len(lines)} of {len(new)} packages differ from the lock" + (":" if lines else ""))
print("\n".join(lines)) if lines else None
PY
done

rm -rf .venv-latest .venv-vllm-latest .venv-verl-latest
LOCK="$tmp/trainer.lock" PYTHON="$PYTHON" scripts/install-env.sh trainer .venv-latest
LOCK="$tmp/vllm.lock" PYTHON="$PYTHON" scripts/install-env.sh vllm .venv-vllm-latest
LOCK="$tmp/verl.lock" PYTHON="$PYTHON" scripts/install-env.sh verl .venv-verl-latest
workers=()
[[ "$WORKERS" == 0 ]] || workers=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder)
ROUNDALIGN_ENGINE_PYTHON="$PWD/.venv-vllm-latest/bin/python" ROUNDALIGN_VERL_PYTHON="$PWD/.venv-verl-latest/bin/python" \
  OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
  .venv-latest/bin/python -m pytest -q "${workers[@]}" --ignore=tests/test_environment_lock.py
