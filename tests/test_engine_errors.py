"""Loading from a directory, and every documented bad input: each a clear error that names the problem and the fix.

Also: a model saved with ``save_pretrained`` loads with its tokenizer and serves the same numbers as the in-memory
model; ``load_weights`` checks everything before it changes anything, and rounds fp32 masters to bf16 (RNE).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from roundalign.engine import Engine, SamplingParams
from tests.helpers import assert_bitwise_equal
from tests.test_engine_matches_trainer import sequences, trainer_model


@pytest.fixture(scope="module")
def model():
    return trainer_model("qwen3", num_hidden_layers=1)


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, profile="vllm")


def _tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(vocab - 1)}
    words["[UNK]"] = vocab - 1
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


@pytest.fixture(scope="module")
def model_dir(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3")
    model.save_pretrained(path)
    _tokenizer(model.config.vocab_size).save_pretrained(path)
    return path


# --------------------------------------------------------------------------------------------------------------
# loading


def test_directory_loads_with_tokenizer_and_equals_the_in_memory_model(model_dir, engine):
    from_dir = Engine(model_dir, profile="vllm")
    assert from_dir.tokenizer is not None and engine.tokenizer is None
    ids = sequences(engine.vocab_size, lengths=(12,))[0]
    assert_bitwise_equal(from_dir.score([ids[:4]], [ids[4:]])[0], engine.score([ids[:4]], [ids[4:]])[0])
    (out,) = from_dir.generate(["w1 w2 w3"], SamplingParams(temperature=0, max_tokens=4))
    assert out.prompt_token_ids == [1, 2, 3] and len(out.token_ids) == 4
    assert out.text == from_dir.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist.*save_pretrained"):
        Engine(tmp_path / "nope")


def test_directory_without_config(tmp_path):
    with pytest.raises(ValueError, match="has no config.json.*save_pretrained"):
        Engine(tmp_path)


def test_corrupt_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read .*config.json"):
        Engine(tmp_path)


def test_missing_and_corrupt_safetensors(model_dir, tmp_path):
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=r"no \*.safetensors weights"):
        Engine(tmp_path)
    good = (model_dir / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match="corrupt or unreadable weights file .*model.safetensors"):
        Engine(tmp_path)


def test_unsupported_family_names_the_supported_ones_and_the_jsonl_import(tmp_path):
    cfg = transformers.Qwen3MoeConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
        num_experts=2,
    )
    with pytest.raises(ValueError, match=r"qwen3, qwen2, llama.*'qwen3_moe'.*--engine-logprobs"):
        Engine(transformers.AutoModelForCausalLM.from_config(cfg))
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="qwen3_moe"):
        Engine(tmp_path)


def test_sliding_window_is_refused():
    with pytest.raises(ValueError, match="sliding-window"):
        Engine(trainer_model("qwen2", num_hidden_layers=1, use_sliding_window=True, max_window_layers=0))


def test_unknown_profile_and_backend(model):
    with pytest.raises(ValueError, match="unknown profile 'vlm'"):
        Engine(model, profile="vlm")
    with pytest.raises(ValueError, match="unknown engine backend 'cuda'; choose one of kernels, inductor"):
        Engine(model, backend="cuda")
    with pytest.raises(TypeError, match="HF \\*ForCausalLM or a model directory"):
        Engine(42)
    with pytest.raises(TypeError, match="got Qwen3Model; pass the causal-LM model"):
        Engine(model.model)


# --------------------------------------------------------------------------------------------------------------
# prompts and score arguments


def test_bad_prompts(engine):
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 512\)"):
        engine.generate([[1, 512]])
    with pytest.raises(ValueError, match=r"outside the vocabulary"):
        engine.generate([[-1]])
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []])
    with pytest.raises(TypeError, match="non-empty list of prompts"):
        engine.generate([])
    with pytest.raises(ValueError, match="string prompts need a tokenizer"):
        engine.generate(["hello"])
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.generate([[1]], {"max_tokens": 3})


def test_bad_score_arguments(engine):
    with pytest.raises(ValueError, match="unknown score mode 'train'"):
        engine.score([[1]], [[2]], mode="train")
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        engine.score([[1], [2]], [[3]])
    with pytest.raises(ValueError, match="completion 0 is empty"):
        engine.score([[1]], [[]])
    with pytest.raises(ValueError, match="unknown prefill_shaped part"):
        engine.score([[1]], [[2]], mode="decode", prefill_shaped=("softmax",))
    with pytest.raises(ValueError, match="mode='decode' only"):
        engine.score([[1]], [[2]], mode="prefill", prefill_shaped=("attention",))


def test_prefill_shaped_needs_the_kernels_backend(model):
    inductor = Engine(model, backend="inductor")  # nothing compiles before the first forward
    with pytest.raises(ValueError, match="needs the kernels backend"):
        inductor.score([[1]], [[2]], mode="decode", prefill_shaped=("matmul",))


# --------------------------------------------------------------------------------------------------------------
# load_weights


def test_load_weights_errors_name_the_tensor_and_change_nothing(model, engine):
    ids = sequences(engine.vocab_size, lengths=(10,))[0]
    (before,) = engine.score([ids[:3]], [ids[3:]])
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="unknown sync mode 'round-down'; supported: rne, stochastic, error-feedback"):
        engine.load_weights(sd, sync="round-down")
    with pytest.raises(TypeError, match="pass the fp32 master"):  # engine-side SR rounds fp32 masters only
        engine.load_weights(sd, sync="stochastic")
    bad = dict(sd, **{"model.layers.0.self_attn.q_proj.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.q_proj.weight' has shape \(3, 3\)"):
        engine.load_weights(bad)
    with pytest.raises(ValueError, match=r"unknown tensor name\(s\) \['module.lm_head.weight'\]"):
        engine.load_weights(dict(sd, **{"module.lm_head.weight": sd["lm_head.weight"]}))
    missing = {k: v for k, v in sd.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match=r"missing tensor\(s\) \['model.norm.weight'\]"):
        engine.load_weights(missing)
    with pytest.raises(TypeError, match="'model.norm.weight' must be a floating-point"):
        engine.load_weights(dict(sd, **{"model.norm.weight": sd["model.norm.weight"].int()}))
    # a failed load leaves the served copy as it was: a bad tensor listed last does not half-apply the others
    doubled = {k: 2 * v for k, v in sd.items()}
    doubled["model.norm.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="model.norm.weight"):
        engine.load_weights(doubled)
    (after,) = engine.score([ids[:3]], [ids[3:]])
    assert_bitwise_equal(after, before)


def test_load_weights_rounds_fp32_masters_to_nearest_even(model):
    """fp32 masters halfway between two bf16 neighbours, and a quarter of the way: RNE picks the even neighbour
    at a tie and the nearer one otherwise (reference from the bit patterns, not from a cast)."""
    engine = Engine(model, profile="vllm")
    sd = {k: v.float() for k, v in model.state_dict().items()}
    name = "model.layers.0.mlp.down_proj.weight"
    bf16 = model.state_dict()[name].flatten()
    pos = torch.nonzero(bf16 > 0).flatten()  # positive values: the bf16 neighbour above is bits + 1
    low = bf16[pos]
    high = (low.view(torch.int16) + 1).view(torch.bfloat16)
    even = torch.where(low.view(torch.int16) % 2 == 0, low, high)
    for frac, expected in ((0.5, even), (0.25, low), (0.75, high)):
        master = sd[name].clone()
        master.view(-1)[pos] = low.float() + frac * (high.float() - low.float())  # exact in fp32
        engine.load_weights(dict(sd, **{name: master}))
        served = engine.weights.state_dict()[name].flatten()[pos]
        assert_bitwise_equal(served, expected, f"{frac} of the way up")
    assert not torch.equal(even, low) and not torch.equal(even, high)  # the ties test both directions


def test_tied_lm_head_may_be_left_out_but_must_agree():
    model = trainer_model("llama", num_hidden_layers=1, tie_word_embeddings=True)
    engine = Engine(model)
    sd = dict(model.state_dict())
    engine.load_weights({k: v for k, v in sd.items() if k != "lm_head.weight"})
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1
    with pytest.raises(ValueError, match="tie_word_embeddings is set but 'lm_head.weight' differs"):
        engine.load_weights(sd)


def test_engine_attributes(model):
    engine = Engine(model, profile="sglang")
    assert engine.config is model.config and engine.max_model_len == model.config.max_position_embeddings
    assert engine.profile.name == "sglang" and engine.backend == "kernels" and engine.tokenizer is None
