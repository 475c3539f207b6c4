"""Which region, and which layer, a trainer/engine mismatch comes from.

Per region: start from a trainer profile (stock ``hf``, say), switch exactly one region to the engine profile's
rule, recompute the trainer's log-probs, and see how much of the mismatch is gone. A region's ``share`` is
``(base - value) / (base - target)``: ``base`` is the mismatch of the trainer profile as it is, ``target`` the
mismatch with every region switched (the engine profile itself), ``value`` the mismatch with only this region
switched. Rounding errors interact (a region's rounding can hide or amplify another's), so shares are a map, not
a partition: they need not add up to 1, and the report keeps the raw values next to them.

The other direction answers "what does this region cost on its own": start from the engine profile and put back
only this region's trainer rule. ``alone`` is the mismatch that region causes when every other region already
agrees, and ``alone_share = alone / base``. One differing rounding point anywhere makes every later value differ
a little, so a region often closes little of the gap when switched alone yet causes much of it when alone.

A share is a fraction of the gap ``base - target``, so it means something only when there is a gap: when the
engine profile brings the metric no closer than the trainer profile (``target >= base``), or closer by less than
``MIN_GAP`` of ``base``, any region that moves ``value`` by a few percent of ``base`` (as any change of rounding
does) reads as a share of tens or thousands of percent, of either sign. The entry then says why in
``share_undefined``, and the table and the plot show no share for it; the raw ``share`` stays in the report.
``alone_share`` is a fraction of ``base``, not of the gap, and stays meaningful.

When either profile names engine kernels (``Profile.attention``, ``Profile.gemm``), the two kernels are attributed
the same way, as two more entries (``attention``, ``gemm``): the rounding regions alone cannot close a gap that
the kernels make.

Per layer: the probe compares the residual stream after each decoder layer, trainer vs engine, in prefill
(``roundalign.numerics.metrics.layer_agreement``); the first layer where they part is where the mismatch starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from roundalign import support
from roundalign.profiles import KERNELS, REGIONS, Profile, get_profile

# The metric the shares are computed on: RMS of the per-token log-ratio, in nats. Unlike k3_kl it is linear in
# the size of the error, so halving every deviation halves it, and a share reads as "fraction of the deviation".
SHARE_METRIC = "mismatch/log_ratio_rms"
# What each region entry keeps besides the share metric.
KEPT_METRICS = ("mismatch/bitwise_equal_frac", "rollout_corr/k3_kl", "sampling/sampling_logp_difference/max")
# The smallest gap base - target, as a fraction of base, that the switch shares are computed against.
MIN_GAP = 0.1


def region_share(base: float, value: float, target: float) -> float | None:
    """Share of the base-to-target gap one region closes: (base - value) / (base - target); None if base == target.

    Shares need not sum to 1 and may fall outside [0, 1]: regions interact (one region's rounding can hide or
    amplify another's), which is itself worth seeing.
    """
    if base == target:
        return None
    return (base - value) / (base - target)


@dataclass(frozen=True)
class RegionSwitch:
    """One region of ``base`` switched to the engine's rule (``profile``), and the engine profile with only this
    region left at the trainer's rule (``alone``); both None when the two rules already agree."""

    region: str
    trainer_rule: str
    engine_rule: str
    profile: Profile | None
    alone: Profile | None


def _region_in_model(region: str, config) -> bool:
    if region == "qk_norm":
        return config.model_type in ("qwen3", "qwen3_moe")
    if region == "expert_swiglu":
        return config.model_type == "qwen3_moe"
    if region == "swiglu" and config.model_type == "qwen3_moe":
        # Qwen3-MoE has dense MLPs only in its mlp_only_layers (or when decoder_sparse_step skips layers).
        return bool(getattr(config, "mlp_only_layers", None)) or getattr(config, "decoder_sparse_step", 1) > 1
    return True


def region_switches(base: str | Profile, engine: str | Profile, config) -> list[RegionSwitch]:
    """The one-region switches from ``base`` toward ``engine`` for a model with this HF ``config``.

    Regions the model does not have (q/k norm outside Qwen3, expert SwiGLU outside MoE) are left out; the
    probe's notes say so. RoPE rules are compared as they apply at this model's head_dim.
    """
    base, engine = get_profile(base), get_profile(engine)
    head_dim = support.head_dim(config)
    out = []
    for region in REGIONS:
        if not _region_in_model(region, config):
            continue
        if region == "rope":
            t, e = base.rope_for(head_dim), engine.rope_for(head_dim)
        else:
            t, e = getattr(base, region), getattr(engine, region)
        same = t == e
        profile = None if same else base.replace(**{region: e})
        alone = None if same else engine.replace(**{region: getattr(base, region)})
        out.append(RegionSwitch(region, str(t), str(e), profile, alone))
    if base.uses_engine_kernels or engine.uses_engine_kernels:
        # The kernels are two more places the numbers can part: attributed like a region, one switched at a time.
        for kernel in KERNELS:
            t, e = getattr(base, kernel), getattr(engine, kernel)
            same = t == e
            profile = None if same else base.replace(**{kernel: e})
            alone = None if same else engine.replace(**{kernel: t})
            out.append(RegionSwitch(kernel, str(t), str(e), profile, alone))
    if base.quantization != engine.quantization:
        # A quantized engine: what it serves is one more place, usually the largest (docs/quantization.md).
        t, e = base.quantization, engine.quantization
        out.append(RegionSwitch("quantization", str(t), str(e), base.replace(quantization=e),
                                engine.replace(quantization=t)))  # fmt: skip
    return out


def missing_regions(config) -> list[str]:
    return [r for r in REGIONS if not _region_in_model(r, config)]


def share_undefined(base: float | None, target: float | None) -> str | None:
    """Why the shares of the gap from ``base`` to ``target`` are meaningless (short, for the table), or None."""
    if base is None or target is None:
        return "metric undefined"
    if target >= base:
        return "target not closer"
    if base - target < MIN_GAP * abs(base):
        return f"gap < {MIN_GAP:.0%} of base"
    return None


def entry_share_undefined(entry: dict) -> str | None:
    """An attribution entry's ``share_undefined``, computed from base and target for a report written without it."""
    if "share_undefined" in entry:
        return entry["share_undefined"]
    return share_undefined(entry["base"], entry["target"])


def attribution_entry(
    *,
    base: Profile,
    engine: Profile,
    backend: str,
    reference: str,
    base_metrics: dict,
    target_metrics: dict,
    switches: list[RegionSwitch],
    switch_metrics: dict[str, dict],
    alone_metrics: dict[str, dict],
) -> dict:
    """The report's attribution entry for one (trainer profile, backend, reference)."""
    b, t = base_metrics[SHARE_METRIC], target_metrics[SHARE_METRIC]
    regions = []
    for s in switches:
        m = base_metrics if s.profile is None else switch_metrics[s.region]
        value = m[SHARE_METRIC]
        alone = target_metrics if s.alone is None else alone_metrics[s.region]
        regions.append(
            {
                "region": s.region,
                "trainer_rule": s.trainer_rule,
                "engine_rule": s.engine_rule,
                "same_rule": s.profile is None,
                "value": value,
                "share": region_share(b, value, t),
                "metrics": {k: m.get(k) for k in KEPT_METRICS},
                "alone": alone[SHARE_METRIC],
                "alone_share": None if b == 0 else alone[SHARE_METRIC] / b,
                "alone_metrics": {k: alone.get(k) for k in KEPT_METRICS},
            }
        )
    return {
        "trainer_profile": base.name,
        "engine_profile": engine.name,
        "backend": backend,
        "reference": reference,
        "metric": SHARE_METRIC,
        "base": b,
        "target": t,
        "regions": regions,
        "share_undefined": share_undefined(b, t),
    }
