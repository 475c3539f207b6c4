"""``install``: put ``patch_actor`` at verl's model-patching seam and Fair Cast into verl's weight sync, in-process.

Everything here targets verl 0.9.1's ``FSDPEngine`` (``verl/workers/engine/fsdp/transformer_impl.py``) and checks
the source it hooks before it hooks it, so a verl release that moved the seam or the cast fails loudly instead of
silently running stock numerics:

- **Seam.** ``_build_module`` calls the module-level name ``apply_monkey_patch`` right after Liger and right before
  ``module.to(torch_dtype)``; ``install`` rebinds that name in ``transformer_impl`` to a wrapper that runs verl's
  function and then ``patch_actor``. ``_build_fsdp_module`` is wrapped to check afterwards that FSDP wrapped every
  aligned decoder layer on its own (a user's ``wrap_policy.transformer_layer_cls_to_wrap`` naming the HF class would
  not).
- **Weight sync** (``sync="stochastic"`` or ``"error-feedback"``). ``get_per_tensor_param_shard`` (the delta
  engine's path) is verl's code with the ``p.to(torch.bfloat16)`` cast replaced by ``ShardExporter.export`` on the
  local fp32 shard. ``get_per_tensor_param`` (the full-tensor path of colocated and NCCL syncs, and the delta seed)
  exports the local shard the same way and all-gathers the bf16 result, so both paths serve the same bits, and the
  gather moves half the bytes of verl's fp32 one. ``optimizer_step`` and ``load_checkpoint`` start a new weight
  version. ``sync="rne"`` changes nothing: it is verl's own cast.
- **Log-probs.** With a profile, the actor's log-prob head is the sampler's (``logprobs.py``): fp32 logits, the
  temperature divided in fp32, ``log_softmax``, instead of verl's ``x - logsumexp(x)`` or bf16 ``log_softmax``.
- **Hub kernels off** (``USE_HUB_KERNELS=0`` while installed). transformers 5.25 made ``from_pretrained`` kernelize
  every model by default (``use_kernels``): on a GPU it binds Liger's RMSNorm and a Hub RoPE kernel on each instance,
  which would shadow the aligned classes (``apply`` refuses such a model), and verl builds the actor on the meta
  device on every rank but the first, where the ``kernels`` library raises "Unsupported device type 'meta'". The
  variable is transformers' own switch, read at each ``from_pretrained``; ``uninstall`` restores its old value.
"""

from __future__ import annotations

import logging
import os
import warnings

from roundalign.integrations.seams import check_source
from roundalign.integrations.verl import logprobs
from roundalign.integrations.verl.audit import hook as audit_hook
from roundalign.integrations.verl.export import ShardExporter, flat_offset
from roundalign.integrations.verl.seam import import_families, patch_actor
from roundalign.sync import MODES as SYNC_MODES

logger = logging.getLogger(__name__)

_state: dict = {}  # what install() replaced: {"originals": [(owner, attr, value)], "env", "profile", "sync", "seed"}

HUB_KERNELS_ENV = "USE_HUB_KERNELS"  # transformers >= 5.25: kernelize in from_pretrained unless this is false


def installed() -> dict | None:
    """``{"profile": ..., "sync": ..., "seed": ...}`` when ``install`` is in effect in this process, else None."""
    return {k: _state[k] for k in ("profile", "sync", "seed", "audit")} if _state else None


def install(profile=None, sync: str | None = None, seed: int = 0, audit: bool = False, **region_overrides) -> dict:
    """Hook verl's FSDP engine in this process: ``profile`` at the seam, ``sync`` in the weight export.

    ``profile``: a profile name or ``Profile`` for ``patch_actor`` (None: leave the model alone). ``sync``: None or
    ``"rne"`` (verl's cast), ``"stochastic"`` or ``"error-feedback"``; ``seed`` seeds stochastic rounding. Installing
    the same settings twice is a no-op; different ones raise (``uninstall`` first). ``audit``: also write the
    digest of every exported weight to ``$ROUNDALIGN_VERL_AUDIT`` (``audit.py``).
    """
    import roundalign

    if sync is not None and sync not in SYNC_MODES:
        raise ValueError(f"unknown sync mode {sync!r}; choose one of {', '.join(SYNC_MODES)}")
    if profile is not None:
        profile = roundalign.get_profile(profile).replace(**region_overrides)  # a bad name or rule fails here
    wanted = {"profile": profile, "sync": sync, "seed": seed, "audit": bool(audit)}
    if _state:
        if installed() == wanted:
            return installed()
        raise RuntimeError(f"roundalign's verl hooks are installed with {installed()}; uninstall() before {wanted}")
    import_families()  # before Liger can rebind transformers' classes (see seam._family)
    ti = _transformer_impl()
    originals = []
    if profile is not None:
        _check_source(ti.FSDPEngine._build_module, ["apply_monkey_patch(", "module.to(torch_dtype)"], "the seam")
        originals += _hook_seam(ti, profile)
        originals += logprobs.hook(ti)  # the sampler's log-prob formula (logprobs.py says why)
    if sync in ("stochastic", "error-feedback"):
        _check_source(ti.FSDPEngine.get_per_tensor_param_shard, ["p.to(torch.bfloat16"], "the shard export cast")
        originals += _hook_sync(ti, sync, seed)
    if audit:  # last: it tees whatever export the hooks above installed
        originals += audit_hook(ti)
    _state.update(wanted, originals=originals, env=_hub_kernels_off())
    logger.info("roundalign: verl hooks installed (%s)", installed())
    return installed()


def uninstall() -> None:
    """Put back everything ``install`` replaced."""
    for owner, attr, value in reversed(_state.get("originals", [])):
        setattr(owner, attr, value)
    for name, value in _state.get("env", {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _state.clear()


def _hub_kernels_off() -> dict:
    """Set ``USE_HUB_KERNELS=0`` (module docstring: why); the previous value, for ``uninstall``."""
    previous = os.environ.get(HUB_KERNELS_ENV)
    if previous is not None and previous.strip().upper() not in ("0", "FALSE", "NO", "OFF", ""):
        warnings.warn(
            f"{HUB_KERNELS_ENV}={previous!r}: roundalign's verl hooks set it to 0, because transformers' Hub kernels "
            "replace the forward of the modules the profile aligns, and cannot load verl's meta-device actor",
            stacklevel=3,
        )
    os.environ[HUB_KERNELS_ENV] = "0"
    return {HUB_KERNELS_ENV: previous}


def _transformer_impl():
    import verl
    import verl.workers.engine.fsdp.transformer_impl as ti

    if not str(getattr(verl, "__version__", "")).startswith("0.9."):
        warnings.warn(
            f"roundalign's verl hooks were written against verl 0.9.1; this is verl {verl.__version__}", stacklevel=3
        )
    return ti


def _check_source(func, needles: list[str], what: str) -> None:
    check_source(func, needles, what, "verl")


def _hook_seam(ti, profile) -> list:
    verl_patch = ti.apply_monkey_patch

    def apply_monkey_patch(model, *args, **kwargs):
        result = verl_patch(model, *args, **kwargs)
        patch_actor(model, profile)  # after Liger and verl's own patch; before .to(dtype) and FSDP
        return result

    build_fsdp = ti.FSDPEngine._build_fsdp_module

    def _build_fsdp_module(self, module):
        wrapped = build_fsdp(self, module)
        _check_layers_wrapped(wrapped)
        return wrapped

    originals = [(ti, "apply_monkey_patch", verl_patch), (ti.FSDPEngine, "_build_fsdp_module", build_fsdp)]
    ti.apply_monkey_patch = apply_monkey_patch
    ti.FSDPEngine._build_fsdp_module = _build_fsdp_module
    return originals


def _check_layers_wrapped(model) -> None:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from roundalign.patch import AlignedDecoderLayer

    layers = [m for m in model.modules() if isinstance(m, AlignedDecoderLayer)]
    fsdp1_units = {id(m._fsdp_wrapped_module) for m in model.modules() if isinstance(m, FSDP)}
    loose = [type(m).__name__ for m in layers if not isinstance(m, FSDPModule) and id(m) not in fsdp1_units]
    if loose:
        warnings.warn(
            f"FSDP did not wrap {len(loose)} aligned decoder layers ({loose[0]}) as their own units, so each forward "
            "gathers the whole model at once. If you set actor_rollout_ref.actor.fsdp_config.wrap_policy."
            f"transformer_layer_cls_to_wrap, name the aligned class ({loose[0].removeprefix('FSDP')}).",
            stacklevel=2,
        )


def _exporter(engine, sync: str, seed: int) -> ShardExporter:
    exporter = getattr(engine, "_roundalign_exporter", None)
    if exporter is None:
        exporter = engine._roundalign_exporter = ShardExporter(sync, seed)
    return exporter


def _check_engine(ti, engine, what: str) -> None:
    model = getattr(engine.module, "_fsdp_wrapped_module", engine.module)
    problems = ["LoRA"] * hasattr(model, "peft_config") + ["QAT"] * bool(getattr(engine, "_qat_enabled", False))
    if ti.fsdp_version(engine.module) != 2:
        problems.append(f"strategy {engine.engine_config.strategy!r} (FSDP{ti.fsdp_version(engine.module)})")
    if problems:
        raise NotImplementedError(
            f"roundalign's Fair Cast {what} supports a full-parameter FSDP2 actor (actor_rollout_ref.actor.strategy="
            f"fsdp2), not {', '.join(problems)}; unset ROUNDALIGN_SYNC (or use rne) for this run"
        )


def _hook_sync(ti, sync: str, seed: int) -> list:
    from torch.distributed.tensor import DTensor
    from verl.workers.engine.spec import ShardSpec

    def get_per_tensor_param_shard(self, **kwargs):
        """verl 0.9.1's shard export, with ``p.to(torch.bfloat16)`` replaced by roundalign's Fair Cast."""
        _check_engine(ti, self, "shard export")
        params = ti.convert_weight_keys(
            self.module.state_dict(), getattr(self.module, "_fsdp_wrapped_module", self.module)
        )
        device, exporter = ti.get_device_id(), _exporter(self, sync, seed)

        def _gen():
            for name, param in params.items():
                spec = ShardSpec.from_param(param)
                p = param.to(device, non_blocking=True)
                local = p.to_local() if hasattr(p, "to_local") else p
                if local.is_floating_point():
                    local = exporter.export(name, local, flat_offset(param))  # was: p.to(torch.bfloat16)
                yield name, local.reshape(-1), spec

        return _gen(), None

    def get_per_tensor_param(self, layered_summon=False, base_sync_done=False, **kwargs):
        """Full tensors for the rollout: each rank exports its shard, then the bf16 shards are all-gathered."""
        _check_engine(ti, self, "full-tensor export")
        params = ti.convert_weight_keys(
            self.module.state_dict(), getattr(self.module, "_fsdp_wrapped_module", self.module)
        )
        device, exporter = ti.get_device_id(), _exporter(self, sync, seed)

        def served(name, param):
            p = param.to(device, non_blocking=True)
            local = p.to_local() if isinstance(p, DTensor) else p
            if not local.is_floating_point():
                return p.full_tensor() if isinstance(p, DTensor) else p
            out = exporter.export(name, local, flat_offset(param))
            if not isinstance(p, DTensor):
                return out
            return DTensor.from_local(out, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()

        per_tensor = ((name, served(name, param)) for name, param in params.items())
        return ti.unfuse_moe_params(per_tensor, self.model_config.hf_config.model_type), None

    originals = []
    for attr, replacement in (
        ("get_per_tensor_param_shard", get_per_tensor_param_shard),
        ("get_per_tensor_param", get_per_tensor_param),
    ):
        originals.append((ti.FSDPEngine, attr, getattr(ti.FSDPEngine, attr)))
        setattr(ti.FSDPEngine, attr, replacement)
    for attr in ("optimizer_step", "load_checkpoint"):  # the master moves: the next export rounds afresh
        original = getattr(ti.FSDPEngine, attr)
        originals.append((ti.FSDPEngine, attr, original))
        setattr(ti.FSDPEngine, attr, _bumping(original, sync, seed))
    return originals


def _bumping(method, sync: str, seed: int):
    def wrapper(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        _exporter(self, sync, seed).next_version()
        return result

    wrapper.__name__, wrapper.__doc__ = method.__name__, method.__doc__
    return wrapper


__all__ = ["install", "installed", "uninstall"]
