"""Weight sync: export the trainer's fp32 master to the rollout engine's bf16 copy, and measure what gets through.

Round-to-nearest-even export (``master.to(torch.bfloat16)``, what every framework does) absorbs most RL updates:
one smaller than half a bf16 ulp of its weight never reaches the engine until enough pile up in the master. Fair
Cast (Gao & Gao) exports with unbiased stochastic rounding or error feedback instead::

    from roundalign.sync import ExportState, Exporter, UpdateTracker, export_bf16

    served = export_bf16(master, "stochastic", ExportState.seeded(seed))   # one tensor (keep its state per name)
    exporter = Exporter("error-feedback")                                   # or a whole state_dict per step
    served_sd = exporter.export(master_sd)
    metrics = UpdateTracker().update(master_sd, served_sd)                  # sync/visible_fraction, ...

For a quantized engine, ``export_quantized(master_sd, "w8a8-int8")`` gives the tensors it serves and
``write_quantized`` the compressed-tensors checkpoint (``roundalign.sync.quantized``, docs/quantization.md).

docs/sync.md has the formulas, the metrics' definitions and the measured cost.
"""

from roundalign.sync.export import EXPORT_DTYPES, MODES, Exporter, ExportState, export_bf16, tensor_seed
from roundalign.sync.quantized import export_quantized, write_quantized
from roundalign.sync.visibility import KEYS, UpdateTracker

__all__ = [
    "EXPORT_DTYPES", "KEYS", "MODES", "ExportState", "Exporter", "UpdateTracker", "export_bf16", "export_quantized",
    "tensor_seed", "write_quantized",
]  # fmt: skip
