"""The machine a benchmark ran on, the same way for every script in benchmarks/: CPU model, threads, versions, date.

Imported by the scripts as ``from _machine import machine_info`` (Python puts a script's own folder first on
``sys.path``); tests that load a script by path put benchmarks/ on ``sys.path`` first.
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


def machine_info() -> dict:
    """CPU model, logical CPUs, torch threads, torch / transformers / Python versions, today's date."""
    return {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
    }
