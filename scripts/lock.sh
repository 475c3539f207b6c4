#!/usr/bin/env bash
# Compile requirements/trainer.lock, vllm.lock and verl.lock (`make lock`; `scripts/lock.sh NAME` for one): every package of both venvs, pinned to
# one version with the sha256 of each of its files, resolved by uv from what the project asks for.
#
# Inputs (the only files to edit by hand):
#   trainer.lock  <- pyproject.toml [dev] (every extra and the test tools), requirements/trainer.in (torch's CPU build,
#                    verl 0.9.1 and the imports it does not declare), trainer-overrides.txt, trainer-excludes.txt
#   vllm.lock     <- requirements/vllm.in (vLLM's CPU build, TRL), vllm-excludes.txt
#   verl.lock     <- requirements/verl.in (vLLM's CPU build, verl 0.9.1 and its trainer's imports), verl-overrides.txt,
#                    verl-excludes.txt
# Each file says why it holds what it holds.
#
# Two modes (docs/environment.md says when to use each):
#   `make lock`                  keeps every pin of the committed lock that the inputs still admit (uv reads the
#                                committed lock as its existing output file, and keeps its pins unless told to
#                                upgrade) and resolves only what is new: a dependency added to the inputs comes in at
#                                its newest release, with whatever it needs that the lock lacks, and nothing already
#                                locked moves unless the new inputs exclude its version. Diff the result: only
#                                additions are expected.
#   `LOCK_UPGRADE=1 make lock`   re-resolves from nothing: the newest release each range admits, today (uv --refresh:
#                                not what its cache saw earlier). Refresh deliberately, run `make clean-venv test`,
#                                and commit the locks with the figures they were tested with. scripts/test-latest.sh
#                                compiles this way.
#
# uv is pinned and runs from its own venv (.venv-lock), so two developers compile with the same resolver.
# torch's CPU build (+cpu) is not on PyPI: uv finds it where pip does on this machine (PIP_FIND_LINKS, /opt/wheels),
# or on PyTorch's CPU index elsewhere (TORCH_INDEX).
set -euo pipefail
cd "$(dirname "$0")/.."
UV_VERSION=0.13.9
LOCK_VENV="${LOCK_VENV:-.venv-lock}"
OUT="${LOCK_OUT:-requirements}"
UPGRADE="${LOCK_UPGRADE:-0}"
PYTHON="${PYTHON:-python3}"

if [[ ! -x "$LOCK_VENV/bin/uv" ]] || [[ "$("$LOCK_VENV/bin/uv" --version)" != "uv $UV_VERSION"* ]]; then
  "$PYTHON" -m venv "$LOCK_VENV"
  "$LOCK_VENV/bin/python" -m pip install --disable-pip-version-check --quiet "uv==$UV_VERSION"
fi
UV="$LOCK_VENV/bin/uv"

torch_source=()
for dir in ${PIP_FIND_LINKS:-} /opt/wheels; do
  if compgen -G "$dir/torch-*+cpu-*.whl" >/dev/null; then torch_source=(--find-links "$dir"); break; fi
done
if [[ ${#torch_source[@]} -eq 0 ]]; then
  torch_source=(--extra-index-url "${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" --index-strategy unsafe-best-match)
fi
# The machines this project runs on: CPython 3.11 on x86-64 Linux (glibc 2.28 or newer, as torch's CPU wheel needs).
common=(--python-version 3.11 --python-platform x86_64-manylinux_2_28 --generate-hashes --no-header --quiet --refresh
        "${torch_source[@]}")

compile() {  # name, uv arguments...
  local name=$1; shift
  local tmp
  tmp=$(mktemp)
  # uv keeps the pins of an existing output file (it prefers them, and moves one only when the inputs exclude it);
  # an empty one, or LOCK_UPGRADE=1, takes the newest of everything.
  if [[ "$UPGRADE" != 1 && -f "requirements/$name.lock" ]]; then cp "requirements/$name.lock" "$tmp"; fi
  "$UV" pip compile "${common[@]}" "$@" -o "$tmp"
  {
    echo "# inputs-sha256: $("$PYTHON" scripts/check_lock.py --print-hash "requirements/$name.lock")"
    echo "# The $name venv, exactly: \`make lock\` (scripts/lock.sh) writes this file with uv $UV_VERSION; do not edit it."
    echo "# Install with: pip install --no-deps --require-hashes -r requirements/$name.lock (scripts/install-env.sh)."
    cat "$tmp"
  } >"$OUT/$name.lock"
  rm -f "$tmp"
  echo "$OUT/$name.lock: $(grep -cE '^[a-zA-Z0-9]' "$OUT/$name.lock") packages"
}

# `scripts/lock.sh verl` re-resolves one lock and leaves the others as they are.
for name in "${@:-trainer vllm verl}"; do
  for name in $name; do
    case "$name" in
      trainer) compile trainer pyproject.toml --extra dev requirements/trainer.in \
                 --overrides requirements/trainer-overrides.txt --excludes requirements/trainer-excludes.txt ;;
      vllm) compile vllm requirements/vllm.in --excludes requirements/vllm-excludes.txt ;;
      verl) compile verl requirements/verl.in --overrides requirements/verl-overrides.txt \
              --excludes requirements/verl-excludes.txt ;;
      *) echo "lock.sh: unknown lock '$name' (trainer, vllm, verl)" >&2; exit 2 ;;
    esac
  done
done
