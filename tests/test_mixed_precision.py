"""fp32 parameters with bf16 compute: CPU autocast and FSDP2 mixed precision give the bf16 model's numerics exactly.

Production trainers hold fp32 parameters (verl: FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16)``; HF Trainer / TRL:
``torch.autocast(bf16)``). ``roundalign.apply(model, profile, allow_non_bf16=True)`` must then round where the
engine does, i.e. compute exactly what the bf16 model with weights ``r(W)`` computes. Two references:

- the single-process bf16 model, patched with the same profile, with the fp32 weights loaded into a model built in
  bf16 (not ``.to(bf16)``, which also rounds HF's rotary ``inv_freq`` buffer);
- for the logits, also ``tests/model_reference.py``, written from engine-rounding.md without roundalign's code.

The FSDP2 tests run two gloo processes on the CPU (``tests/distributed.py``).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import roundalign
from tests.distributed import spawn_gloo
from tests.helpers import assert_bitwise_equal
from tests.model_reference import reference_logits
from tests.models import build, config, token_ids

ALIGNED = ("vllm", "vllm-eager", "sglang", "aligned", "liger", "te")
FAMILIES = ("qwen2", "qwen3", "qwen3_moe", "llama")


def _pair(family: str, seed: int = 0):
    """(fp32 model, bf16 twin holding r(W)), both unpatched, eager attention."""
    m32 = build(family, seed=seed, dtype=torch.float32)
    m16 = build(family, seed=seed, dtype=torch.bfloat16)
    m16.load_state_dict(m32.state_dict())  # copy_ rounds to nearest even: the engine's served copy
    return m32, m16


def _capture(model) -> tuple[dict, list]:
    """Forward hooks recording every patched module's tensor output (the aligned ops' outputs)."""
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        if hasattr(type(module), "_roundalign_hf_class"):  # patched (FSDP2 subclasses it again: FSDPAligned...)

            def hook(_m, _a, out, name=name):
                out = out[0] if isinstance(out, tuple) else out
                if isinstance(out, torch.Tensor):
                    seen[name] = out.detach().clone()

            handles.append(module.register_forward_hook(hook))
    return seen, handles


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())


# ------------------------------------------------------------------------------------------------ autocast


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("profile", ALIGNED)
def test_autocast_fp32_parameters_equal_bf16_model(family, profile):
    """Under CPU autocast, the patched fp32 model's logits and every aligned module's output equal the bf16 twin's."""
    m32, m16 = _pair(family)
    roundalign.apply(m16, profile)
    roundalign.apply(m32, profile, allow_non_bf16=True)
    ids = token_ids()
    seen16, h16 = _capture(m16)
    seen32, h32 = _capture(m32)
    with torch.no_grad():
        want = m16(ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = m32(ids).logits
    assert got.dtype == torch.bfloat16
    assert_bitwise_equal(got, want, f"{family}/{profile} logits")
    assert seen32.keys() == seen16.keys() and len(seen16) > 0
    for name in seen16:
        assert_bitwise_equal(seen32[name], seen16[name], name)
    if family != "qwen3_moe":  # the reference loops over experts; HF 5.24 builds grouped_mm experts
        assert_bitwise_equal(got, reference_logits(m16, m16.config, ids, profile), "independent reference")


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_autocast_gradients_are_the_bf16_gradients(family):
    """Each fp32 parameter's gradient is its bf16 twin's, widened exactly, except the embedding's.

    Autocast rounds a weight with a differentiable cast, whose backward widens the bf16 gradient exactly. The
    embedding gather is the exception: it runs on the fp32 table, so a repeated token's gradients add up in fp32,
    where the bf16 model adds them in bf16. Its reference is the fp32 sum of the bf16 model's per-token gradients.
    """
    m32, m16 = _pair(family)
    roundalign.apply(m16, "vllm")
    roundalign.apply(m32, "vllm", allow_non_bf16=True)
    ids = token_ids(length=24)  # 48 tokens over a 97-token vocabulary: some repeat
    per_token = {}

    def keep_grad(_module, _args, out):  # the bf16 gradient reaching each embedded token
        out.register_hook(lambda g: per_token.update(grad=g))

    m16.model.embed_tokens.register_forward_hook(keep_grad)
    _loss(m16(ids).logits, ids).backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = m32(ids).logits
    _loss(logits, ids).backward()
    grads16 = dict(m16.named_parameters())
    for name, p in m32.named_parameters():
        assert p.grad.dtype == torch.float32
        if name != "model.embed_tokens.weight":
            assert_bitwise_equal(p.grad, grads16[name].grad.float(), name)
    g = per_token["grad"]
    assert g.dtype == torch.bfloat16
    embed = torch.zeros(m32.model.embed_tokens.weight.shape).index_add_(0, ids.flatten(), g.flatten(0, 1).float())
    assert_bitwise_equal(m32.model.embed_tokens.weight.grad, embed, "embedding grad (fp32 sum)")
    assert ids.flatten().unique().numel() < ids.numel()  # the repeats that make the two sums differ exist


def test_stock_hf_under_autocast_is_not_the_bf16_model():
    """What the patch fixes: stock HF under autocast keeps an fp32 residual stream and fp32 norms (see
    docs/mixed-precision.md), so its logits are neither the bf16 model's nor any engine's."""
    m32, m16 = _pair("qwen3")
    ids = token_ids()
    with torch.no_grad():
        want = m16(ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            stock = m32(ids).logits
        seen = {}
        hook = m32.model.layers[0].register_forward_hook(lambda m, a, o: seen.update(out=o))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m32(ids)
        hook.remove()
    assert not torch.equal(stock, want)
    assert seen["out"].dtype == torch.float32  # the residual after a layer: fp32 under stock autocast


def test_fp32_compute_without_autocast_is_an_error():
    m32, _ = _pair("llama")
    roundalign.apply(m32, "vllm", allow_non_bf16=True)
    with pytest.raises(TypeError, match="autocast off.*revert"):
        m32(token_ids())


# ------------------------------------------------------------------------------------------------ FSDP2


def _fsdp2(model):
    """verl's wrapping: each decoder layer, then the root, with bf16 compute, fp32 gradient reduction, and
    cast_forward_inputs=True (FSDP2's default), which casts every floating tensor a layer receives to bf16."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def _fsdp2_rank(rank: int, world_size: int, cases, same_inputs: bool):
    """Per case: logits, aligned-module outputs and full (unsharded) fp32 gradients of the FSDP2 model."""
    out = []
    for family, profile, autocast in cases:
        m32 = build(family, dtype=torch.float32)
        roundalign.apply(m32, profile, allow_non_bf16=True)
        model = _fsdp2(m32)
        ids = token_ids(seed=1 if same_inputs else 1 + rank)
        seen, _ = _capture(model)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(ids).logits
        _loss(logits, ids).backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        out.append({"logits": logits.detach(), "ops": seen, "grads": grads})
    return out


def _bf16_reference(family: str, profile: str, seeds=(1,)):
    """The single-process bf16 patched model: logits and ops on input seed ``seeds[0]``, and gradients of the mean
    loss over ``seeds`` (what data parallelism averages), widened to fp32."""
    _, m16 = _pair(family)
    roundalign.apply(m16, profile)
    seen, _ = _capture(m16)
    first = None
    total = {n: torch.zeros(p.shape) for n, p in m16.named_parameters()}
    for seed in seeds:
        m16.zero_grad(set_to_none=True)
        ids = token_ids(seed=seed)
        logits = m16(ids).logits
        _loss(logits, ids).backward()
        if first is None:
            first = {"logits": logits.detach(), "ops": dict(seen)}
        for n, p in m16.named_parameters():
            total[n] += p.grad.float() / len(seeds)
    return first, total


# (family, profile, autocast): verl's actor runs its FSDP2 forward under torch.autocast(param_dtype) as well.
FSDP_CASES = [
    ("qwen3", "hf", False),
    ("qwen3", "vllm", False),
    ("qwen3", "sglang", False),
    ("llama", "aligned", False),
    ("qwen3_moe", "vllm", False),
    ("qwen3", "sglang", True),
    ("qwen3_moe", "aligned", True),
]


@pytest.mark.slow
def test_fsdp2_mixed_precision_equals_single_process_bf16():
    """Two gloo ranks, fp32 parameters, FSDP2 with param_dtype=bf16 and verl's cast_forward_inputs=True, with and
    without autocast around the forward (verl's actor has both): logits, every aligned module's output, and the
    reduced gradients equal the single-process bf16 patched model's."""
    ranks = spawn_gloo(_fsdp2_rank, 2, FSDP_CASES, True)
    for i, (family, profile, autocast) in enumerate(FSDP_CASES):
        ref, grads = _bf16_reference(family, profile)
        for rank, results in enumerate(ranks):
            got = results[i]
            what = f"{family}/{profile}{' autocast' if autocast else ''} rank {rank}"
            assert_bitwise_equal(got["logits"], ref["logits"], f"{what} logits")
            assert got["ops"].keys() == ref["ops"].keys()
            for name in ref["ops"]:
                assert_bitwise_equal(got["ops"][name], ref["ops"][name], f"{what} {name}")
            # Both ranks saw the same batch, so the fp32 average of two equal bf16 gradients is exact.
            for name, g in grads.items():
                assert_bitwise_equal(got["grads"][name], g, f"{what} grad {name}")
        if profile != "hf" and family != "qwen3_moe":
            assert_bitwise_equal(
                ranks[0][i]["logits"],
                reference_logits(_pair(family)[1], config(family), token_ids(), profile),
                f"{family}/{profile} independent reference",
            )


@pytest.mark.slow
def test_fsdp2_different_batches_per_rank_only_reorders_the_gradient_sum():
    """Different batches per rank: each rank's logits still equal the bf16 model's on that batch bitwise. The
    gradient is the fp32 mean of two bf16 per-rank gradients; one process summing the same two losses' gradients
    gets the same sum, so it is compared bitwise too (a difference here would be a real sharding bug)."""
    ranks = spawn_gloo(_fsdp2_rank, 2, [("qwen3", "aligned", False)], False)
    for rank in range(2):
        ref, _ = _bf16_reference("qwen3", "aligned", seeds=(1 + rank,))
        assert_bitwise_equal(ranks[rank][0]["logits"], ref["logits"], f"rank {rank} logits")
    _, mean_grads = _bf16_reference("qwen3", "aligned", seeds=(1, 2))
    for name, g in mean_grads.items():
        assert_bitwise_equal(ranks[0][0]["grads"][name], g, f"grad {name}")
        assert_bitwise_equal(ranks[1][0]["grads"][name], g, f"grad {name}")
