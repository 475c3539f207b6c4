"""The rollout side of verl's weight sync with vLLM's CPU build: the update through vLLM's layer-wise reload, and a
read-back of the weights the engine then serves.

**Why a reload.** verl 0.9.1's vLLM worker extension (``workers/rollout/vllm_rollout/utils.py``,
``vLLMColocateWorkerExtension.update_weights_from_ipc``) loads each received bucket in place with
``model.load_weights`` and, after the last bucket, runs vLLM's ``process_weights_after_loading`` over the model.
vLLM's CPU build has already processed every linear layer once: ``dispatch_cpu_unquantized_gemm``
(``vllm/model_executor/layers/utils.py``) packs the weight for oneDNN or its small-GEMM kernel, keeps the packed
copy in ``layer.cpu_linear`` and replaces ``weight`` with an empty parameter that has no ``weight_loader``. The
first sync therefore fails with ``'Parameter' object has no attribute 'weight_loader'``, and the engine dies.
vLLM's own answer is its layer-wise reload (``vllm/model_executor/model_loader/reload/layerwise.py``):
``initialize_layerwise_reload`` puts each layer back in its checkpoint layout, the loaders then fill it, and each
layer is processed again (packed anew) when its last weight arrives; ``finalize_layerwise_reload`` processes what
is left (attention). verl uses that lifecycle only in its CUDA delta transfer. ``install`` wraps
``update_weights_from_ipc`` so that, where vLLM runs on the CPU and the model is neither LoRA nor quantized, verl's
update runs between those two calls, and verl's final ``process_weights_after_loading`` is the finalize (processing a
layer twice would pack an empty weight).

**The read-back** (``ROUNDALIGN_VERL_AUDIT=DIR``): after each sync every engine process writes, per weight, the
sha256 of what it serves, to ``DIR/engine-<replica>-<sync>.json``; ``audit.py`` writes the trainer's export beside
it and compares. A packed linear's weight cannot be read from its parameter (empty), so it is read through the
engine's own GEMM: ``cpu_linear(I)`` with the identity ``I`` is ``W^T`` exactly (each output is one product
``1 * w`` summed with exact zeros, in fp32, and ``w`` is already a bf16 value). That reads what the engine computes
with, packed copy included; a stale packed copy (a sync that updated the parameter but not the kernel's weight)
would show. The GEMM cannot carry a zero's sign, so digests treat -0 as +0 (``audit.digest``). Fused weights are
split back into the trainer's names with the model's ``packed_modules_mapping`` and the layer's ``output_sizes``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from roundalign.integrations.verl import audit
from roundalign.integrations.verl.imports import after_import

WORKER_MODULE = "verl.workers.rollout.vllm_rollout.utils"
_syncs = {"count": 0}


def install() -> None:
    """Wrap verl's vLLM weight update once ``WORKER_MODULE`` is imported (in the engine's worker process)."""
    after_import(WORKER_MODULE, _patch)


def _patch(module) -> None:
    from roundalign.integrations.seams import check_source

    ext = module.vLLMColocateWorkerExtension
    original = ext.update_weights_from_ipc
    if getattr(original, "_roundalign", False):
        return
    check_source(original, ["receive_weights(", "process_weights_after_loading(model, model_config"],
                 "the weight update and its final processing", "verl")  # fmt: skip

    def update_weights_from_ipc(self, peft_config=None, base_sync_done=False, use_shm=False):
        if not _needs_reload(self, module, peft_config):
            result = original(self, peft_config=peft_config, base_sync_done=base_sync_done, use_shm=use_shm)
        else:
            result = _reloading(self, original, peft_config, base_sync_done, use_shm)
        _syncs["count"] += 1
        if os.environ.get(audit.ENV, "").strip():
            write_served(self.model_runner.model, Path(os.environ[audit.ENV]))
        return result

    update_weights_from_ipc._roundalign = True
    ext.update_weights_from_ipc = update_weights_from_ipc


def _needs_reload(worker, module, peft_config) -> bool:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or peft_config:
        return False
    quantized = module.is_quantized_model(worker.model_runner.vllm_config)
    return not (quantized or worker._is_qat_model or worker._is_modelopt_qat)


def _reloading(worker, original, peft_config, base_sync_done, use_shm):
    import vllm.model_executor.model_loader.utils as loader_utils
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    for model in worker._iter_all_models():
        initialize_layerwise_reload(model)
    process = loader_utils.process_weights_after_loading

    def finalize(model, model_config, target_device):  # verl calls this once per model after the last bucket
        finalize_layerwise_reload(model, model_config)

    update = worker._update_weights

    def _update_weights(weights, **kwargs):
        # The reload keeps a layer's weights until its last one arrives (or until finalize, for a layer with rows
        # no checkpoint fills, such as vocabulary padding); verl's buckets are views of one shared-memory buffer
        # that it reuses and then closes ("cannot close exported pointers exist"), so the reload gets copies.
        return update([(name, tensor.clone()) for name, tensor in weights], **kwargs)

    loader_utils.process_weights_after_loading = finalize
    worker._update_weights = _update_weights
    try:
        return original(worker, peft_config=peft_config, base_sync_done=base_sync_done, use_shm=use_shm)
    finally:
        loader_utils.process_weights_after_loading = process
        del worker._update_weights


@torch.no_grad()
def served_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the engine computes with, per weight, under the trainer's (HF) names (module docstring)."""
    packed = dict(getattr(model, "packed_modules_mapping", None) or {})
    out: dict[str, torch.Tensor] = {}
    for name, layer in model.named_modules():
        params = dict(layer.named_parameters(recurse=False))
        if "weight" not in params:
            continue
        weight = _through_gemm(layer) if callable(getattr(layer, "cpu_linear", None)) else params["weight"].detach()
        if getattr(layer, "org_vocab_size", None) is not None:  # vocab rows padded to a multiple of 64
            weight = weight[: layer.org_vocab_size]
        parent, _, leaf = name.rpartition(".")
        parts = packed.get(leaf)
        if parts and getattr(layer, "output_sizes", None) and len(layer.output_sizes) == len(parts):
            for part, tensor in zip(parts, torch.split(weight, list(layer.output_sizes)), strict=True):
                out[f"{parent}.{part}.weight"] = tensor
            if params.get("bias") is not None:
                for part, tensor in zip(parts, torch.split(params["bias"].detach(), list(layer.output_sizes)),
                                        strict=True):  # fmt: skip
                    out[f"{parent}.{part}.bias"] = tensor
            continue
        out[f"{name}.weight"] = weight
        if params.get("bias") is not None:
            out[f"{name}.bias"] = params["bias"].detach()
    return out


def _through_gemm(layer) -> torch.Tensor:
    """``W`` (N, K) of a packed linear, as ``cpu_linear(I_K)^T``: exact for bf16 weights (module docstring)."""
    weight = layer.weight
    k = weight.shape[1] if weight.numel() else layer.input_size_per_partition
    eye = torch.eye(k, dtype=weight.dtype)
    return layer.cpu_linear(eye, weight, None).t().contiguous()


def write_served(model: torch.nn.Module, directory: Path) -> Path:
    """``DIR/engine-<replica>-<sync>.json``: the digest of each served weight after this process's latest sync, with
    the engine's thread count and its attention's KV-split setting."""
    replica = os.environ.get("VERL_REPLICA_RANK", "0")
    path = directory / f"engine-{replica}-{_syncs['count']}.json"
    import vllm.envs as envs

    record = {
        "weights": {name: audit.digest(t) for name, t in served_weights(model).items()},
        # what the engine's log-probs can depend on besides the weights (docs/verl.md, "The engine's threads")
        "threads": torch.get_num_threads(),
        "attn_split_kv": bool(envs.VLLM_CPU_ATTN_SPLIT_KV),
    }
    audit.write(path, record)
    return path


__all__ = ["WORKER_MODULE", "install", "served_weights", "write_served"]
