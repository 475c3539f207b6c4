"""What the CPU's kernels do that the tests must not depend on, and an emulation of the worst of it.

A bf16 GEMM's row may depend on how many rows the call has: on an Intel Xeon with AMX-BF16, oneDNN picks another
kernel, blocking or thread split of the reduction for another row count, while on an AMD EPYC (no bf16 oneDNN path)
torch's own kernel computes every row alike. A test that holds only on one of them checks the CPU, not the code.

- ``gemm_rows_matter()`` makes every 16-bit ``F.linear`` in the process depend on its row count, more than any real
  library does: one row is torch's own kernel, 2 to 15 rows an fp32 GEMM of the exact products rounded once, 16 rows
  and more the reduction split in two halves, each rounded to the 16-bit dtype before they are added. Three
  results by row count, the last one ulp apart from the others on a good share of outputs. A guarantee that holds
  by construction (the same calls for the same sequence) survives it; one that leaned on row-invariant GEMMs fails
  under it on any machine. It reaches HF's ``nn.Linear`` and the engine's
  GEMMs alike, eager or inside a compiled graph's opaque op, because both look ``F.linear`` up at call time.

Whether this machine's own bf16 GEMM rows depend on the row count, ``python benchmarks/_machine.py`` says (CI prints
it first).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

_LINEAR = F.linear


def _row_count_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.numel() // max(x.shape[-1], 1)
    if rows == 1 or x.dtype not in (torch.bfloat16, torch.float16):
        return _LINEAR(x, weight, bias)
    w = weight.float()
    if rows < 16:
        out = _LINEAR(x.float(), w)
    else:
        k = x.shape[-1] // 2
        halves = (_LINEAR(x[..., :k].float(), w[:, :k]), _LINEAR(x[..., k:].float(), w[:, k:]))
        out = sum(h.to(x.dtype).float() for h in halves)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@contextlib.contextmanager
def gemm_rows_matter():
    """Inside the block, a 16-bit ``F.linear``'s rows depend on the call's row count (module docstring)."""
    F.linear = _row_count_linear
    try:
        yield
    finally:
        F.linear = _LINEAR
