"""The numerics several commands share: mismatch metrics, importance-sampling corrections, bf16 bit distances,
the rounding rules' formulas and the 16-bit dtypes.

    from roundalign.numerics import mismatch_metrics, is_weights, bf16_ulp_distance

- ``metrics``: trainer-vs-sampler log-prob mismatch under verl's and TRL's metric names (``mismatch_metrics``);
- ``correction``: verl's and TRL's importance-sampling corrections (``ISCorrection``, ``is_weights``);
- ``bf16``: bf16 values as integers on a number line (``bf16_ulp_distance``);
- ``formulas``: each rounding rule as plain torch code, shared by the trainer's ops and the reference engine;
- ``dtypes``: the 16-bit compute dtypes (``LOW_PRECISION``).

Importing this package imports torch.
"""

from roundalign.numerics.bf16 import bf16_order_key, bf16_ulp_distance, bf16_ulps_of_larger
from roundalign.numerics.correction import IS_MODES, ISCorrection, is_weights
from roundalign.numerics.dtypes import LOW_PRECISION
from roundalign.numerics.metrics import METRIC_KEYS, SAFETY_BOUND, layer_agreement, log_ratios, mismatch_metrics

__all__ = [
    "IS_MODES",
    "LOW_PRECISION",
    "METRIC_KEYS",
    "SAFETY_BOUND",
    "ISCorrection",
    "bf16_order_key",
    "bf16_ulp_distance",
    "bf16_ulps_of_larger",
    "is_weights",
    "layer_agreement",
    "log_ratios",
    "mismatch_metrics",
]
