"""apply/revert on the four families: transparency, state_dict, printing and the documented errors.

Invariants:
- ``hf`` is a no-op, and a profile whose every rule is HF's (``vllm-eager-legacy``) goes through the whole aligned
  machinery yet equals stock HF bitwise, logits and every parameter gradient: the machinery adds no rounding.
- ``revert`` restores stock numerics exactly; state_dict keys and values never change.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import roundalign
from roundalign.errors import UnsupportedModel
from tests.models import FAMILIES, build, config, loss_and_grads, token_ids


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("profile", ["hf", "vllm-eager-legacy", "liger"])
def test_hf_rules_equal_stock_logits_and_grads(family, profile):
    ids = token_ids()
    stock = build(family)
    patched = build(family)
    roundalign.apply(patched, profile)
    logits_s, grads_s = loss_and_grads(stock, ids)
    logits_p, grads_p = loss_and_grads(patched, ids)
    assert torch.equal(logits_s, logits_p)
    _assert_same(grads_s, grads_p)
    assert len(grads_p) == len(list(patched.parameters()))


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_profile_changes_logits_and_revert_restores(family):
    ids = token_ids()
    model = build(family)
    stock = model(ids).logits
    roundalign.apply(model, "vllm")
    aligned = model(ids).logits
    equal = (aligned == stock).float().mean().item()
    print(f"{family}: vllm vs stock, {equal:.1%} of logits bitwise equal")
    assert equal < 0.9, "the vllm profile should move most logits"
    roundalign.revert(model)
    assert roundalign.patched_profile(model) is None
    assert torch.equal(model(ids).logits, stock)
    assert not any(type(m).__name__.startswith("Aligned") for m in model.modules())


@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_unchanged_and_checkpoint_round_trip(family, tmp_path):
    model = build(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    roundalign.apply(model, "aligned")
    after = model.state_dict()
    _assert_same(before, after)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.bfloat16, attn_implementation="eager"
    )
    _assert_same(before, loaded.state_dict())
    roundalign.apply(loaded, "aligned")
    ids = token_ids()
    assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_print_shows_profile_and_rules():
    model = roundalign.apply(build("qwen3"), "vllm")
    text = str(model)
    assert "AlignedQwen3DecoderLayer" in text
    assert "profile=vllm, residual=round_at_attention" in text
    assert "(q_norm): AlignedQwen3RMSNorm((16,), eps=1e-06, rule=fused_into_rope)" in text
    assert "(input_layernorm): AlignedQwen3RMSNorm((64,), eps=1e-06, rule=round_after_weight)" in text
    assert "rope=bf16/once" in text and "swiglu=once" in text


def test_qwen3_moe_experts_get_expert_rule():
    model = roundalign.apply(build("qwen3_moe"), "vllm")
    layer0, layer1 = model.model.layers[0], model.model.layers[1]
    assert type(layer0.mlp.experts).__name__ == "AlignedQwen3MoeExperts"
    assert str(layer0.mlp.experts._roundalign_rule) == "round_silu"  # vLLM's fused MoE rounds silu first
    assert type(layer1.mlp).__name__ == "AlignedQwen3MoeMLP"  # mlp_only_layers=[1]: dense, dense rule
    assert str(layer1.mlp._roundalign_rule) == "once"


def test_override_one_region():
    model = roundalign.apply(build("qwen3"), "vllm", rope="fp32/once", qk_norm="round_after_weight")
    prof = roundalign.patched_profile(model)
    assert prof.name == "vllm+qk_norm=round_after_weight+rope=fp32/once"
    assert str(prof.rope) == "fp32/once" and str(prof.rms_norm) == "round_after_weight"
    assert model.model.layers[0].self_attn.q_norm._roundalign_rule == "round_after_weight"
    cos, sin = model.model.rotary_emb(torch.zeros(1, 1, dtype=torch.bfloat16), torch.arange(4)[None])
    assert cos.dtype == torch.float32


def test_sglang_head_dim_rule():
    m64 = roundalign.apply(build("qwen3", head_dim=64, num_attention_heads=2, num_key_value_heads=1), "sglang")
    m16 = roundalign.apply(build("qwen3"), "sglang")
    assert str(m64.model.rotary_emb._roundalign_rope) == "fp32/once"
    assert str(m16.model.rotary_emb._roundalign_rope) == "bf16/per_op"


# -- errors ---------------------------------------------------------------------------------------------------


def test_unsupported_model_type_lists_supported():
    cfg = transformers.MistralConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=50,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"model_type 'mistral'.*qwen2, qwen3, qwen3_moe, llama"):
        roundalign.apply(model, "vllm")


def test_different_profile_on_top_raises_same_is_noop():
    model = roundalign.apply(build("llama"), "vllm")
    assert roundalign.apply(model, "vllm") is model
    with pytest.raises(RuntimeError, match=r"already patched with profile 'vllm'.*revert"):
        roundalign.apply(model, "sglang")
    roundalign.revert(model)
    roundalign.apply(model, "sglang")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_non_bf16_model_raises_unless_opted_in(dtype):
    model = build("qwen2", dtype=dtype)
    with pytest.raises(TypeError, match=r"needs a bf16 model.*allow_non_bf16=True"):
        roundalign.apply(model, "vllm")
    roundalign.apply(model, "vllm", allow_non_bf16=True)
    assert roundalign.patched_profile(model).name == "vllm"


def test_unknown_profile_and_region():
    with pytest.raises(ValueError, match="unknown profile 'vlm'"):
        roundalign.apply(build("qwen2"), "vlm")
    with pytest.raises(TypeError, match="unknown region"):
        roundalign.apply(build("qwen2"), "vllm", layernorm="x")
    with pytest.raises(ValueError, match="unknown swiglu rule 'twice'"):
        roundalign.apply(build("qwen2"), "vllm", swiglu="twice")


def test_unsupported_rope_type_raises():
    model = build("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(UnsupportedModel, match="rope_type .dynamic. is not supported"):
        roundalign.apply(model, "vllm")


def test_reentrant_checkpointing_is_refused():
    model = roundalign.apply(build("qwen3"), "vllm").train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(RuntimeError, match="use_reentrant': False"):
        model(token_ids()).logits.float().sum().backward()


def test_config_builder_is_sane():
    assert config("qwen3_moe").model_type == "qwen3_moe"


def test_override_equal_to_the_profile_is_the_profile():
    model = roundalign.apply(build("qwen2"), "vllm", rope="bf16/once", swiglu="once")
    assert roundalign.patched_profile(model) is roundalign.get_profile("vllm")
    assert roundalign.apply(model, "vllm") is model  # same rules: no "already patched" error


def test_deepcopy_and_pickle_keep_the_patch():
    """TRL builds its reference model with copy.deepcopy; torch.save pickles the module classes by name."""
    import copy
    import io

    model = roundalign.apply(build("qwen3_moe"), "vllm")
    ids = token_ids()
    expected = model(ids).logits
    clone = copy.deepcopy(model)
    assert roundalign.patched_profile(clone) == roundalign.get_profile("vllm")
    assert torch.equal(clone(ids).logits, expected)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded.model.layers[0]).__name__ == "AlignedQwen3MoeDecoderLayer"
    assert torch.equal(loaded(ids).logits, expected)
    roundalign.revert(clone)
    assert torch.equal(model(ids).logits, expected)  # reverting the copy leaves the original patched
    assert not torch.equal(clone(ids).logits, expected)


# ------------------------------------------------------------------------------------------ coexisting with others


def test_fsdp_wrap_names_are_the_aligned_classes_and_revert_restores_them():
    """FSDP auto-wrap finds decoder layers by class name in ``_no_split_modules`` (accelerate, verl), and accelerate
    raises for a name no module has: an aligned model lists its aligned classes instead of HF's."""
    from accelerate.utils.dataclasses import get_module_class_from_name

    model = build("qwen3")
    stock = model._no_split_modules
    assert stock == {"Qwen3DecoderLayer"}
    roundalign.apply(model, "vllm")
    assert model._no_split_modules == {"AlignedQwen3DecoderLayer"}
    for name in model._no_split_modules:  # what accelerate's FSDP2 auto-wrap does with each name
        assert get_module_class_from_name(model, name) is type(model.model.layers[0])
    roundalign.revert(model)
    assert model._no_split_modules is stock


def test_an_instance_level_forward_is_refused_before_anything_is_patched():
    """Liger's _apply_liger_kernel_to_instance binds forward on instances, which would shadow the aligned class."""
    model = build("llama")
    model.model.norm.forward = lambda hidden_states: hidden_states  # what an instance-level patch does
    with pytest.raises(RuntimeError, match=r"model\.norm.*instance-level forward"):
        roundalign.apply(model, "vllm")
    assert roundalign.patched_profile(model) is None
    assert all(not hasattr(type(m), "_roundalign_hf_class") for m in model.modules())  # nothing half-patched


def test_a_module_kernelized_from_the_hub_is_refused_with_the_switch_that_prevents_it():
    """transformers >= 5.25 kernelizes in from_pretrained by default: the kernels library binds the Hub kernel's
    forward on the instance and records its repository (kernels' _replace_forward); on a GPU RMSNorm becomes Liger's."""
    from types import MethodType

    model = build("qwen3")
    norm = model.model.layers[0].input_layernorm
    norm.forward = MethodType(type(norm).forward, norm)  # what kernels' _replace_forward does
    norm.__dict__["_kernel_repo"] = "kernels-community/liger-kernels"
    with pytest.raises(RuntimeError, match=r"layers\.0\.input_layernorm.*use_kernels=False.*USE_HUB_KERNELS=0"):
        roundalign.apply(model, "vllm")
    assert roundalign.patched_profile(model) is None


def test_a_family_whose_transformers_classes_were_replaced_is_refused():
    from roundalign.patch.registry import define_family

    class LigerRMSNorm(torch.nn.Module):  # stands in for a class another library bound into transformers
        pass

    with pytest.raises(ImportError, match="before applying Liger"):
        define_family("qwen3", {"__name__": "tests.fake_family"}, norm=LigerRMSNorm)


def test_what_a_profile_does_is_read_from_its_rules_not_its_name():
    """A profile named ``hf`` with SGLang's rules patches as ``sglang`` does (and ``patched_profile`` says so); a
    profile of another name with stock HF's rules leaves every module as it is, as ``hf`` does."""
    import dataclasses

    ids = token_ids()
    sglang = roundalign.get_profile("sglang")
    want = roundalign.apply(build("qwen3"), sglang)(ids).logits
    fake_hf = dataclasses.replace(sglang, name="hf")
    model = roundalign.apply(build("qwen3"), fake_hf)
    assert not fake_hf.is_stock_hf and roundalign.patched_profile(model) is fake_hf
    assert type(model.model.layers[0]).__name__.startswith("Aligned")
    assert torch.equal(model(ids).logits, want)

    stock = build("qwen3")
    classes = [type(m) for m in stock.modules()]
    renamed = dataclasses.replace(roundalign.get_profile("hf"), name="mine")
    assert renamed.is_stock_hf and renamed.same_rules("hf") and not renamed.same_rules("liger")  # liger: fp32 angles
    model = roundalign.apply(build("qwen3"), renamed)
    assert [type(m) for m in model.modules()] == classes  # nothing swapped
    assert torch.equal(model(ids).logits, stock(ids).logits)
