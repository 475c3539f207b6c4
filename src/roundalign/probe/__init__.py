"""``roundalign probe``: the train/inference mismatch audit.

An engine samples completions; each trainer profile recomputes their log-probs by teacher forcing; the probe
compares them with engine references (decode-time log-probs, the engine's prefill recompute, or an imported
vLLM/SGLang JSONL dump), attributes the gap per region and per layer, and writes a report.

Its modules:

- ``run``: ``ProbeConfig`` and ``run_probe``, the audit itself;
- ``report``: the versioned ``report.json`` schema (docs/probe-report.md);
- the per-region attribution of the gap is ``roundalign.numerics.attribution`` (the TRL metrics use it too);
- ``table`` and ``plots``: the terminal tables (rich) and the PNG plots (matplotlib), imported lazily because
  both libraries are the optional ``[cli]`` extra.

The metrics it reports are ``roundalign.numerics``'s; the rollouts it reads and writes are
``roundalign.rollouts``'.
"""

from roundalign.probe.report import SCHEMA, build_report, load_report, validate_report, write_report

__all__ = ["SCHEMA", "build_report", "load_report", "validate_report", "write_report"]
