"""The tiny Qwen3 that ships in the package: it loads offline in bf16, is small, is peaked, and solves problems.

Thresholds are the figures measured on the shipped weights (docs/tiny-model.md) less a margin, so these tests
catch a broken or badly retrained model without pinning exact numbers. The entropy is computed here from the
logits, from its definition.
"""

import math
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
    assert "tiny-qwen3" in roundalign.models.list_models()
    with pytest.raises(ValueError, match="tiny-qwen3"):  # the message lists what ships
        roundalign.models.path("tiny-llama")
    with pytest.raises(ValueError, match="no shipped model"):
        roundalign.models.path("..")


def test_missing_files_say_how_to_regenerate(tmp_path, monkeypatch):
    (tmp_path / "tiny-qwen3").mkdir()
    (tmp_path / "tiny-qwen3" / "config.json").write_text("{}")
    monkeypatch.setattr(roundalign.models, "_HERE", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"model.safetensors.*train_tiny_model.py"):
        roundalign.models.path("tiny-qwen3")


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
