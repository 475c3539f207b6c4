"""Whether a running vLLM serves exactly the weights the trainer exported: every layer read back through the engine.

After a weight sync, ``served_mismatches(llm, served, scheme)`` asks the engine's own modules, as its model runner
calls them, what they compute with, and compares with what was exported:

- each linear layer (q/k/v and gate/up fused as vLLM fuses them) applied to the identity ``I`` (bf16, its input
  width) through the module's own quantization method, against vLLM's layer built afresh from the exported tensors
  (``kernels.vllm_quant``, for a quantized engine) or the exported bf16 weight itself (``I @ W^T = W^T`` exactly:
  one product per output): a layer that kept an old weight, a stale packed copy or another layer's scales differs.
  For a quantized layer the identity reads its codes exactly: a code one step off changes its output by at least
  ``1/127`` of it (int8; more for int4 and E4M3), more than a bf16 rounding can hide;
- the lm_head's GEMM applied to the identity through its own prepared weight (vLLM's CPU build packs it at load;
  a tied lm_head's packed copy is not the embedding's tensor);
- every other weight (embeddings, norms, the lm_head) compared as the tensor the engine holds.

Both sides run vLLM's kernels on this CPU, so the comparison is exact on any ISA. It costs one GEMM of an
identity per layer: for a check (``roundalign train --audit-served``, the tests), not for every step of a large
model. Needs the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as roundalign starts it).
"""

from __future__ import annotations

import torch

from roundalign.engines.vllm.reload import runner_model
from roundalign.kernels import vllm_quant
from roundalign.quant import checkpoint
from roundalign.quant.schemes import Scheme


def _exported_linears(served: dict, scheme: Scheme) -> tuple[dict, dict]:
    """``({linear name: Quantized}, {name: tensor})`` of an export: the codes given (a checkpoint's tensors), or the
    weights quantized as the engine quantizes what it loads (none for a bf16 engine: every tensor in the rest)."""
    if not scheme.online and checkpoint.is_checkpoint(served):
        return checkpoint.split(served, scheme)
    return checkpoint.quantize_state_dict(served, scheme)


@torch.no_grad()
def served_mismatches(llm, served: dict[str, torch.Tensor], scheme: Scheme) -> tuple[list[str], int]:
    """``(names the engine does not serve as exported, how many were checked)`` for an export ``served`` (HF-named
    bf16 tensors, or a quantized checkpoint's tensors) in ``scheme``."""
    from vllm.model_executor.layers.linear import LinearBase

    model = runner_model(llm)
    fused = dict(getattr(type(model), "packed_modules_mapping", {}) or {})
    linears, rest = _exported_linears(served, scheme)
    bad, checked, seen = [], 0, set()
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase):
            continue  # the embeddings and the lm_head: compared as tensors below
        method = module.quant_method
        prefix, _, leaf = name.rpartition(".")
        parts = [f"{prefix}.{p}" for p in fused.get(leaf, [leaf])]
        if not all(p in linears or f"{p}.weight" in rest for p in parts):
            bad.append(name)  # a layer of the engine's that the export does not hold
            continue
        biases = [rest.get(f"{p}.bias") for p in parts]
        bias = None if any(b is None for b in biases) else torch.cat(biases)
        eye = torch.eye(module.input_size_per_partition, dtype=torch.bfloat16)
        got = method.apply(module, eye, None if module.skip_bias_add else module.bias)
        if scheme.quantized and parts[0] in linears:
            want = vllm_quant.linear(scheme, [linears[p] for p in parts], bias)(eye)
        else:
            weight = torch.cat([rest[f"{p}.weight"].to(torch.bfloat16) for p in parts])
            want = torch.nn.functional.linear(eye, weight, None if bias is None else bias.to(torch.bfloat16))
        if not torch.equal(got, want):
            bad.append(name)
        checked += 1
        seen.update(f"{p}.{kind}" for p in parts for kind in ("weight", "bias"))
    lm_head = getattr(model, "lm_head", None)
    head = next((n for n in ("lm_head.weight", "model.embed_tokens.weight") if n in rest), None)
    if lm_head is not None and hasattr(lm_head, "cpu_linear") and head is not None:
        # The logits' GEMM, through the lm_head's own prepared weight (a tied lm_head shares the embedding's
        # tensor, but its prepared copy is its own): the identity reads back what it multiplies by.
        weight = rest[head].to(torch.bfloat16)
        eye = torch.eye(weight.shape[1], dtype=torch.bfloat16)
        got = lm_head.quant_method.apply(lm_head, eye)
        rows = min(got.shape[1], weight.shape[0])  # vocab padded to a multiple of 64
        if not torch.equal(got[:, :rows], weight[:rows].T):
            bad.append("lm_head (its prepared GEMM)")
        checked += 1
    params = dict(model.named_parameters())
    for name, tensor in rest.items():
        if name in seen or not name.endswith("weight") or name not in params:
            continue
        param = params[name]
        rows = min(param.shape[0], tensor.shape[0])  # vocab rows padded to a multiple of 64
        if not torch.equal(param[:rows].to(torch.bfloat16), tensor[:rows].to(torch.bfloat16)):
            bad.append(name)
        checked += 1
    return bad, checked


__all__ = ["served_mismatches"]
