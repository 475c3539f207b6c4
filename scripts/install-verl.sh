#!/usr/bin/env bash
# Install verl 0.9.1 into the project venv for tests/test_integration_verl.py, without touching torch/transformers.
#
# verl 0.9.1 pins transformers<5.11 (we run 5.24) and pulls wandb, vllm/sglang extras, flash-attn... None of that is
# needed to import and run its FSDP engine on the CPU, so verl goes in with --no-deps and its runtime imports are
# listed here one by one, pinned: ray and tensordict (`import verl` needs both), peft and omegaconf (the engine),
# codetiming, hydra-core and antlr4 4.9 (main_ppo), uvicorn/fastapi/starlette/opentelemetry-api (the checkpoint
# engine package that holds verl's sparse delta sync), and their small pure-Python dependencies. ray is most of the
# size (about 240 MB installed of about 285 MB).
#
# Usage: scripts/install-verl.sh [python]      (default: .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-.venv/bin/python}"

before=$("$PY" -c 'import torch, transformers; print(torch.__version__, transformers.__version__)')
"$PY" -m pip install --disable-pip-version-check --quiet --no-deps \
  verl==0.9.1 ray==2.60.0 tensordict==0.10.0 peft==0.21.2 \
  omegaconf==2.3.0 hydra-core==1.3.8 antlr4-python3-runtime==4.9.3 codetiming==1.4.0 \
  uvicorn==0.54.0 fastapi==0.165.0 starlette==1.10.0 opentelemetry-api==1.45.2 annotated-doc==0.0.7 \
  msgpack==1.2.4 cloudpickle==3.1.3 orjson==3.13.0 pyvers==0.2.3 \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0 \
  requests==2.34.2 urllib3==2.8.0 idna==3.20 charset-normalizer==3.5.3 certifi==2026.10.19.post1
after=$("$PY" -c 'import torch, transformers; print(torch.__version__, transformers.__version__)')
if [[ "$before" != "$after" ]]; then
  echo "install-verl.sh: torch/transformers changed ($before -> $after)" >&2
  exit 1
fi
# The parts the tests use: the FSDP engine, the delta sync, main_ppo (hydra), Ray.
"$PY" -W ignore -c '
import verl, verl.workers.engine.fsdp.transformer_impl, verl.checkpoint_engine.delta_sync.sparse_gather
import verl.trainer.main_ppo, ray
print("verl", verl.__version__, "ray", ray.__version__, "importable")' 2>&1 | tail -1
