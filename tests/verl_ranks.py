"""What each gloo rank runs in the verl tests: verl's real FSDPEngine with roundalign's hooks, and the references.

``actor_run`` builds verl 0.9.1's ``FSDPEngine`` (fp32 ``from_pretrained``, the seam, ``MixedPrecisionPolicy(
param_dtype=bf16)``, ``apply_fsdp2``, ``fsdp2_load_full_state_dict``) once per configuration, takes the logits, then
syncs weights the way the delta checkpoint engine does: a full ``get_per_tensor_param`` seed, verl's own
``prime_delta_snapshots``, and after each real ``optimizer_step`` a ``get_per_tensor_param_delta_shard`` diff. Every
export is checked here, on the rank, against a reference computed from the full fp32 master with
``roundalign.sync.export_bf16`` at the key and step written out from ``docs/verl.md``.
"""

from __future__ import annotations

import torch

from roundalign.sync import ExportState, export_bf16, tensor_seed
from tests.verl_cpu import build_engine, hide_trl_from_verl, use_cpu_platform

CONFIGS = ((None, None), ("vllm", None), ("vllm", "stochastic"), ("vllm", "error-feedback"))


def token_batch() -> torch.Tensor:
    return torch.randint(1, 264, (2, 16), generator=torch.Generator().manual_seed(3))


def reference_export(full: dict, mode: str | None, seed: int, version: int, ef_states: dict) -> dict:
    """The served copy of the full fp32 masters at ``version``, from ``export_bf16`` on whole tensors."""
    out = {}
    for name, m in full.items():
        if not m.is_floating_point():
            out[name] = m
        elif mode is None:
            out[name] = m.to(torch.bfloat16)  # verl's cast
        elif mode == "stochastic":
            out[name] = export_bf16(m, "stochastic", ExportState(key=tensor_seed(seed, name), step=version))
        else:
            out[name] = export_bf16(m, "error-feedback", ef_states.setdefault(name, ExportState()))
    return out


def full_masters(engine) -> dict:
    from torch.distributed.tensor import DTensor
    from verl.utils.model import convert_weight_keys

    params = convert_weight_keys(engine.module.state_dict(), engine.module)
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in params.items()}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _check_exports(engine, reference: dict) -> list[str]:
    """Names whose full-path or shard-path export differs from the reference (bitwise); [] when all agree."""
    from roundalign.integrations.verl import flat_offset

    bad = []
    full, _ = engine.get_per_tensor_param()
    for name, tensor in full:
        if tensor.dtype == torch.float32 and reference[name].dtype == torch.bfloat16:
            tensor = tensor.to(torch.bfloat16)  # verl's own full path sends fp32; the rollout's loader casts (RNE)
        if not _bits_equal(tensor, reference[name]):
            bad.append(f"full:{name}")
    params = engine.module.state_dict()
    gen, _ = engine.get_per_tensor_param_shard()
    for name, local, spec in gen:
        start = flat_offset(params[name])
        want = reference[name].reshape(-1)[start : start + local.numel()]
        if tuple(spec.full_shape) != tuple(reference[name].shape) or not _bits_equal(local, want):
            bad.append(f"shard:{name}")
    return bad


def _step(engine, ids: torch.Tensor) -> None:
    logits = engine.module(input_ids=ids).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    engine.optimizer_step()  # verl's: clip, step; the hook starts a new weight version
    engine.optimizer_zero_grad()


def actor_run(rank: int, world_size: int, steps: int, lr: float, seed: int) -> list[dict]:
    use_cpu_platform()
    hide_trl_from_verl()
    import roundalign.integrations.verl as rv

    ids, results = token_batch(), []
    for profile, sync in CONFIGS:
        rv.uninstall()
        rv.install(profile=profile, sync=sync, seed=seed if sync == "stochastic" else 0)
        torch.manual_seed(0)
        engine = build_engine(lr=lr)
        model = engine.module
        with torch.no_grad():
            logits = model(input_ids=ids).logits
            with torch.autocast("cpu", dtype=torch.bfloat16):  # as verl's forward_step runs the actor
                logits_autocast = model(input_ids=ids).logits
        layers = model.model.layers
        result = {
            "profile": profile,
            "sync": sync,
            "logits": logits,
            "logits_autocast": logits_autocast,
            "layer_class": type(layers[0]).__name__,
            "no_split": list(getattr(model, "_no_split_modules", [])),
            "report": getattr(model, "_roundalign_verl_report", None),
            "mismatches": [],
            "changed": [],
            "total": 0,
        }
        mode = None if sync in (None, "rne") else sync
        ef_states: dict = {}
        reference = reference_export(full_masters(engine), mode, seed, 0, ef_states)
        result["mismatches"] += _check_exports(engine, reference)  # the seed sync's two paths
        engine.prime_delta_snapshots()  # verl's own: snapshots get_per_tensor_param_shard() as the diff base
        result["mismatches"] += _check_exports(engine, reference)  # the same version again: the same bits
        for version in range(1, steps + 1):
            _step(engine, ids)
            previous, reference = reference, reference_export(full_masters(engine), mode, seed, version, ef_states)
            entries, _ = engine.get_per_tensor_param_delta_shard()  # verl's hf_delta_export on this rank's shard
            local_changed = sum(int(counts.sum()) for _slots, _dt, counts, _idx, _val, _pg in entries)
            changed = sum(
                int((reference[n].view(torch.int16) != previous[n].view(torch.int16)).sum())
                for n in reference
                if reference[n].is_floating_point()
            )
            result["changed"].append((local_changed, changed))
            result["mismatches"] += [f"v{version}:{m}" for m in _check_exports(engine, reference)]
        result["total"] = sum(t.numel() for t in reference.values() if t.is_floating_point())
        results.append(result)
        del engine, model
    rv.uninstall()
    return results


def fp8_run(rank: int, world_size: int, steps: int, lr: float) -> list[dict]:
    """verl's FP8 rollouts with the aligned trainer: the actor under ``vllm+quantization=fp8-block`` through the hooks.
    At every weight version, the trainer's served FP8 copy (the codes and descales its forward computed with) and
    what verl's own quantizer (``FP8QuantizerHelper.quant_weights_by_name``, which its SGLang and TRT-LLM rollouts
    run on the trainer's export, and ``scaled_fp8_blockwise`` inside vLLM's loader) makes of the exported weights."""
    import asyncio
    import os

    os.environ["VERL_DISABLE_TRITON_FP8"] = "1"  # verl's CPU path of scaled_fp8_blockwise (Triton: the same on a GPU)
    use_cpu_platform()
    hide_trl_from_verl()
    from verl.utils.fp8_utils import FP8QuantizerHelper

    import roundalign.integrations.verl as rv
    from roundalign.kernels import quantized

    rv.uninstall()
    rv.install(profile="vllm+quantization=fp8-block")
    torch.manual_seed(0)
    engine, ids, results = build_engine(lr=lr), token_batch(), []
    helper = FP8QuantizerHelper({"weight_block_size": [128, 128]})
    for version in range(steps + 1):
        if version:
            _step(engine, ids)
        with torch.no_grad():
            logits = engine.module(input_ids=ids).logits  # the served copy of this version, in the trainer
        ours = {}
        for name, module in engine.module.named_modules():
            for proj, q in quantized.served(module).items():
                ours[f"{name.removeprefix('_fsdp_wrapped_module.')}.{proj}.weight"] = q
        full, _ = engine.get_per_tensor_param()

        async def collect(full=full):
            return [item async for item in helper.quant_weights_by_name(full)]

        theirs = dict(asyncio.run(collect()))
        quantized_names = sorted(n for n in theirs if f"{n}_scale_inv" in theirs)
        mismatches = [
            f"{n}: {reason}"
            for n in quantized_names
            for reason in (
                "missing" if n not in ours else
                "codes" if not torch.equal(theirs[n].float(), ours[n].codes) else
                "descales" if not torch.equal(theirs[f"{n}_scale_inv"], ours[n].scales) else None,
            )
            if reason is not None
        ]  # fmt: skip
        results.append(
            {"logits": logits, "verl": quantized_names, "ours": sorted(ours), "mismatches": mismatches,
             "dtype": str(theirs[quantized_names[0]].dtype)}
        )  # fmt: skip
    rv.uninstall()
    return results


__all__ = ["CONFIGS", "actor_run", "fp8_run", "reference_export", "token_batch"]
