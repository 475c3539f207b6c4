"""Build and train the tiny Qwen3 that ships in the package (src/roundalign/models/tiny-qwen3).

    .venv/bin/python scripts/train_tiny_model.py                       # the shipped model (about 12 min, 2 cores)
    .venv/bin/python scripts/train_tiny_model.py --steps 50 --out /tmp/m   # a quick look
    .venv/bin/python scripts/train_tiny_model.py --check-reproducible --steps 3   # two runs, byte-identical?

Why a trained model: roundalign's probe audits the trainer-vs-engine log-prob mismatch, and a random model's
near-uniform next-token distributions hide what rounding does to a real LM's peaked ones. Training also moves the
RMSNorm weights away from their initial ones, so a rule that multiplies by the weight before or after rounding
really differs.

What it does:
1. Builds a word-level tokenizer over the closed vocabulary of roundalign.tasks.arithmetic: every word of the
   templates with and without its leading space, digits one per token (so the model adds digit by digit), the
   punctuation, `<|endoftext|>` (end of text, also the pad) and `<|unk|>`.
2. Trains a Qwen3 in fp32 on freshly generated word problems (prompt + worked solution + end-of-text), packed a
   few to a row, loss on every real token. AdamW, linear warm-up then cosine decay. Easy problems are the largest
   share of the mix. Held-out evaluation prompts never appear in training.
3. Saves it in bf16 as a standard HF directory, then evaluates the SAVED bf16 weights: mean per-token entropy on
   held-out problems against log(vocab), and greedy accuracy per level.

Deterministic: one seed sets the torch seed and the problem stream; 2 threads; torch.use_deterministic_algorithms.
The same --steps and --seed on the same machine and software give byte-identical weights (see
--check-reproducible); another CPU or torch build may sum in another order. --minutes is only a guard: a run that
reaches it stops early, says so, and is not the reproducible model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # run from a checkout without installing

from roundalign.tasks import arithmetic  # noqa: E402
from roundalign.tasks.arithmetic import EOS_TEXT, LEVELS, format_prompt, make_problems  # noqa: E402

DEFAULT_OUT = REPO / "src" / "roundalign" / "models" / "tiny-qwen3"
UNK_TEXT = "<|unk|>"
# A piece is a word or a digit or a punctuation mark, each with its leading space if it has one; other whitespace
# is a piece of its own. Decoding just concatenates pieces, so text made of known pieces round-trips exactly.
PIECES = r" ?[A-Za-z]+| ?[0-9]| ?[^A-Za-z0-9\s]|\s"
PUNCTUATION = ".,:?'+-*/="
LEVEL_SHARES = {1: 0.4, 2: 0.35, 3: 0.25}  # share of each level in a batch: easy ones most, hard ones least
ROW_WIDTH = 128  # tokens per training row; the longest problem with its solution is about 100
HELD_OUT = 200  # held-out problems a level: never trained on; evaluation uses the first --eval-problems of them


# -----------------------------------------------------------------------------
# Tokenizer and model config


def build_tokenizer() -> transformers.PreTrainedTokenizerFast:
    words = arithmetic.vocabulary_words() + list("0123456789") + list(PUNCTUATION)
    pieces = sorted({p for w in words for p in (w, " " + w)}) + [" ", "\n"]
    vocab = {EOS_TEXT: 0, UNK_TEXT: 1} | {p: i + 2 for i, p in enumerate(pieces)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TEXT))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(PIECES), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TEXT,
        pad_token=EOS_TEXT,
        unk_token=UNK_TEXT,
        clean_up_tokenization_spaces=False,  # decoding must give back " 12." exactly, not a "cleaned" variant
        model_max_length=256,
    )


def build_config(vocab_size: int, eos_id: int) -> transformers.Qwen3Config:
    return transformers.Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,  # 64 or 128: one engine profile's RoPE rule depends on it
        intermediate_size=768,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,  # a separate lm_head, as in the larger Qwen3 checkpoints
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


# -----------------------------------------------------------------------------
# Data. Training packs several problems into each row, each ending with end-of-text: far less padding than one
# problem a row, and every row's first problem starts at position 0, as a prompt does at inference.


def held_out(seed: int, n_per_level: int = HELD_OUT) -> dict[int, list[arithmetic.Problem]]:
    """Evaluation problems, the first ``n_per_level`` of each level's fixed held-out set.

    Training always leaves out the whole set (``HELD_OUT`` a level), whatever --eval-problems says: the weights must
    not depend on how much is evaluated. Their seed stream is disjoint from training's (training seeds are >= 0).
    """
    return {level: make_problems(n_per_level, level, seed=-1 - seed) for level in LEVELS}


def held_out_prompts(seed: int) -> set[str]:
    return {p.prompt for problems in held_out(seed).values() for p in problems}


def _tokens(tok, problem) -> list[int]:
    return tok(format_prompt(problem) + problem.solution, add_special_tokens=False).input_ids + [tok.eos_token_id]


def _rows_to_tensors(tok, rows: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), right-padded to ``width``, labels -100 on padding."""
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, : len(row)] = torch.tensor(row)
    return ids, labels


def encode_rows(tok, problems) -> tuple[torch.Tensor, torch.Tensor]:
    """One problem a row, from position 0 (evaluation)."""
    rows = [_tokens(tok, p) for p in problems]
    return _rows_to_tensors(tok, rows, max(len(r) for r in rows))


def training_batch(tok, step: int, seed: int, exclude: set[str], problems_per_step: int, width: int = ROW_WIDTH):
    """The packed rows of one step: a fixed share per level, drawn from a seed that depends only on (seed, step)."""
    problems = []
    for level, share in LEVEL_SHARES.items():
        count = round(problems_per_step * share)
        drawn = make_problems(count + 4, level, seed=seed * 1_000_003 + step)
        problems += [p for p in drawn if p.prompt not in exclude][:count]
    random.Random(f"{seed}/{step}").shuffle(problems)  # mix the levels within rows
    rows = [[]]
    for doc in (_tokens(tok, p) for p in problems):
        if len(doc) > width:
            raise ValueError(f"a problem of {len(doc)} tokens does not fit a row of {width}")
        if len(rows[-1]) + len(doc) > width:
            rows.append([])
        rows[-1] += doc
    return _rows_to_tensors(tok, rows, width)


# -----------------------------------------------------------------------------
# Training


def train(tok, steps: int, seed: int, batch_size: int, lr: float, minutes: float | None, exclude: set[str], log=print):
    torch.manual_seed(seed)
    config = build_config(len(tok), tok.eos_token_id)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    # No weight decay on norms: pulling their weights toward 0 would fight the very variation the audit needs.
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.98))  # fmt: skip
    warmup = max(1, min(100, steps // 10))

    def lr_at(step: int) -> float:  # linear warm-up, then cosine down to a tenth
        if step < warmup:
            return lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    start, losses, done = time.time(), [], steps
    model.train()
    for step in range(steps):
        ids, labels = training_batch(tok, step, seed, exclude, batch_size)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            log(f"step {step:5d}/{steps}  loss {loss.item():.4f}  lr {lr_at(step):.2e}  {time.time() - start:6.0f} s")
        if minutes is not None and time.time() - start > 60 * minutes and step < steps - 1:
            log(f"WARNING: stopped at step {step + 1} of {steps}: --minutes {minutes} reached, not reproducible")
            done = step + 1
            break
    final_loss = sum(losses[-50:]) / len(losses[-50:])
    return model, {"steps_done": done, "final_loss_last50": final_loss, "train_wall_s": time.time() - start}


def save(model, tok, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)  # the shipped weights are bf16: this is their one rounding point
    model.config.dtype = torch.bfloat16
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, do_sample=False, max_new_tokens=64
    )
    model.save_pretrained(out)
    tok.save_pretrained(out)


# -----------------------------------------------------------------------------
# Evaluation of the saved bf16 directory


@torch.no_grad()
def evaluate(out: Path, problems: dict[int, list[arithmetic.Problem]], batch_size: int = 100) -> dict:
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    assert next(model.parameters()).dtype == torch.bfloat16

    # Entropy of the next-token distribution at every position that predicts a real token.
    total = {"all": [0.0, 0], "completion": [0.0, 0]}
    for items in problems.values():
        for i in range(0, len(items), batch_size):
            chunk = items[i : i + batch_size]
            ids, labels = encode_rows(tok, chunk)
            logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)[:, :-1]
            entropy = -(logp.exp() * logp).sum(-1)  # (B, T-1), position t predicts token t+1
            real = labels[:, 1:] != -100
            prompt_len = torch.tensor([len(tok(format_prompt(p)).input_ids) for p in chunk])
            predicts_completion = torch.arange(ids.shape[1] - 1)[None] >= (prompt_len[:, None] - 1)
            for key, mask in (("all", real), ("completion", real & predicts_completion)):
                total[key][0] += entropy[mask].sum().item()
                total[key][1] += int(mask.sum())
    figures = {"vocab_size": len(tok), "log_vocab": math.log(len(tok))}
    figures["entropy_all_tokens"] = total["all"][0] / total["all"][1]
    figures["entropy_completion_tokens"] = total["completion"][0] / total["completion"][1]

    # Greedy accuracy per level, decoding with the saved generation config (stops at end-of-text).
    tok.padding_side = "left"
    for level, items in problems.items():
        correct = 0
        for i in range(0, len(items), batch_size):
            chunk = items[i : i + batch_size]
            enc = tok([format_prompt(p) for p in chunk], return_tensors="pt", padding=True)
            gen = model.generate(**enc, do_sample=False, max_new_tokens=64)
            texts = tok.batch_decode(gen[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
            correct += sum(arithmetic.reward(t, p) for t, p in zip(texts, chunk, strict=True))
        figures[f"greedy_accuracy_level{level}"] = correct / len(items)

    norms = [m.weight.float() for n, m in model.named_modules() if n.endswith("norm")]
    weights = torch.cat([w.flatten() for w in norms])
    figures["norm_weight_min_max_std"] = [weights.min().item(), weights.max().item(), weights.std().item()]
    figures["size_bytes"] = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    return figures


# -----------------------------------------------------------------------------
# Model card and command line


def model_card(figures: dict, args: argparse.Namespace) -> str:
    acc = " / ".join(f"{100 * figures[f'greedy_accuracy_level{level}']:.0f}%" for level in LEVELS)
    low, high, std = figures["norm_weight_min_max_std"]
    return f"""# tiny-qwen3

A {figures["params"] / 1e6:.2f}M-parameter Qwen3 (bf16) trained from scratch on the arithmetic word problems of
`roundalign.tasks.arithmetic`. It lets `roundalign probe` audit log-prob mismatch on a model whose next-token
distributions are peaked, as a real LM's are. It is of no use as a language model outside that task.

- Architecture: `Qwen3ForCausalLM`, hidden 256, 4 layers, 4 query heads and 2 KV heads of head_dim 64, MLP 768,
  RoPE theta 10000, RMSNorm eps 1e-6, untied lm_head, max 256 positions.
- Tokenizer: word level over the task's closed vocabulary ({figures["vocab_size"]} tokens), one token per digit.
  `<|endoftext|>` (id 0) is both end of text and pad.
- Trained by `scripts/train_tiny_model.py --seed {args.seed} --steps {args.steps}`: fp32, AdamW, {args.batch_size}
  problems a step, lr {args.lr}, cosine decay. Saved in bf16; the figures below were measured on the saved weights.
- How to regenerate it, and what the figures mean: docs/tiny-model.md in the roundalign repository.

| figure | value |
|---|---|
| steps done | {figures["steps_done"]} |
| training loss (mean of the last 50 steps) | {figures["final_loss_last50"]:.3f} |
| mean next-token entropy, held-out problems, all tokens | {figures["entropy_all_tokens"]:.3f} nats |
| ... on the completion tokens only | {figures["entropy_completion_tokens"]:.3f} nats |
| log(vocab) (a uniform distribution) | {figures["log_vocab"]:.3f} nats |
| greedy accuracy, level 1 / 2 / 3 ({args.eval_problems} held-out problems each) | {acc} |
| RMSNorm weights: min / max / std (all start at 1) | {low:.3f} / {high:.3f} / {std:.3f} |
| wall time of training / whole run | {figures["train_wall_s"] / 60:.1f} / {figures["run_wall_s"] / 60:.1f} min |
| CPU time (user + sys) of the whole run | {figures["cpu_s"] / 60:.1f} min on {figures["threads"]} threads |
| weights + tokenizer files | {figures["size_bytes"] / 1e6:.2f} MB |

The times come from one run on a 2-core CPU machine shared with other work, so wall time depends on the load.
CPU time / 2 is the standalone estimate. The entropy over all tokens includes the prompt's genuinely random
choices (names, numbers). The completion tokens are the ones that the probe and RL score.
"""


def _train_and_save(tok, args, out: Path) -> dict:
    exclude = held_out_prompts(args.seed)
    model, stats = train(tok, args.steps, args.seed, args.batch_size, args.lr, args.minutes, exclude)
    stats["params"] = sum(p.numel() for p in model.parameters())
    save(model, tok, out)
    return stats


def check_reproducible(tok, args) -> int:
    digests = []
    for run in range(2):
        with tempfile.TemporaryDirectory() as tmp:
            _train_and_save(tok, args, Path(tmp))
            digests.append(hashlib.sha256((Path(tmp) / "model.safetensors").read_bytes()).hexdigest())
            print(f"run {run + 1}: model.safetensors sha256 {digests[-1]}")
    same = digests[0] == digests[1]
    print("reproducible: identical weights" if same else "NOT reproducible: the two runs' weights differ")
    return 0 if same else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="model directory (default: the package's)")
    parser.add_argument("--steps", type=int, default=1400, help="optimizer steps (default 1400, about 12 min)")
    parser.add_argument("--minutes", type=float, default=None, help="stop training early past this wall time (a guard)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=64, help="problems per step, packed into rows")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    evaluated = f"held-out problems per level to evaluate, 0 to {HELD_OUT} (0: none)"
    parser.add_argument("--eval-problems", type=int, default=HELD_OUT, help=evaluated)
    parser.add_argument("--check-reproducible", action="store_true", help="train twice (no eval), compare weights")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 3:
        parser.error("--steps must be >= 1 and --batch-size >= 3 (one problem of each level at least)")
    if not 0 <= args.eval_problems <= HELD_OUT:
        parser.error(f"--eval-problems must be between 0 and {HELD_OUT}, the size of the held-out set")

    torch.set_num_threads(2)  # the thread count changes CPU matmul summation order, so it is part of the recipe
    torch.use_deterministic_algorithms(True)
    print(json.dumps({k: str(v) for k, v in vars(args).items()}))
    tok = build_tokenizer()
    if args.check_reproducible:
        return check_reproducible(tok, args)

    evaluation = held_out(args.seed, args.eval_problems)
    sample = [format_prompt(p) + p.solution for level in LEVELS for p in make_problems(2000, level, seed=12345)]
    unknown = sum(tok(text).input_ids.count(tok.unk_token_id) for text in sample)
    if unknown or tok.decode(tok(sample[0]).input_ids) != sample[0]:
        raise RuntimeError(f"tokenizer does not cover the task ({unknown} unknown pieces) or does not round-trip")

    start = time.time()
    stats = _train_and_save(tok, args, args.out)
    figures = dict(stats, threads=torch.get_num_threads())
    if args.eval_problems:
        figures |= evaluate(args.out, evaluation)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    figures["run_wall_s"], figures["cpu_s"] = time.time() - start, usage.ru_utime + usage.ru_stime
    print(json.dumps(figures, indent=1))
    if args.eval_problems:
        (args.out / "README.md").write_text(model_card(figures, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
