"""Model-level check: ``roundalign.apply(model, profile)`` gives, bit for bit, the logits of an independent
reference (tests/model_reference.py) that applies the profile's formulas to the same bf16 weights.

Tiny configs built in code (no hub), bf16, eager attention; prefill on random token ids, batch 2 x 17 tokens,
with and without left padding. Exact ``torch.equal`` everywhere; there are no tolerances in this file.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

import roundalign
from roundalign.profiles import REGIONS, CosSinDtype, QKNormRule, ResidualRule, RMSNormRule, RopeRule, SwiGLURule
from tests.helpers import rounding_profiles
from tests.model_reference import reference_logits, rope_inv_freq

BATCH, SEQ, VOCAB = 2, 17, 512
PAD = 5  # left-padding length of row 1 in the padded cases

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # head_dim 16: wavelengths 6.3 (< 64/4: kept), 32.5 (medium band: smoothed), >= 168 (> 64: divided)
    "original_max_position_embeddings": 64,
}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}


def make_config(kind: str):
    """Tiny configs. Qwen2 always has q/k/v bias; llama-bias turns on attention_bias + mlp_bias + tied embeddings;
    the MoE config mixes sparse layers (0, 2) with a dense mlp_only layer (1)."""
    if kind == "llama":
        return LlamaConfig(**_COMMON)
    if kind == "llama-bias":
        return LlamaConfig(**_COMMON, attention_bias=True, mlp_bias=True, tie_word_embeddings=True)
    if kind == "llama-llama3":
        return LlamaConfig(**_COMMON, rope_parameters=dict(LLAMA3))
    if kind == "qwen2":
        return Qwen2Config(**_COMMON)
    if kind == "qwen2-yarn":
        return Qwen2Config(**_COMMON, rope_parameters=dict(YARN))
    if kind == "qwen3":
        return Qwen3Config(**_COMMON, head_dim=32)
    if kind == "qwen3-yarn":
        return Qwen3Config(**_COMMON, head_dim=32, rope_parameters={**YARN, "rope_theta": 1e6})
    if kind == "qwen3_moe":
        return Qwen3MoeConfig(
            **{**_COMMON, "num_hidden_layers": 3},
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        )
    if kind == "qwen3_moe-step2":
        return Qwen3MoeConfig(
            **{**_COMMON, "num_hidden_layers": 3},
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            decoder_sparse_step=2,
        )
    if kind.startswith(("qwen3-hd", "llama-hd")):
        family, hd = kind.split("-hd")
        cls = Qwen3Config if family == "qwen3" else LlamaConfig
        return cls(**{**_COMMON, "num_attention_heads": 2, "num_key_value_heads": 1}, head_dim=int(hd))
    raise KeyError(kind)


FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe"]
PROFILES = [p for p in rounding_profiles() if p != "hf"]


_BUILT: dict[str, tuple] = {}


def build(kind: str):
    """(model, state dict, config, input ids) for a tiny config, built once per kind and shared by the tests;
    every test that patches the model reverts it (and check_patched asserts that revert restores stock HF).

    HF's init leaves every RMSNorm weight at 1 and every bias at 0, which hides regions: with w == 1,
    ``r(w*r(x*nu)) == r(x*nu*w)``, so rms_norm / qk_norm round_before_weight and round_after_weight would give
    identical logits. Norm weights are therefore drawn around 1 and biases around 0, as in trained checkpoints.
    """
    if kind not in _BUILT:
        cfg = make_config(kind)
        torch.manual_seed(0)
        extra = {"experts_implementation": "eager"} if cfg.model_type == "qwen3_moe" else {}
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="eager", **extra)
        model.eval()
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
                elif name.endswith(".bias"):
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
        # the weights the reference reads, copied before any patching
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        _BUILT[kind] = (model, sd, cfg, ids)
    model = _BUILT[kind][0]
    assert roundalign.patched_profile(model) is None, f"{kind}: a previous test left the shared model patched"
    return _BUILT[kind]


def left_padding() -> torch.Tensor:
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, :PAD] = 0
    return mask


# the input cases: (attention_mask, position_ids) builders
CASES = {
    "nopad": lambda: (None, None),
    "leftpad": lambda: (left_padding(), None),
    # positions restarting after the padding, as generate() builds them: per-row cos/sin
    "leftpad-pos": lambda: (left_padding(), (left_padding().cumsum(-1) - 1).clamp(min=0)),
}


@torch.no_grad()
def logits(model, ids, case: str) -> torch.Tensor:
    mask, pos = CASES[case]()
    return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits


def ref(sd, cfg, ids, profile, case: str) -> torch.Tensor:
    mask, pos = CASES[case]()
    return reference_logits(sd, cfg, ids, profile, attention_mask=mask, position_ids=pos)


def check_patched(kind: str, profile, *, cases=("nopad", "leftpad"), **overrides) -> dict[str, float]:
    """apply(model, profile, **overrides) == reference(profile.replace(**overrides)), bitwise, for each case;
    revert restores the stock logits. Returns the fraction of logits equal to stock HF per case."""
    model, sd, cfg, ids = build(kind)
    stock = {c: logits(model, ids, c) for c in cases}
    prof = roundalign.get_profile(profile).replace(**overrides)
    roundalign.apply(model, profile, **overrides)
    try:
        frac = {}
        for c in cases:
            out = logits(model, ids, c)
            expect = ref(sd, cfg, ids, prof, c)
            n_diff = (out != expect).sum().item()
            assert torch.equal(out, expect), f"{kind} {prof.name} {c}: {n_diff}/{out.numel()} logits differ"
            frac[c] = (out == stock[c]).float().mean().item()
    finally:
        roundalign.revert(model)
    for c in cases:
        assert torch.equal(logits(model, ids, c), stock[c]), f"{kind}: revert did not restore stock logits ({c})"
    return frac


# ------------------------------------------------------------------------------------- stock HF (hf) ----


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    "kind", [*FAMILIES, "llama-bias", "llama-llama3", "qwen2-yarn", "qwen3-yarn", "qwen3_moe-step2"]
)
def test_hf_reference_equals_unpatched_model(kind, case):
    """Profile "hf" == the UNPATCHED HF model, bitwise: validates the reference against stock HF (every region
    in its HF rule, plus attention, masking, MoE routing, biases, tied embeddings, rope scaling). apply(..., "hf")
    is a no-op and must not change that."""
    model, sd, cfg, ids = build(kind)
    stock = logits(model, ids, case)
    assert torch.equal(stock, ref(sd, cfg, ids, "hf", case))
    roundalign.apply(model, "hf")
    try:
        assert torch.equal(logits(model, ids, case), stock)
    finally:
        roundalign.revert(model)


# -------------------------------------------------------------------------------- every named profile ----


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("kind", FAMILIES)
def test_patched_model_matches_reference(kind, profile):
    frac = check_patched(kind, profile, cases=tuple(CASES))
    print(
        f"\n[record] {kind:10s} {profile:18s} fraction of logits equal to stock HF: "
        + ", ".join(f"{c}={v:.3f}" for c, v in frac.items())
    )


@pytest.mark.parametrize("kind", FAMILIES)
def test_vllm_reference_differs_from_hf(kind):
    """The tiny configs are sensitive: the regions are reached and their rounding shows in the logits."""
    _, sd, cfg, ids = build(kind)
    hf = ref(sd, cfg, ids, "hf", "nopad")
    vllm = ref(sd, cfg, ids, "vllm", "nopad")
    frac = (hf == vllm).float().mean().item()
    print(f"\n[record] {kind:10s} reference vllm vs hf: fraction of logits equal {frac:.3f}")
    assert not torch.equal(hf, vllm)


def _alternatives(region: str, model_type: str) -> list:
    """Every non-HF rule of a region that the family has."""
    if region == "qk_norm" and model_type not in ("qwen3", "qwen3_moe"):
        return []
    if region == "expert_swiglu" and model_type != "qwen3_moe":
        return []
    rules = {
        "rms_norm": list(RMSNormRule),
        "qk_norm": list(QKNormRule),
        "residual": list(ResidualRule),
        "rope": [RopeRule(c, r) for c in ("bf16", "fp32") for r in ("per_op", "once")] + [RopeRule("bf16", "truncate")],
        "swiglu": list(SwiGLURule),
        "expert_swiglu": list(SwiGLURule),
    }[region]
    hf_rule = getattr(roundalign.get_profile("hf"), region)
    return [rule for rule in rules if rule != hf_rule]


_REGION_CASES = [
    (kind, region, str(rule))
    for kind in FAMILIES
    for region in REGIONS
    for rule in _alternatives(region, make_config(kind).model_type)
]


@pytest.mark.parametrize("kind,region,rule", _REGION_CASES)
def test_each_region_override_reached_and_matches(kind, region, rule):
    """One region at a time off the HF rule: the reference changes (the region is reached and matters in this
    config), and apply(model, "hf", region=rule) reproduces it bitwise."""
    _, sd, cfg, ids = build(kind)
    one = roundalign.get_profile("hf").replace(**{region: rule})
    assert not torch.equal(ref(sd, cfg, ids, one, "nopad"), ref(sd, cfg, ids, "hf", "nopad")), (
        f"{kind}: {region}={rule} does not change the logits; the config is not sensitive to it"
    )
    check_patched(kind, "hf", **{region: rule})


# -------------------------------------------------------------------------------------- qk_norm rules ----


@pytest.mark.parametrize("rule", [r.value for r in QKNormRule])
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_qk_norm_overrides_on_vllm(kind, rule):
    check_patched(kind, "vllm", cases=("nopad", "leftpad-pos"), qk_norm=rule)


@pytest.mark.parametrize(
    "base",
    [
        "vllm",  # bf16/once
        "aligned",  # fp32/once
        "te",  # fp32/once, rounded-sum residual
        "hf",  # bf16/per_op
        "sglang",  # head_dim 32 -> bf16/per_op
        "vllm-0.32-cpu-eager-nobf16",  # bf16/truncate: the one conversion truncates
    ],
)
def test_qk_norm_fused_into_rope_rounds_once(base):
    """fused_into_rope: RoPE reads the fp32 norm output and its output is the only rounding, whatever the
    profile's RoPE rounding and cos/sin dtype (profiles.QKNormRule.FUSED_INTO_ROPE)."""
    check_patched("qwen3", base, qk_norm="fused_into_rope")


# ----------------------------------------------------------------------------- sglang head-dim RoPE ----


@pytest.mark.parametrize(
    "kind,expected",
    [
        ("qwen3-hd64", RopeRule("fp32", "once")),
        ("qwen3-hd96", RopeRule("bf16", "per_op")),
        ("llama-hd64", RopeRule("fp32", "once")),
        ("llama-hd96", RopeRule("bf16", "per_op")),
    ],
)
def test_sglang_head_dim_rope(kind, expected):
    """SGLang's RoPE depends on head_dim: 64 -> fp32 cos/sin, one rounding; 96 -> bf16 cos/sin, per-op."""
    _, sd, cfg, ids = build(kind)
    sglang = roundalign.get_profile("sglang")
    assert sglang.rope_for(cfg.head_dim) == expected
    # the head-dim rule is what the reference uses, and the other rule would give different logits
    other = RopeRule("bf16", "per_op") if expected.cos_sin is CosSinDtype.FP32 else RopeRule("fp32", "once")
    base = ref(sd, cfg, ids, sglang, "nopad")
    assert torch.equal(base, ref(sd, cfg, ids, sglang.replace(rope=expected), "nopad"))
    assert not torch.equal(base, ref(sd, cfg, ids, sglang.replace(rope=other), "nopad"))
    check_patched(kind, "sglang", cases=("nopad", "leftpad-pos"))


# ------------------------------------------------------------------------------------- RoPE scaling ----


@pytest.mark.parametrize("kind", ["llama-llama3", "qwen2-yarn", "qwen3-yarn"])
def test_rope_scaling_engine_angles(kind):
    """llama3 / yarn: the engine's inv_freq and cos/sin scale (from vLLM's source) equal HF's bitwise for these
    configs, the scaling changes the logits, and the patched model matches the reference for the profiles with
    bf16 and fp32 cos/sin."""
    model, sd, cfg, ids = build(kind)
    inv_freq, scale = rope_inv_freq(cfg)
    rotary = model.model.rotary_emb
    assert torch.equal(inv_freq, rotary.inv_freq)
    assert scale == rotary.attention_scaling
    if kind != "llama-llama3":
        assert scale != 1.0  # yarn's mscale is reached

    unscaled = make_config(kind.split("-")[0])
    unscaled.rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_parameters["rope_theta"]}
    assert not torch.equal(ref(sd, unscaled, ids, "vllm", "nopad"), ref(sd, cfg, ids, "vllm", "nopad"))

    for profile in ("vllm", "aligned", "sglang"):
        check_patched(kind, profile, cases=("nopad", "leftpad-pos"))


# ------------------------------------------------------------------------ Qwen3-MoE default experts ----


@pytest.mark.parametrize("profile", ["hf", "vllm", "sglang"])
def test_moe_default_experts_implementation(profile):
    """Built without experts_implementation="eager", HF 5.24 picks "grouped_mm" for Qwen3-MoE. The reference
    mirrors the eager expert loop; on this CPU build the two agree bitwise, unpatched and patched (vllm rounds
    silu in the experts, sglang does not)."""
    _, sd, _, ids = build("qwen3_moe")
    cfg = make_config("qwen3_moe")  # fresh: build() set "eager" on its own config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="eager").eval()
    assert model.config._experts_implementation == "grouped_mm"
    model.load_state_dict(sd)
    roundalign.apply(model, profile)
    try:
        assert torch.equal(logits(model, ids, "leftpad"), ref(model, cfg, ids, profile, "leftpad"))
    finally:
        roundalign.revert(model)
