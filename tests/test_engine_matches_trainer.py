"""The key acceptance test: the engine's kernels backend equals the patched trainer bit for bit, one sequence at a time.

When the trainer's profile is the engine's, ``Engine.score(mode="prefill")`` (each sequence alone, one forward over
prompt + completion) must give exactly ``roundalign.apply(hf_model, profile)``'s teacher-forced log-probs,
``hf_model(ids[None]).logits[0].float().log_softmax(-1)``. The two share no model code: the engine has its own
served weights, layer loop, residual carrying, cos/sin cache and attention; only the element-wise formulas
(``roundalign.ops``) are common, and those are what a profile claims the engine computes. So equality here is
evidence that the engine's structure (matmul shapes, attention call, RoPE angles, residual rule) is the trainer's.

The trainer runs HF's sdpa attention, loaded the ``from_pretrained(dtype=bf16)`` way, so its inv_freq is fp32 (a
model cast with ``.to(bf16)`` keeps a bf16 inv_freq that stock HF then uses; ``apply`` recomputes it in fp32).
"""

from __future__ import annotations

import pytest
import torch
import transformers

import roundalign
from roundalign.engine import Engine
from tests.cpu_kernels import gemm_rows_matter
from tests.helpers import assert_bitwise_equal
from tests.vllm_native import realistic_init

PROFILES = ("vllm", "sglang", "hf", "aligned")
CASES = [("qwen3", p) for p in PROFILES] + [(f, p) for f in ("qwen2", "llama") for p in ("hf", "vllm", "sglang")]

_SIZES = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
)
_CONFIGS = {"qwen3": transformers.Qwen3Config, "qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig}


def trainer_model(family: str = "qwen3", seed: int = 0, **overrides):
    """A random bf16 ``*ForCausalLM`` with sdpa attention and weights at realistic scale (head_dim 64)."""
    kw = dict(_SIZES, **({"head_dim": 64} if family == "qwen3" else {}))
    kw.update(overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        _CONFIGS[family](**kw), dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    return realistic_init(model, seed)


def sequences(vocab: int, lengths=(5, 23, 64), seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def trainer_logprobs(model, ids: list[int]) -> torch.Tensor:
    """Teacher-forced log-probs of every position, as a trainer computes them: (tokens, vocab), fp32."""
    with torch.no_grad():
        return model(torch.tensor(ids)[None]).logits[0].float().log_softmax(-1)


def _check_engine_equals_trainer(model, profile: str, seqs, split: int = 3, engine: Engine | None = None):
    # Built before apply: the engine copies the HF weights, it never runs the patched model.
    engine = engine or Engine(model, profile=profile)
    roundalign.apply(model, profile)
    try:
        for ids in seqs:
            prompt, completion = ids[:split], ids[split:]
            ref = trainer_logprobs(model, ids)[split - 1 : -1].gather(1, torch.tensor(completion)[:, None])[:, 0]
            (got,) = engine.score([prompt], [completion], mode="prefill")
            assert_bitwise_equal(got, ref, f"{model.config.model_type}/{profile}, {len(ids)} tokens")
    finally:
        roundalign.revert(model)


@pytest.mark.parametrize("family,profile", CASES)
def test_engine_matches_trainer(family, profile):
    model = trainer_model(family)
    _check_engine_equals_trainer(model, profile, sequences(model.config.vocab_size))


@pytest.mark.parametrize("profile", ["hf", "vllm"])
def test_engine_matches_trainer_rope_scaled_tied_llama(profile):
    """llama3 RoPE scaling (inv_freq from the config, as engines compute it) and tied embeddings."""
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    model = trainer_model("llama", rope_parameters=rope, tie_word_embeddings=True, num_hidden_layers=2)
    _check_engine_equals_trainer(model, profile, sequences(model.config.vocab_size, lengths=(40, 200)))


def test_profiles_are_told_apart():
    """Sensitivity: the engine under one profile differs from the trainer under another on most tokens, so the
    equalities above are not an accident of the model."""
    model = trainer_model("qwen3")
    ids = sequences(model.config.vocab_size, lengths=(64,))[0]
    (engine_vllm,) = Engine(model, profile="vllm").score([ids[:3]], [ids[3:]], mode="prefill")
    stock = trainer_logprobs(model, ids)[2:-1].gather(1, torch.tensor(ids[3:])[:, None])[:, 0]
    equal = (engine_vllm == stock).float().mean().item()
    print(f"engine(vllm) vs stock HF trainer: {equal:.1%} of log-probs bitwise equal")
    assert equal < 0.5


@pytest.mark.parametrize("family,profile", [("qwen3", "hf"), ("qwen3", "vllm"), ("qwen2", "sglang"), ("llama", "vllm")])
def test_hidden_states_match_trainer(family, profile):
    """``hidden_states``: R after every layer, bitwise HF's ``output_hidden_states[1:-1]`` and the last layer's
    output (before the final norm, captured with a hook) of the patched trainer."""
    model = trainer_model(family)
    ids = sequences(model.config.vocab_size, lengths=(37,))[0]
    engine = Engine(model, profile=profile)
    got = engine.hidden_states(ids)
    roundalign.apply(model, profile)
    last = []
    # An aligned layer returns R, or the pair (R, S) whose first element is R: what HF records.
    hook = model.model.layers[-1].register_forward_hook(
        lambda m, i, o: last.append(o[0] if isinstance(o, tuple) else o)
    )
    try:
        with torch.no_grad():
            out = model(torch.tensor(ids)[None], output_hidden_states=True)
    finally:
        hook.remove()
        roundalign.revert(model)
    ref = [h[0] for h in out.hidden_states[1:-1]] + [last[0][0]]
    assert len(got) == model.config.num_hidden_layers == len(ref)
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert g.dtype == torch.bfloat16 and g.shape == (len(ids), model.config.hidden_size)
        assert_bitwise_equal(g, r, f"layer {i}")


def test_engine_keeps_its_own_copy_of_the_weights():
    """Changing the HF model after building the engine changes nothing until load_weights."""
    model = trainer_model("qwen3")
    ids = sequences(model.config.vocab_size, lengths=(20,))[0]
    engine = Engine(model, profile="vllm")
    (before,) = engine.score([ids[:3]], [ids[3:]])
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    (same,) = engine.score([ids[:3]], [ids[3:]])
    assert_bitwise_equal(same, before)
    engine.load_weights(model.state_dict())
    (after,) = engine.score([ids[:3]], [ids[3:]])
    assert not torch.equal(after, before)
    _check_engine_equals_trainer(model, "vllm", [ids], engine=engine)


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_engine_matches_trainer_when_gemm_rows_depend_on_the_row_count(family):
    """The equality rests on the same GEMM calls (one sequence, all its rows), not on row-invariant kernels: it holds
    under an emulated GEMM whose rows change with the call's row count (Intel AMX's behaviour, exaggerated)."""
    model = trainer_model(family)
    with gemm_rows_matter():
        _check_engine_equals_trainer(model, "vllm", sequences(model.config.vocab_size))
