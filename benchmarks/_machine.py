"""The machine a benchmark ran on, the same way for every script in benchmarks/: CPU model, ISA, threads, versions.

Imported by the scripts as ``from _machine import machine_info`` (Python puts a script's own folder first on
``sys.path``); tests that load a script by path put benchmarks/ on ``sys.path`` first. Run as a script, it prints
the machine in one line (CI's first lines): bf16 GEMMs and some kernels give other bits on an Intel Xeon with
AMX-BF16 than on an AMD EPYC, so every figure and every CI run names the CPU, the ISA flags that matter, the kernels
torch dispatches to (``get_cpu_capability``; ``ATEN_CPU_CAPABILITY`` and ``ONEDNN_MAX_CPU_ISA`` lower them) and the
thread count.
"""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path

import torch
import transformers


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


ISA_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")  # the ones that change bf16 kernels


def isa_flags() -> list[str]:
    """Which of ``ISA_FLAGS`` /proc/cpuinfo lists for the first CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in ISA_FLAGS if f in have]
    except OSError:
        pass
    return []


def gemm_rows_depend_on_row_count(hidden: int = 1024, counts=(1, 2, 3, 5, 8, 16, 17, 64, 100)) -> bool:
    """Whether this CPU's bf16 ``F.linear`` gives a row other bits inside calls of other row counts (random unit-scale
    rows and weights, reduction length ``hidden``): yes on an Intel Xeon with AMX-BF16, no on an AMD EPYC here."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(max(counts), hidden, generator=g).bfloat16()
    w = (torch.randn(hidden, hidden, generator=g) / hidden**0.5).bfloat16()
    with torch.no_grad():
        first = [torch.nn.functional.linear(x[:n], w)[0] for n in counts]
    return not all(torch.equal(first[0], row) for row in first[1:])


def machine_info() -> dict:
    """CPU model, ISA flags, torch's CPU capability, oneDNN bf16, logical CPUs, torch threads, versions, date."""
    return {
        "cpu": cpu_model(),
        "isa": isa_flags(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "gemm_rows_depend_on_row_count": gemm_rows_depend_on_row_count(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
    }


if __name__ == "__main__":
    info = machine_info()
    print(
        f"== machine: {info['cpu']}; ISA {' '.join(info['isa']) or 'none of ' + ' '.join(ISA_FLAGS)}; torch CPU "
        f"capability {info['torch_cpu_capability']}; oneDNN bf16 GEMMs {'yes' if info['onednn_bf16'] else 'no'}; "
        f"bf16 GEMM rows depend on the row count: {'yes' if info['gemm_rows_depend_on_row_count'] else 'no'}; "
        f"{info['logical_cpus']} CPUs, {info['torch_threads']} torch threads; torch {info['torch']}, "
        f"transformers {info['transformers']}, Python {info['python']}"
        + "".join(
            f"; {k}={os.environ[k]}"
            for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS")
            if k in os.environ
        )
    )


def write_json(path: str | None, data: dict) -> None:
    """Write a suite's ``{suite, machine, ...}`` to ``path`` (``--json``), making its folder; no path, no file."""
    if path:
        import json

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1) + "\n")
