"""The fp16 engine: ``Engine(..., dtype=torch.float16)`` against the fp16 trainer, generation, and dtype errors.

The acceptance test mirrors tests/test_engine_matches_trainer.py in fp16, on the shipped tiny Qwen3 (bf16 safetensors,
cast to fp16 on both sides): with the trainer loaded ``from_pretrained(dtype=torch.float16)`` and patched with the
engine's profile, ``Engine.score(mode="prefill")`` equals the trainer's teacher-forced log-probs bit for bit, for every
built-in profile. The engine and the trainer share only the element-wise formulas; their model code, weights copy,
cos/sin cache, residual carrying and attention are separate, so equality says every rounding point rounds to fp16 on
both sides (a bf16 rounding left anywhere would show: the fp16 and bf16 engines agree on no log-prob here).
"""

from __future__ import annotations

import pytest
import torch
import transformers

import roundalign
from roundalign import models
from roundalign.engine import Engine, SamplingParams
from tests.helpers import assert_bitwise_equal, rounding_profiles
from tests.test_engine_matches_trainer import sequences, trainer_logprobs, trainer_model

FP16 = torch.float16
PATH = models.path("tiny-qwen3")
LENGTHS = (5, 23, 64, 180)


@pytest.fixture(scope="module")
def trainer():
    """The fp16 trainer, loaded the way the brief says: from the bf16 checkpoint with dtype=fp16, sdpa attention."""
    return transformers.AutoModelForCausalLM.from_pretrained(PATH, dtype=FP16, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def engine():
    return Engine(PATH, profile="vllm", dtype=FP16)


def _prefill_ref(model, ids: list[int], split: int) -> torch.Tensor:
    return trainer_logprobs(model, ids)[split - 1 : -1].gather(1, torch.tensor(ids[split:])[:, None])[:, 0]


def test_served_copy_is_the_fp16_model(trainer, engine):
    assert engine.dtype == FP16
    served = engine.weights.state_dict()
    for name, p in trainer.state_dict().items():
        assert served[name].dtype == FP16
        assert_bitwise_equal(served[name], p, name)


@pytest.mark.parametrize("profile", rounding_profiles())
def test_fp16_engine_matches_fp16_trainer(trainer, profile):
    """Every built-in profile: fp16 engine prefill == fp16 trainer patched with the profile, bitwise."""
    eng = Engine(PATH, profile=profile, dtype=FP16)
    roundalign.apply(trainer, profile, allow_non_bf16=True)
    try:
        for ids in sequences(eng.vocab_size, lengths=LENGTHS):
            (got,) = eng.score([ids[:3]], [ids[3:]], mode="prefill")
            ref = _prefill_ref(trainer, ids, 3)
            assert torch.isfinite(ref).all()
            assert_bitwise_equal(got, ref, f"fp16 {profile}, {len(ids)} tokens")
    finally:
        roundalign.revert(trainer)


def test_fp16_equalities_are_not_trivial(trainer, engine):
    """The fp16 engine differs from the bf16 engine on every log-prob, and from the fp16 trainer under another
    profile on most: the equalities above can fail."""
    ids = sequences(engine.vocab_size, lengths=(64,))[0]
    (fp16,) = engine.score([ids[:3]], [ids[3:]])
    (bf16,) = Engine(PATH, profile="vllm").score([ids[:3]], [ids[3:]])
    assert (fp16 == bf16).float().mean() < 0.05
    roundalign.apply(trainer, "sglang", allow_non_bf16=True)
    try:
        other = _prefill_ref(trainer, ids, 3)
    finally:
        roundalign.revert(trainer)
    equal = (fp16 == other).float().mean().item()
    print(f"fp16 engine(vllm) vs fp16 trainer(sglang): {equal:.1%} bitwise equal")
    assert equal < 0.5


def test_fp16_hidden_states_match_trainer(trainer, engine):
    """R after every layer, fp16, equals the patched fp16 trainer's output_hidden_states (vllm carries the fp32 sum
    after attention, so this checks that R = r(S) rounds to fp16 on both sides)."""
    ids = sequences(engine.vocab_size, lengths=(37,))[0]
    got = engine.hidden_states(ids)
    roundalign.apply(trainer, "vllm", allow_non_bf16=True)
    last = []  # the last layer's R, before the final norm (HF's last hidden state is after it)
    hook = trainer.model.layers[-1].register_forward_hook(lambda m, i, o: last.append(o[0]))
    try:
        with torch.no_grad():
            ref = trainer(torch.tensor(ids)[None], output_hidden_states=True).hidden_states[1:-1]
    finally:
        hook.remove()
        roundalign.revert(trainer)
    assert len(got) == trainer.config.num_hidden_layers and all(g.dtype == FP16 for g in got)
    for i, (g, r) in enumerate(zip(got, [h[0] for h in ref] + [last[0][0]], strict=True)):
        assert_bitwise_equal(g, r, f"layer {i}")


# ---------------------------------------------------------------------------------------------------- generate


def test_fp16_generate_seeded_and_replayed(engine):
    prompts = sequences(engine.vocab_size, lengths=(3, 17, 9), seed=5)
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=3, ignore_eos=True)
    a, b = engine.generate(prompts, params), engine.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b] and [o.logprobs for o in a] == [o.logprobs for o in b]
    c = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=8, seed=4, ignore_eos=True))
    assert [o.token_ids for o in c] != [o.token_ids for o in a]
    completions = [o.token_ids for o in a]
    decode = engine.score(prompts, completions, mode="decode")
    for out, lp in zip(a, decode, strict=True):
        assert len(out.token_ids) == 8
        assert_bitwise_equal(lp, torch.tensor(out.logprobs))
    # decode computed with the prefill's shapes is the prefill (KV cache rows read back in fp16), and plain decode
    # is close to it (fp16 noise, not a position or mask error, which would move log-probs by O(1) nats)
    prefill = torch.cat(engine.score(prompts, completions, mode="prefill"))
    shaped = torch.cat(engine.score(prompts, completions, mode="decode", prefill_shaped=("attention", "matmul")))
    assert_bitwise_equal(shaped, prefill)
    assert (torch.cat(decode) - prefill).abs().max() < 0.1


@pytest.mark.slow
def test_fp16_inductor_backend():
    """vLLM's forward_native compiled piecewise, in fp16 (cos/sin cache in fp16): generate replays bitwise, and the
    prefill log-probs are the kernels backend's up to where Inductor rounds (as in bf16, docs/engine.md)."""
    model = trainer_model("qwen3", num_hidden_layers=2)  # fewer pieces to compile than the shipped model's
    eng = Engine(model, backend="inductor", dtype=FP16)
    assert eng._model.cos_sin_cache.dtype == FP16
    prompts = sequences(eng.vocab_size, lengths=(16, 40), seed=2)
    outs = eng.generate(prompts, SamplingParams(temperature=1.0, max_tokens=6, seed=0, ignore_eos=True))
    decode = eng.score(prompts, [o.token_ids for o in outs], mode="decode")
    for out, lp in zip(outs, decode, strict=True):
        assert_bitwise_equal(lp, torch.tensor(out.logprobs))
    got = torch.cat(eng.score([p[:3] for p in prompts], [p[3:] for p in prompts]))
    ref = torch.cat(Engine(model, profile="vllm", dtype=FP16).score([p[:3] for p in prompts], [p[3:] for p in prompts]))
    print(
        f"fp16 inductor vs kernels(vllm): {(got == ref).float().mean():.1%} bitwise equal, "
        f"max diff {(got - ref).abs().max():.4f}"
    )
    assert (got - ref).abs().max() < 0.1


# ------------------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, "float16", None])
def test_bad_dtype(dtype):
    with pytest.raises(ValueError, match=r"unknown engine dtype .*choose torch.bfloat16 .* or torch.float16"):
        Engine(PATH, dtype=dtype)


def test_repr_and_attribute():
    model = trainer_model("qwen3", num_hidden_layers=1)
    bf16, fp16 = Engine(model), Engine(model, dtype=FP16)
    assert bf16.dtype == torch.bfloat16 and "dtype" not in repr(bf16)
    assert fp16.dtype == FP16 and repr(fp16).endswith("dtype=torch.float16)")


def test_overflow_on_load_is_refused_and_changes_nothing():
    """A bf16 weight beyond fp16's range (65504) would be served as inf: refused at construction and in
    load_weights, where the served copy stays as it was. 65519.99 rounds down to 65504 and is accepted; 65520 is
    the tie between 65504 and 2^16 (= inf in fp16), and RNE's even neighbour is 2^16."""
    model = trainer_model("qwen3", num_hidden_layers=1)
    name = "model.layers.0.mlp.down_proj.weight"
    with torch.no_grad():
        model.state_dict()[name][0, 0] = 70000.0  # bf16 70144, finite
    with pytest.raises(
        ValueError,
        match=rf"{name!r} has 1 value\(s\) \(largest magnitude 70144\) beyond "
        r"float16's largest finite value 65504.*dtype=torch.bfloat16",
    ):
        Engine(model, dtype=FP16)
    Engine(model)  # bf16 serves it

    with torch.no_grad():
        model.state_dict()[name][0, 0] = 1.0
    engine = Engine(model, dtype=FP16)
    ids = sequences(engine.vocab_size, lengths=(12,))[0]
    (before,) = engine.score([ids[:3]], [ids[3:]])
    sd = {k: v.float() for k, v in model.state_dict().items()}
    for big, ok in ((65519.99, True), (65520.0, False), (-1e6, False)):
        master = sd[name].clone()
        master[1, 2] = big
        if ok:
            engine.load_weights(dict(sd, **{name: master}))
            assert engine.weights.state_dict()[name][1, 2].item() == 65504.0
        else:
            with pytest.raises(ValueError, match="would be served as inf"):
                engine.load_weights(dict(sd, **{name: master}))
    engine.load_weights(sd)
    (after,) = engine.score([ids[:3]], [ids[3:]])
    assert_bitwise_equal(after, before)
    # a failed load leaves the served copy as it was, also the tensors listed before the bad one
    bad = {k: 3 * v for k, v in sd.items()}
    bad[name] = torch.full_like(sd[name], 1e5)
    with pytest.raises(ValueError, match="would be served as inf"):
        engine.load_weights(bad)
    assert_bitwise_equal(engine.score([ids[:3]], [ids[3:]])[0], before)


def test_subnormal_precision_loss_is_accepted():
    """bf16 values below fp16's normal range (2^-14) are served as fp16 subnormals, rounded to the nearest multiple
    of 2^-24 (ties to even; reference from float64 arithmetic, not a cast), or to zero: accepted, as an fp16 engine
    casts them too."""
    model = trainer_model("qwen3", num_hidden_layers=1)
    name = "model.layers.0.self_attn.o_proj.weight"
    g = torch.Generator().manual_seed(0)
    tiny = torch.rand(200, generator=g) * 2.0**-14 * torch.exp2(-torch.randint(0, 14, (200,), generator=g).float())
    tiny = tiny.to(torch.bfloat16)
    with torch.no_grad():
        model.state_dict()[name].view(-1)[:200] = tiny
    engine = Engine(model, dtype=FP16)
    served = engine.weights.state_dict()[name].view(-1)[:200]
    want = torch.round(tiny.double() / 2.0**-24) * 2.0**-24  # torch.round: half to even
    assert torch.equal(served.double(), want)
    assert (served.double() != tiny.double()).any() and (served == 0).any()  # precision really was lost
