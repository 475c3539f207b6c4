"""``roundalign probe``: the train/inference mismatch audit.

An engine samples completions; each trainer profile recomputes their log-probs by teacher forcing; the probe
compares them with engine references (decode-time log-probs, the engine's prefill recompute, or an imported
vLLM/SGLang JSONL dump), attributes the gap per region and per layer, and writes a report.

Building blocks (pure, tested on their own):

- ``metrics``: the mismatch metrics under verl's and TRL's names, raw importance ratios, the error correlation,
  and bf16 ulp agreement of hidden states per layer;
- ``jsonl``: the engine log-prob dump format, strict reader and writer;
- ``report``: the versioned ``report.json`` schema (docs/probe-report.md);
- ``table`` and ``plots``: the terminal tables (rich) and the PNG plots (matplotlib), imported lazily because
  both libraries are the optional ``[cli]`` extra.
"""

from roundalign.probe.jsonl import EngineRollout, JSONLError, read_engine_logprobs, write_engine_logprobs
from roundalign.probe.metrics import (
    METRIC_KEYS,
    SAFETY_BOUND,
    bf16_ulp_distance,
    layer_agreement,
    log_ratios,
    mismatch_metrics,
)
from roundalign.probe.report import SCHEMA, build_report, load_report, region_share, validate_report, write_report

__all__ = [
    "METRIC_KEYS",
    "SAFETY_BOUND",
    "SCHEMA",
    "EngineRollout",
    "JSONLError",
    "bf16_ulp_distance",
    "build_report",
    "layer_agreement",
    "load_report",
    "log_ratios",
    "mismatch_metrics",
    "read_engine_logprobs",
    "region_share",
    "validate_report",
    "write_engine_logprobs",
    "write_report",
]
