"""Fair Cast on FSDP shards: export each rank's local fp32 shard so that the shards add up to one full-tensor export.

verl's weight sync rounds the fp32 master with ``p.to(torch.bfloat16)`` (RNE). ``ShardExporter`` replaces that cast
with a ``roundalign.sync`` mode (``docs/sync.md``), under two constraints the RNE cast meets for free:

- **Layout independence.** An FSDP2 rank holds a contiguous slab of each tensor's flat elements (``Shard(0)``).
  Concatenating the ranks' exports must give exactly the export of the full tensor, whatever the world size, or
  the rollout engine would serve a different model under a different sharding. Error feedback is element-wise, so
  a per-rank residual does it. Stochastic rounding's noise is counter-based (``roundalign.sync.noise``): each
  element's noise is a function of the tensor's key, the export step and the element's index in the full tensor, so
  a rank passes its slab's first index as ``offset`` and draws exactly its own elements' noise. The union of the
  shards is bitwise ``export_bf16(full, "stochastic", ExportState(key=tensor_seed(seed, name), step=version))``,
  in bf16 and fp16 alike.
- **Idempotence within a weight version.** verl exports the same weights several times between two optimizer steps:
  the delta engine's seed sends ``get_per_tensor_param()`` and then snapshots ``get_per_tensor_param_shard()`` as
  the diff base, and every K-th sync re-sends everything to verify the receiver's bits. Each of these must see the
  served copy the engine already has. So the served copy is a function of (master, ``version``): stochastic noise is
  drawn at step ``version``, and error feedback keeps ``v = fl32(master + residual)`` of the current version (the
  served copy is ``r(v)``; the residual ``v - r(v)`` is only taken when the next version starts). ``next_version()`` is
  called when the master moves (verl's ``optimizer_step``).

RNE needs neither: it is ``master.to(dtype)``, the cast verl already does.
"""

from __future__ import annotations

import torch

from roundalign.sync import EXPORT_DTYPES, MODES, ExportState, export_bf16, tensor_seed


class ShardExporter:
    """Exports local fp32 shards of HF-named tensors in one ``roundalign.sync`` mode, consistently across ranks.

    ``export(name, local, start)`` returns ``local`` rounded to ``dtype``, where ``local`` holds the full tensor's
    flat elements ``[start, start + local.numel())``. Every rank of a run must use the same mode, seed and dtype and
    call ``next_version()`` at the same points. State: error feedback keeps one fp32 buffer per local element;
    stochastic rounding and RNE keep none.
    """

    def __init__(self, sync: str = "stochastic", seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> None:
        if sync not in MODES:
            raise ValueError(f"unknown sync mode {sync!r}; choose one of {', '.join(MODES)}")
        if dtype not in EXPORT_DTYPES:
            raise ValueError(f"export dtype must be one of {EXPORT_DTYPES}, got {dtype}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        self.sync, self.seed, self.dtype = sync, seed, dtype
        self.version = 0
        self._ef: dict[str, tuple[int, int, torch.Tensor]] = {}  # name -> (version, start, v = fl32(master + e))

    def next_version(self) -> None:
        """The master moved (an optimizer step or a checkpoint load): the next export rounds afresh."""
        self.version += 1

    def export(self, name: str, local: torch.Tensor, start: int = 0) -> torch.Tensor:
        """The ``dtype`` export of fp32 ``local``, the full tensor's flat elements from ``start`` on."""
        if not isinstance(local, torch.Tensor) or local.dtype != torch.float32:
            kind = local.dtype if isinstance(local, torch.Tensor) else type(local).__name__
            raise TypeError(
                f"{name}: Fair Cast exports the fp32 master, got {kind}; keep the actor's master weights in fp32 "
                "(verl's default for a trained actor: model_dtype unset or fp32)"
            )
        if start < 0:
            raise ValueError(f"{name}: start must be >= 0, got {start}")
        if self.sync == "rne":
            return local.to(self.dtype)
        if self.sync == "stochastic":
            return self._stochastic(name, local, start)
        return self._error_feedback(name, local, start)

    def _stochastic(self, name: str, local: torch.Tensor, start: int) -> torch.Tensor:
        # The whole tensor's export at step ``version``, restricted to this rank's elements (noise.py: counter-based).
        state = ExportState(key=tensor_seed(self.seed, name), step=self.version)
        return export_bf16(local, "stochastic", state, self.dtype, offset=start)

    def _error_feedback(self, name: str, local: torch.Tensor, start: int) -> torch.Tensor:
        held = self._ef.get(name)
        if held is not None:
            version, held_start, v = held
            if held_start != start or v.shape != local.shape or v.device != local.device:
                raise ValueError(
                    f"{name}: this rank's shard moved (start {held_start} -> {start}, shape {tuple(v.shape)} -> "
                    f"{tuple(local.shape)}); error feedback keeps a residual per local element and cannot follow a "
                    "resharding. Make a new ShardExporter (the residuals restart from zero)."
                )
            if version == self.version:
                return v.to(self.dtype)  # the same weights again (seed + snapshot, verify): the same served copy
            residual = v.sub_(v.to(self.dtype))  # e = v - r(v), exact (Sterbenz); reuses v's buffer
            if not bool(torch.isfinite(residual).all()):
                residual.masked_fill_(~torch.isfinite(residual), 0.0)  # a non-finite served value carries nothing
            state = ExportState(residual=residual)
        else:
            state = ExportState()
        served = export_bf16(local, "error-feedback", state, self.dtype)  # v = m + e, r(v), e <- v - r(v)
        # Back to v: e + r(v) == v exactly, so re-exports of this version give r(v). Only a zero loses its sign
        # (+0 + -0 = +0); v always has r(v)'s sign (|e| <= half an ulp of r(v)), so copysign restores it.
        v = state.residual.add_(served).copysign_(served)
        self._ef[name] = (self.version, start, v)
        return served

    def state_dict(self) -> dict:
        """Settings, version and error-feedback buffers (copies), to save with the trainer's checkpoint."""
        buffers = {name: (version, start, v.detach().cpu().clone()) for name, (version, start, v) in self._ef.items()}
        return {"mode": self.sync, "seed": self.seed, "dtype": str(self.dtype), "version": self.version, "ef": buffers}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``; the mode, seed and dtype must be this exporter's."""
        mine = {"mode": self.sync, "seed": self.seed, "dtype": str(self.dtype)}
        differ = [f"{k}={state.get(k)!r} (this exporter: {v!r})" for k, v in mine.items() if state.get(k) != v]
        if differ:
            raise ValueError(f"state_dict is from a differently configured ShardExporter: {', '.join(differ)}")
        self.version = int(state["version"])
        self._ef = {name: (version, start, v.clone()) for name, (version, start, v) in state["ef"].items()}


def flat_offset(param) -> int:
    """Where this rank's local shard of ``param`` starts among the full tensor's flat elements (0 if unsharded).

    FSDP2 shards dim 0, so a rank holds a contiguous slab; other placements (tensor parallel ``Shard(1)``) are not a
    slab of the flat tensor and are refused.
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape = tuple(param.shape)
    local_shape, offset = compute_local_shape_and_global_offset(shape, param.device_mesh, param.placements)
    row = 1
    for d in shape[1:]:
        row *= d
    if tuple(local_shape[1:]) != shape[1:] or any(offset[1:]):
        raise ValueError(
            f"a DTensor with placements {param.placements} (local shape {tuple(local_shape)} of {shape}) is not a "
            "contiguous slab of the flat tensor; Fair Cast for verl supports FSDP2's dim-0 sharding only"
        )
    return int(offset[0]) * row if shape else 0


__all__ = ["ShardExporter", "flat_offset"]
