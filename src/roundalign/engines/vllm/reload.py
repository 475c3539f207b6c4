"""New weights into a running vLLM that serves a quantized checkpoint, in place, exactly as a fresh load serves them.

vLLM's in-place reload (``reload_weights``: each layer back on the meta device, its checkpoint tensors loaded,
``process_weights_after_loading`` run again, and the processed tensors copied into the first load's storage)
serves W4A16 correctly, but not W8A8 int8 on the CPU: the oneDNN kernel's handle keeps a pointer to the weight
scales it was built with, and the reload then frees that tensor while keeping the old one (the reloaded engine
returned NaN log-probs here, vLLM 0.32 CPU). So ``reload`` runs vLLM's reload for every tensor (embeddings, norms,
the lm_head and biases need it), and then gives each quantized linear a layer built from the new served tensors
by vLLM's own scheme (``kernels.vllm_quant.layer``: the same create/load/process path as a fresh load), which the
layer's ``scheme`` calls from then on. ``tests/test_quant_vllm.py`` checks that a reloaded engine returns exactly
the log-probs of an engine started on the same checkpoint.

Needs the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as roundalign starts it).
"""

from __future__ import annotations

import torch

from roundalign.errors import UserError
from roundalign.kernels import vllm_quant
from roundalign.quant import checkpoint
from roundalign.quant.schemes import Scheme


class _Served:
    """A quantized linear's ``scheme`` after a reload: vLLM's scheme object over the layer built for the new
    weights (``apply_weights`` is what vLLM's ``CompressedTensorsLinearMethod.apply`` calls)."""

    def __init__(self, original, method, layer):
        self.original = original  # vLLM's own scheme object: its reload processes the checkpoint tensors again
        self.method, self.layer = method, layer

    def apply_weights(self, layer, x, bias=None):
        return self.method.apply_weights(self.layer, x, self.layer.bias)


def runner_model(llm):
    """The ``nn.Module`` vLLM's model runner serves (the engine core must run in this process)."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    executor = getattr(core, "model_executor", None)
    worker = getattr(getattr(executor, "driver_worker", None), "worker", None)
    model = getattr(getattr(worker, "model_runner", None), "model", None)
    if model is None:
        raise UserError(
            "reloading a quantized vLLM needs its engine core in this process; start it with "
            "VLLM_ENABLE_V1_MULTIPROCESSING=0 (roundalign's engines do)"
        )
    return model


def refresh_lm_head(llm) -> None:
    """Prepare the lm_head's CPU GEMM again from the weight it now holds.

    vLLM's CPU build prepares the lm_head's GEMM once, at load (``dispatch_cpu_unquantized_gemm``: a oneDNN handle
    or a packed copy of the weight). A tied lm_head (``tie_word_embeddings``) has no checkpoint tensor of its own:
    the in-place reload updates the embedding it shares, but runs no post-load processing for the lm_head, which
    kept computing the logits with the first load's weights (measured: the exact trainer lost bit equality from the
    first weight sync on, on a tied Llama). Re-preparing it after every reload costs one packing of one matrix."""
    lm_head = getattr(runner_model(llm), "lm_head", None)
    if lm_head is None or not hasattr(lm_head, "cpu_linear"):
        return  # not a CPU build's lm_head (or a model without one): nothing was prepared
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)


def reload_weights(llm, weights: list[tuple[str, torch.Tensor]]) -> None:
    """vLLM's in-place reload of ``weights`` (each layer's post-load processing redone), the tied lm_head's GEMM
    prepared again (``refresh_lm_head``), and the prefix cache reset, so no KV block of the old weights is reused."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    refresh_lm_head(llm)
    llm.reset_prefix_cache()


def reload(llm, state_dict: dict[str, torch.Tensor], scheme: Scheme) -> None:
    """Serve ``state_dict`` (HF-named, the trainer's weights) quantized in ``scheme`` from the next request on; or,
    given the checkpoint's tensors themselves (``roundalign.sync.Exporter(..., scheme=)``: codes an export chose
    by stochastic rounding or error feedback), exactly those."""
    if scheme.online:
        # vLLM quantizes what it loads (its online method's post-load processing, re-run by its reload), from the
        # bf16 weights: tests/test_quant_vllm.py checks that it serves what a fresh engine serves.
        served = checkpoint.served_state_dict(state_dict, scheme)  # the bf16 copy
        reload_weights(llm, list(served.items()))
        return
    if checkpoint.is_checkpoint(state_dict):
        served, linears = state_dict, checkpoint.split(state_dict, scheme)[0]
    else:
        linears, rest = checkpoint.quantize_state_dict(state_dict, scheme)
        served = checkpoint.served_state_dict(state_dict, scheme, (linears, rest))
    model = runner_model(llm)
    for module in model.modules():  # vLLM's reload runs its own schemes' post-load processing
        if isinstance(getattr(module, "scheme", None), _Served):
            module.scheme = module.scheme.original
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(served.items())})
    fused = dict(getattr(type(model), "packed_modules_mapping", {}) or {})
    covered = set()
    for name, module in model.named_modules():
        if getattr(module, "scheme", None) is None:
            continue
        prefix, _, leaf = name.rpartition(".")
        parts = [f"{prefix}.{p}" for p in fused.get(leaf, [leaf])]
        missing = [p for p in parts if p not in linears]
        if missing:
            raise UserError(f"reload: the engine's {name} needs {', '.join(missing)}, which the state dict lacks")
        bias = getattr(module, "bias", None)
        module.scheme = _Served(module.scheme, *vllm_quant.layer(scheme, [linears[p] for p in parts], bias))
        covered.update(parts)
    if covered != set(linears):  # a served weight no engine layer took: the engine would serve a stale one
        left = sorted(set(linears) - covered)
        raise UserError(f"reload: no quantized layer of the engine serves {', '.join(left[:3])}; is it this model?")
    refresh_lm_head(llm)
    llm.reset_prefix_cache()


__all__ = ["refresh_lm_head", "reload", "reload_weights", "runner_model"]
