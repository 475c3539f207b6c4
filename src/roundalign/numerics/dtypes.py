"""The 16-bit dtypes roundalign rounds to, and the dtype its fp32 arithmetic runs in.

A bf16 model rounds to bf16 at every rounding point; an fp16 one (Precision-RL's fp16 on both sides) to fp16.
Nothing else is a compute dtype here: ``LOW_PRECISION`` is the one list every check reads.
"""

from __future__ import annotations

import torch

# The 16-bit dtypes a model computes in and an engine serves: where r(.) rounds to.
LOW_PRECISION = (torch.bfloat16, torch.float16)
# Their names, as configs and command-line options spell them.
BY_NAME = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs; float64 stays float64 so that gradcheck can run with rounding off."""
    return torch.promote_types(t.dtype, torch.float32)


def default_out_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype ``r(.)`` rounds to when the caller does not say: the model's 16-bit compute dtype.

    That is the dtype of the first of ``tensors`` that is bf16 or fp16 (or float64, which turns rounding off), so an
    fp32 intermediate such as the residual sum ``S`` rounds to the dtype of the other operand: bf16 in a bf16
    model, fp16 in an fp16 one. Only when every tensor is fp32 is there no model dtype to follow; then it is bf16,
    the dtype the profiles were read for.
    """
    for t in tensors:
        if t.dtype in (*LOW_PRECISION, torch.float64):
            return t.dtype
    return torch.bfloat16
