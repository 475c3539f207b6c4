"""Run ``roundalign dump`` in the engine's own Python, as a subprocess, for ``probe --engine`` and ``calibrate``.

Why a subprocess and not an import: the engine lives in its own environment. vLLM's CPU build pins
``torch==2.13.0+cpu`` and ``transformers<5.20`` while the trainer side (TRL, verl) wants other versions; and even
where one environment would do, vLLM binds the process's OpenMP threads and NUMA memory, keeps its memory until
exit and can abort at exit after its work is done. A dump in a child process leaves the trainer's process as it
was, and is exactly what a user runs by hand on a GPU machine (docs/real-engines.md).

The engine's Python is ``--engine-python``, else ``$ROUNDALIGN_ENGINE_PYTHON``, else this Python if it can import
the engine. The child writes its log to ``DIR/engine.log``; it is judged by what it wrote (vLLM may exit non-zero
after finishing), and a failure raises ``EngineFailed`` with the log's tail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from roundalign.engines.failure import EngineFailed
from roundalign.errors import MissingFile
from roundalign.extras import require_engine

ENV_VAR = "ROUNDALIGN_ENGINE_PYTHON"
LOG_TAIL = 25


def engine_python(engine: str, given: str | None = None) -> str:
    """The Python that runs ``engine``: ``given``, else ``$ROUNDALIGN_ENGINE_PYTHON``, else this one if it can."""
    chosen = given or os.environ.get(ENV_VAR)
    if chosen:
        path = shutil.which(chosen) or chosen
        if not Path(path).is_file():
            where = "--engine-python" if given else f"${ENV_VAR}"
            raise MissingFile(f"{where} {chosen!r} is not a file; give the Python of the engine's environment")
        return path
    require_engine(
        engine,
        f"--engine {engine}",
        f"give the Python of an environment that has it with --engine-python PATH or ${ENV_VAR}; for the CPU "
        "build, `make vllm` in your roundalign clone builds one at .venv-vllm/bin/python (docs/real-engines.md)",
    )
    return sys.executable


def dump_args(cfg) -> list[str]:
    """The ``roundalign dump`` command line of a ``DumpConfig`` (prompts go in a file beside the dump)."""
    args = ["dump", "--engine", cfg.engine, "--model", str(cfg.model), "--out", str(cfg.out)]
    args += ["--num-samples", str(cfg.num_samples), "--max-tokens", str(cfg.max_tokens)]
    args += ["--temperature", repr(cfg.temperature), "--top-p", repr(cfg.top_p), "--seed", str(cfg.seed)]
    args += ["--memory-fraction", repr(cfg.memory_fraction)]
    if cfg.enforce_eager:
        args.append("--enforce-eager")
    if cfg.quantization:
        args += ["--quantization", cfg.quantization]
    if cfg.ignore_eos:
        args.append("--ignore-eos")
    if cfg.max_model_len:
        args += ["--max-model-len", str(cfg.max_model_len)]
    return args


def run_dump(cfg, python: str, prompt_ids: list[list[int]] | None = None) -> float:
    """Run the dump in ``python``; returns its wall time in seconds. ``prompt_ids``: prompts as token ids."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("engine.json", "decode.jsonl", "prefill.jsonl"):
        (out / stale).unlink(missing_ok=True)
    args = dump_args(cfg)
    if prompt_ids is not None:
        prompts = out / "prompts.jsonl"
        prompts.write_text("".join(json.dumps(p) + "\n" for p in prompt_ids))
        args += ["--prompts", str(prompts)]
    log = out / "engine.log"
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run([python, "-m", "roundalign", *args], stdout=f, stderr=subprocess.STDOUT, check=False)
    seconds = time.perf_counter() - t0
    if not (out / "engine.json").is_file():
        tail = log.read_text(errors="replace").splitlines()[-LOG_TAIL:]
        raise EngineFailed(
            f"the {cfg.engine} dump in {python} exited with status {proc.returncode} and wrote no dump; the end "
            f"of its log ({log}):\n" + "\n".join(tail)
        )
    return seconds
