"""Autocast off around the engine kernels, for the attention and the GEMM alike.

The engine computes on the 16-bit tensors it holds and never autocasts, so its kernels here must not either: a
trainer's autocast would otherwise recast what they compute.
"""

from __future__ import annotations

import torch


def no_autocast(t: torch.Tensor):
    """The engine kernels run on the 16-bit tensors they are given, with no autocast: under TRL's ``bf16=True`` (CPU
    autocast) the reference kernels' fp32 arithmetic (attention's softmax and products over the fp32 KV cache) would
    otherwise be cast down to bf16, which the engine never does."""
    return torch.autocast(t.device.type, enabled=False)
