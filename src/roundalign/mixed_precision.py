"""How an aligned model keeps its rounding points when the trainer holds fp32 parameters and computes in bf16.

Production trainers rarely hold a bf16 model. verl keeps the actor in fp32 and computes in bf16 through FSDP2
``MixedPrecisionPolicy(param_dtype=bf16)``; HF Trainer and TRL with ``bf16=True`` keep fp32 parameters and run the
forward under ``torch.autocast(dtype=bf16)``. Both are covered here, so that ``roundalign.apply(model, profile,
allow_non_bf16=True)`` gives the same logits, bit for bit, as the bf16 model with weights ``r(W)``:

- **FSDP2**: parameters are all-gathered in bf16, so every module sees bf16 weights; but with
  ``cast_forward_inputs=True`` (the default, and verl's) FSDP also casts every floating tensor a wrapped module
  *receives* to bf16. Aligned layers hand each other fp32 tensors on purpose (the fp32 residual sum ``S`` under
  fused add+norm rules, fp32 cos/sin under FlashInfer-style profiles), so those travel in a ``Carry``: FSDP's cast
  (``torch.distributed.utils._apply_to_tensors``) opens tensors, dicts, lists, tuples and dataclasses, not this.
- **Autocast**: linears, matmuls and SDPA run in bf16, everything else follows the module code with fp32 weights,
  so stock HF keeps an fp32 residual stream and fp32 norms. An aligned model instead rounds where a bf16 engine
  does: ``low_dtype`` is autocast's dtype, the embedding output is rounded where it enters the first layer, and
  norm weights are rounded (``engine_weight``) before use. docs/mixed-precision.md lists every tensor.
"""

from __future__ import annotations

import torch

from roundalign.numerics.dtypes import LOW_PRECISION


class Carry:
    """Tensors passed between aligned modules that FSDP's forward-input cast must not round (``S``, cos/sin).

    Not a tensor, tuple or dataclass, so ``cast_forward_inputs`` leaves it alone; autograd and non-reentrant
    activation checkpointing see the tensors inside like any others.
    """

    __slots__ = ("tensors",)

    def __init__(self, *tensors: torch.Tensor):
        self.tensors = tensors

    def __iter__(self):  # `cos, sin = position_embeddings` unpacks it like the tuple HF passes
        return iter(self.tensors)

    def __repr__(self) -> str:
        return "Carry(" + ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in self.tensors) + ")"


def low_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The 16-bit dtype this forward rounds to: autocast's when it is on, else that of the first 16-bit tensor.

    With no 16-bit tensor and autocast off, the forward computes in fp32, where no engine rounding point exists
    (the matmuls would not round at all): that is an error rather than a silent hybrid of fp32 matmuls and bf16
    roundings. float64 passes through, for gradcheck with rounding off.
    """
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    for t in tensors:
        if t.dtype in LOW_PRECISION or t.dtype == torch.float64:
            return t.dtype
    raise TypeError(
        f"roundalign: the aligned model computes in {tensors[0].dtype} with autocast off, where no engine rounding "
        "point exists. Compute in bf16: load or cast the model to bf16, wrap it with FSDP2 "
        "MixedPrecisionPolicy(param_dtype=torch.bfloat16), or run the forward under "
        f"torch.autocast({device!r}, dtype=torch.bfloat16). For an fp32 reference forward, call "
        "roundalign.revert(model) first."
    )


def engine_weight(weight: torch.Tensor, low: torch.dtype) -> torch.Tensor:
    """The engine's 16-bit weight ``r(W)``.

    A no-op for a bf16 model and under FSDP mixed precision (already cast). Under autocast the fp32 parameter is
    rounded here, differentiably, exactly as autocast rounds a linear's weight, so gradients reach the fp32 master.
    """
    return weight if weight.dtype == low else weight.to(low)


__all__ = ["Carry", "engine_weight", "low_dtype"]
