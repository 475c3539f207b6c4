"""The models that ship in the package: they load offline in bf16, are small, are peaked, and solve problems.

tiny-qwen3: thresholds are the figures measured on the shipped weights (docs/tiny-model.md) less a margin, so these
tests catch a broken or badly retrained model without pinning exact numbers. The entropy is computed here from the
logits, from its definition. tiny-llama-chars: its greedy rewards on the held-out items are read from its model
card and recomputed here.
"""

import math
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

import roundalign.models
from roundalign.tasks import LEVELS, extract_answer, format_prompt, make_problems, reward

REPO = Path(__file__).resolve().parents[1]
EVAL_SEED = 424242  # not the training script's held-out seed: a fresh draw
# Measured on the shipped weights (200 held-out problems a level): greedy accuracy 100% / 99% / 55% for levels
# 1 / 2 / 3, completion entropy 0.041 nats, norm-weight std 0.098. The bounds below leave a margin for a draw of 60
# problems (one binomial standard deviation is about 6 points at 55%).
EASY_AT_LEAST, MEDIUM_AT_LEAST, HARD_BETWEEN = 0.9, 0.85, (0.3, 0.8)  # hard ones sometimes: room left for RL
COMPLETION_ENTROPY_BELOW = 0.15  # nats; log(264) = 5.58
NORM_WEIGHT_STD_ABOVE = 0.05


@pytest.fixture(scope="module")
def shipped():
    path = roundalign.models.path("tiny-qwen3")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, local_files_only=True)
    return tokenizer, model.eval()


def test_path_and_listing():
    path = roundalign.models.path()
    assert path == roundalign.models.path("tiny-qwen3") and path.is_dir()
    assert {"tiny-qwen3", "tiny-llama-chars"} <= set(roundalign.models.list_models())
    with pytest.raises(ValueError, match="tiny-llama-chars, tiny-qwen3"):  # the message lists what ships
        roundalign.models.path("tiny-llama")
    with pytest.raises(ValueError, match="no shipped model"):
        roundalign.models.path("..")


def test_missing_files_say_how_to_regenerate(tmp_path, monkeypatch):
    (tmp_path / "tiny-qwen3").mkdir()
    (tmp_path / "tiny-qwen3" / "config.json").write_text("{}")
    (tmp_path / "tiny-llama-chars").mkdir()
    monkeypatch.setattr(roundalign.models, "_HERE", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"model.safetensors.*train_tiny_model.py"):
        roundalign.models.path("tiny-qwen3")
    with pytest.raises(FileNotFoundError, match=r"config.json.*train_gym_model.py"):
        roundalign.models.path("tiny-llama-chars")


def test_small_enough_to_ship_and_stored_in_bf16():
    path = roundalign.models.path()
    total = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert total <= 20 * 1024 * 1024, f"{total / 2**20:.1f} MiB"
    with safe_open(path / "model.safetensors", framework="pt") as f:
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes == {"BF16"}


def test_loads_as_bf16_qwen3(shipped):
    tokenizer, model = shipped
    assert isinstance(model, transformers.Qwen3ForCausalLM)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    config = model.config
    assert config.head_dim in (64, 128)  # an engine profile's RoPE rule depends on it
    assert config.vocab_size == len(tokenizer)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == tokenizer.pad_token_id


def test_tokenizer_round_trips_prompts_and_completions(shipped):
    tokenizer, _ = shipped
    for level in LEVELS:
        for problem in make_problems(20, level, seed=EVAL_SEED):
            text = format_prompt(problem) + problem.solution + tokenizer.eos_token
            ids = tokenizer(text).input_ids
            assert tokenizer.unk_token_id not in ids
            assert ids[-1] == tokenizer.eos_token_id
            assert tokenizer.decode(ids) == text
            assert extract_answer(tokenizer.decode(ids, skip_special_tokens=True)) == problem.answer
    digits = tokenizer(" 1234").input_ids  # one token per digit, so the model works digit by digit
    assert len(digits) == 4 and tokenizer.decode(digits) == " 1234"


def _norm_weights(model) -> torch.Tensor:
    weights = [m.weight.float().flatten() for name, m in model.named_modules() if name.endswith("norm")]
    return torch.cat(weights)


def test_norm_weights_were_moved_by_training(shipped):
    weights = _norm_weights(shipped[1])
    assert weights.numel() > 0 and weights.std() > NORM_WEIGHT_STD_ABOVE and (weights != 1).float().mean() > 0.5


@torch.no_grad()
def test_next_token_distributions_are_peaked(shipped):
    """Mean entropy of the next-token distribution over the completion tokens, far below log(vocab)."""
    tokenizer, model = shipped
    total, count = 0.0, 0
    for level in LEVELS:
        for problem in make_problems(8, level, seed=EVAL_SEED):
            prompt = tokenizer(format_prompt(problem)).input_ids
            full = prompt + tokenizer(problem.solution).input_ids + [tokenizer.eos_token_id]
            logits = model(input_ids=torch.tensor([full])).logits[0].float()
            probs = torch.softmax(logits, dim=-1)[len(prompt) - 1 : -1]  # the positions that predict the completion
            entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
            total, count = total + entropy.sum().item(), count + entropy.numel()
    mean, uniform = total / count, math.log(len(tokenizer))
    assert mean < COMPLETION_ENTROPY_BELOW < 0.05 * uniform, f"mean entropy {mean:.3f} nats, log(vocab) {uniform:.3f}"


@torch.no_grad()
def test_greedy_solves_easy_problems_often_and_hard_ones_sometimes(shipped):
    tokenizer, model = shipped
    tokenizer.padding_side = "left"
    accuracy = {}
    for level in LEVELS:
        problems = make_problems(60, level, seed=EVAL_SEED)
        enc = tokenizer([format_prompt(p) for p in problems], return_tensors="pt", padding=True)
        out = model.generate(**enc, do_sample=False, max_new_tokens=64)
        texts = tokenizer.batch_decode(out[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
        accuracy[level] = sum(reward(t, p) for t, p in zip(texts, problems, strict=True)) / len(problems)
    assert accuracy[1] >= EASY_AT_LEAST and accuracy[2] >= MEDIUM_AT_LEAST, accuracy
    assert HARD_BETWEEN[0] <= accuracy[3] <= HARD_BETWEEN[1], accuracy


def test_training_script_is_reproducible():
    """Two short runs of the training script give byte-identical weights (the script compares their sha256)."""
    script = REPO / "scripts" / "train_tiny_model.py"
    result = subprocess.run([sys.executable, str(script), "--check-reproducible", "--steps", "3", "--batch-size", "8"],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "reproducible: identical weights" in result.stdout


# -----------------------------------------------------------------------------
# tiny-llama-chars: the character-level Llama trained on roundalign.tasks.gym's four domains

LLAMA = "tiny-llama-chars"
LLAMA_EVAL_SEED, LLAMA_EVAL_ITEMS = 1_000_003, 64  # scripts/train_gym_model.py's held-out items (EVAL_SEED)


@pytest.fixture(scope="module")
def llama():
    path = roundalign.models.path(LLAMA)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, local_files_only=True)
    return tokenizer, model.eval()


def _stored_params(path: Path) -> int:
    with safe_open(path / "model.safetensors", framework="pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())


def test_llama_chars_ships_within_budget_in_bf16():
    assert LLAMA in roundalign.models.list_models()
    path = roundalign.models.path(LLAMA)
    total = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert total < 20 * 1024 * 1024, f"{total / 2**20:.1f} MiB"
    with safe_open(path / "model.safetensors", framework="pt") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}
    # no larger than tiny-qwen3
    assert _stored_params(path) <= _stored_params(roundalign.models.path("tiny-qwen3"))


def test_llama_chars_loads_as_bf16_llama(llama):
    tokenizer, model = llama
    assert isinstance(model, transformers.LlamaForCausalLM)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert sum(p.numel() for p in model.parameters()) <= 3.3e6
    config = model.config
    assert config.head_dim in (32, 64)  # vLLM's CPU attention supports these (and 80, 96, 112, 128, 256)
    assert config.head_dim * config.num_attention_heads == config.hidden_size
    assert config.num_key_value_heads < config.num_attention_heads  # grouped-query attention
    assert config.max_position_embeddings == 256 and config.rms_norm_eps == 1e-5
    assert config.vocab_size == len(tokenizer)
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == config.eos_token_id == config.pad_token_id == 0
    generation = model.generation_config
    assert generation.eos_token_id == generation.pad_token_id == 0
    assert generation.do_sample is False and generation.max_new_tokens == 16


def test_llama_chars_tokenizer_round_trips_printable_ascii_exactly(llama):
    tokenizer, _ = llama
    alphabet = "\n" + "".join(chr(c) for c in range(32, 127))
    rng = random.Random(0)
    texts = ["", " ", "  two  spaces  ", "\n", "a\n\n b \n", alphabet, alphabet[::-1]]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 120))) for _ in range(300)]
    for text in texts:
        ids = tokenizer(text).input_ids
        assert len(ids) == len(text), repr(text)  # one token a character, no BOS, nothing added
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids) == text, repr(text)
    assert tokenizer("<|endoftext|>").input_ids == [0]
    assert tokenizer.decode(tokenizer(" 0.25<|endoftext|>").input_ids, skip_special_tokens=True) == " 0.25"
    assert tokenizer("\u00e9").input_ids == [tokenizer.unk_token_id]  # outside the alphabet: unknown


def _card_greedy() -> dict[str, tuple[float, float]]:
    """The card's table, per domain: (greedy reward, greedy correct), from rows | domain | reward | correct | ..."""
    card = (roundalign.models.path(LLAMA) / "README.md").read_text()
    rows = re.finditer(r"^\| ([a-z_]+) \| ([0-9.]+) \| ([0-9.]+) \|", card, flags=re.M)
    return {m[1]: (float(m[2]), float(m[3])) for m in rows}


@torch.no_grad()
def test_llama_chars_greedy_rewards_match_its_card_and_leave_room_for_rl(llama):
    """Greedy reward per domain on the held-out items, one left-padded batch a domain as the training script
    evaluates them, against the card. Every domain has items that score less than 1 and items that score more than
    others, so RL has signal everywhere (spell_backward and coin_flip give partial credit)."""
    pytest.importorskip("reasoning_gym", reason="tiny-llama-chars' tasks come from reasoning-gym (roundalign[gym])")
    from roundalign.tasks import gym

    tokenizer, model = llama
    tokenizer.padding_side = "left"
    card = _card_greedy()
    domains = gym.parse_domains(gym.DEFAULT_DOMAINS)
    assert set(card) == {d.name for d in domains}, card
    measured, exact = {}, []
    for domain in domains:
        items = gym.make_items(domain, LLAMA_EVAL_ITEMS, seed=LLAMA_EVAL_SEED)
        enc = tokenizer([it.prompt for it in items], return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc, do_sample=False, max_new_tokens=16)
        texts = tokenizer.batch_decode(out[:, enc.input_ids.shape[1] :])
        scores = [gym.score(t, it) for t, it in zip(texts, items, strict=True)]
        assert min(scores) < max(scores) and min(scores) < 1.0, (domain.name, scores)  # mixed rewards
        reward, correct = sum(scores) / len(scores), sum(s == 1.0 for s in scores) / len(scores)
        measured[domain.name] = reward, correct
        exact.append((round(reward, 3), round(correct, 3)) == card[domain.name])
        # another CPU may round a near-tie the other way: a few items' worth of slack
        slack = 3 / LLAMA_EVAL_ITEMS
        assert abs(reward - card[domain.name][0]) <= slack and abs(correct - card[domain.name][1]) <= slack, (
            measured,
            card,
        )
        assert 0.05 <= reward <= 0.95, measured
    assert any(exact), (measured, card)  # on the card's machine, all of them are exact
    assert sum(correct > 0 for _, correct in measured.values()) >= 3, measured  # most domains: some fully right


def test_gym_training_script_is_reproducible():
    """Two short runs of scripts/train_gym_model.py give byte-identical weights."""
    pytest.importorskip("reasoning_gym", reason="the training items come from reasoning-gym (roundalign[gym])")
    script = REPO / "scripts" / "train_gym_model.py"
    result = subprocess.run([sys.executable, str(script), "--check-reproducible", "--steps", "3", "--batch-size", "8"],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "reproducible: identical weights" in result.stdout
