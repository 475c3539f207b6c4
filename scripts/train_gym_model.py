"""Build and train tiny-llama-chars, the multi-domain model that ships in the package
(src/roundalign/models/tiny-llama-chars).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/train_gym_model.py                  # the shipped model
    OMP_NUM_THREADS=1 .venv/bin/python scripts/train_gym_model.py --steps 50 --out /tmp/m   # a quick look
    OMP_NUM_THREADS=1 .venv/bin/python scripts/train_gym_model.py --check-reproducible --steps 3   # identical twice?

Why: multi-domain RL (roundalign.tasks.gym) needs a policy whose reward is neither 0 nor 1 in every domain, so that
groups of samples have mixed rewards everywhere. tiny-qwen3 knows only word problems and has a closed word-level
vocabulary; this model reads and writes any printable ASCII, one character a token, and was trained on the four
built-in domains of roundalign.tasks.gym (arithmetic, algorithmic, counting, probability). It is a Llama, so the
rounding audit also covers a model without Qwen3's q/k norms, with tied embeddings and grouped-query attention of
another shape (6 query heads of 32 over 2 KV heads).

What it does:
1. Builds a character-level tokenizer: `<|endoftext|>` (id 0: end of text and pad), `<|unk|>` (id 1), "\\n" and the
   95 printable ASCII characters. Decoding concatenates characters, so any printable-ASCII text with newlines
   round-trips exactly.
2. Trains a Llama in fp32 on fresh items every step, from every domain in the proportions of --mix (arithmetic the
   most: with equal shares it stayed near 0 while spell_backward went to 1), drawn from seeded streams,
   prompt + " answer" + end-of-text, loss on the completion tokens only (the answer and its end-of-text): the
   prompt's random words and numbers cannot be predicted and would only dilute the signal. The held-out items
   (`make_items(domain, 64, seed=EVAL_SEED)`) are left out of training by prompt. AdamW, warm-up, cosine decay.
3. Saves it in bf16 as a standard HF directory, then evaluates the SAVED bf16 weights on the held-out items: the
   greedy reward (reasoning-gym's score, up to 16 new tokens), the reward of samples at temperature 1, and the mean
   entropy of the next-token distribution at the sampled tokens. It writes the figures into the model card.

Deterministic: one seed drives torch and the item streams; one thread; torch.use_deterministic_algorithms. The same
--steps and --seed on the same machine and software give byte-identical weights (--check-reproducible). --minutes
is only a guard: a run that reaches it stops early, says so, and is not the reproducible model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import resource
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # run from a checkout without installing

from roundalign.tasks import gym  # noqa: E402
from roundalign.tasks.gym import EOS_TEXT, parse_domains  # noqa: E402

NAME = "tiny-llama-chars"
DEFAULT_OUT = REPO / "src" / "roundalign" / "models" / NAME
UNK_TEXT = "<|unk|>"
CHARACTERS = "\n" + "".join(chr(c) for c in range(32, 127))  # newline and the 95 printable ASCII characters
EVAL_SEED = 1_000_003  # the held-out items: make_items(domain, EVAL_ITEMS, seed=EVAL_SEED), never trained on
EVAL_ITEMS = 64
MAX_NEW_TOKENS = 16  # the longest answer (a probability such as 0.017578125) is 10 characters with its space
SAMPLES_PER_PROMPT = 4  # temperature-1 samples per held-out prompt
# Weight of each domain in a step's items (--mix): equal weights give every domain the same number of items.
DOMAIN_MIX = "arithmetic=8,algorithmic=1,counting=4,probability=3"
THREADS = 1  # the thread count changes CPU matmul summation order, so it is part of the recipe


# -----------------------------------------------------------------------------
# Tokenizer and model config


def build_tokenizer() -> transformers.PreTrainedTokenizerFast:
    vocab = {EOS_TEXT: 0, UNK_TEXT: 1} | {c: i + 2 for i, c in enumerate(CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TEXT))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character a piece
    tok.decoder = decoders.Fuse()  # decoding concatenates the pieces: no spaces added
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TEXT,
        pad_token=EOS_TEXT,
        unk_token=UNK_TEXT,
        clean_up_tokenization_spaces=False,  # decoding must give back " 0.25" exactly, not a "cleaned" variant
        model_max_length=256,
    )


def build_config(vocab_size: int, eos_id: int) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=192,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention supports 32, 64, 80, 96, 112, 128, 256
        intermediate_size=512,
        hidden_act="silu",
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=True,  # as in Llama 3.2 1B/3B: the lm_head is the embedding matrix
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


# -----------------------------------------------------------------------------
# Data


def held_out(domains) -> dict[str, list[gym.Item]]:
    return {d.name: gym.make_items(d, EVAL_ITEMS, seed=EVAL_SEED) for d in domains}


def _stream_seed(seed: int, step: int, domain: str, draw: int) -> int:
    """A 31-bit seed for (run seed, step, domain, draw), from sha256: stable across runs and platforms."""
    digest = hashlib.sha256(f"roundalign.train_gym_model/{seed}/{step}/{domain}/{draw}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % 2**31


def parse_mix(mix: str, domains) -> dict[str, float]:
    """``"arithmetic=8,algorithmic=1"`` -> weights; a domain it does not name weighs 1."""
    weights = {d.name: 1.0 for d in domains}
    for part in filter(None, (p.strip() for p in mix.split(","))):
        name, _, weight = part.partition("=")
        if name.strip() not in weights or not weight:
            raise ValueError(f"--mix: {part!r} is not domain=weight with one of {', '.join(weights)}")
        weights[name.strip()] = float(weight)
    if min(weights.values()) <= 0:
        raise ValueError(f"--mix: every weight must be positive, got {weights}")
    return weights


def domain_counts(weights: dict[str, float], batch_size: int) -> dict[str, int]:
    """Items of each domain in a step: ``batch_size`` split by the weights, at least one each."""
    total = sum(weights.values())
    return {name: max(1, round(batch_size * w / total)) for name, w in weights.items()}


def step_items(domain, count: int, step: int, seed: int, exclude: set[str]) -> list[gym.Item]:
    """``count`` items of ``domain`` for ``step``, fresh from the step's own seed, none of them held out."""
    out: list[gym.Item] = []
    draw = 0
    while len(out) < count:
        fresh = gym.make_items(domain, 2 * count, seed=_stream_seed(seed, step, domain.name, draw))
        out += [it for it in fresh if it.prompt not in exclude][: count - len(out)]
        draw += 1
    return out


def encode_batch(tok, items) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) for prompt + solution + end-of-text, right-padded; labels only on the completion.

    Right padding needs no attention mask: a causal model's real tokens never see the padding after them."""
    rows, starts = [], []
    for it in items:
        prompt = tok(it.prompt, add_special_tokens=False).input_ids
        completion = tok(it.solution, add_special_tokens=False).input_ids + [tok.eos_token_id]
        rows.append(prompt + completion)
        starts.append(len(prompt))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (row, start) in enumerate(zip(rows, starts, strict=True)):
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, start : len(row)] = torch.tensor(row[start:])
    return ids, labels


# -----------------------------------------------------------------------------
# Training


def train(tok, domains, args, exclude: set[str], log=print):
    torch.manual_seed(args.seed)
    config = build_config(len(tok), tok.eos_token_id)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]  # norms: their spread is what the audit needs
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98))  # fmt: skip
    steps, warmup = args.steps, max(1, min(100, args.steps // 10))

    def lr_at(step: int) -> float:  # linear warm-up, then cosine down to a tenth
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    counts = domain_counts(parse_mix(args.mix, domains), args.batch_size)
    start, losses, done = time.time(), [], steps
    model.train()
    for step in range(steps):
        # One micro-batch per domain (each padded to its own longest row), one optimizer step: the loss is the
        # mean over all the step's completion tokens.
        batches = [encode_batch(tok, step_items(d, counts[d.name], step, args.seed, exclude)) for d in domains]
        n_tokens = sum(int((labels != -100).sum()) for _, labels in batches)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        total = 0.0
        for ids, labels in batches:
            logits = model(input_ids=ids).logits[:, :-1].float()
            loss = (
                torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
                )
                / n_tokens
            )
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        if step % 50 == 0 or step == steps - 1:
            log(f"step {step:5d}/{steps}  loss {total:.4f}  lr {lr_at(step):.2e}  {time.time() - start:6.0f} s")
        if args.eval_every and (step + 1) % args.eval_every == 0 and step < steps - 1:
            log(f"  step {step + 1}: greedy reward {_quick_greedy(model, tok, args.evaluation)}")
        if args.minutes is not None and time.time() - start > 60 * args.minutes and step < steps - 1:
            log(f"WARNING: stopped at step {step + 1} of {steps}: --minutes {args.minutes} reached, not reproducible")
            done = step + 1
            break
    final_loss = sum(losses[-50:]) / len(losses[-50:])
    return model, {"steps_done": done, "final_loss_last50": final_loss, "train_wall_s": time.time() - start}


def _quick_greedy(model, tok, evaluation) -> dict[str, float]:
    """Greedy reward of a bf16 copy of the model in training (--eval-every, to choose --steps): uses no RNG."""
    import copy

    rewards = greedy(copy.deepcopy(model).to(torch.bfloat16).eval(), tok, evaluation)
    model.train()
    return {name: round(sum(r) / len(r), 3) for name, r in rewards.items()}


def save(model, tok, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)  # the shipped weights are bf16: this is their one rounding point
    model.config.dtype = torch.bfloat16
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, do_sample=False, max_new_tokens=MAX_NEW_TOKENS
    )
    model.save_pretrained(out)
    tok.save_pretrained(out)


# -----------------------------------------------------------------------------
# Evaluation of the saved bf16 directory


def _left_padded(tok, prompts: list[str]):
    tok.padding_side = "left"
    return tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)


@torch.no_grad()
def greedy(model, tok, evaluation: dict[str, list[gym.Item]]) -> dict[str, list[float]]:
    """Per domain, the score of each held-out item's greedy completion (up to MAX_NEW_TOKENS), one batch a domain."""
    out = {}
    for name, items in evaluation.items():
        enc = _left_padded(tok, [it.prompt for it in items])
        gen = model.generate(**enc, do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
        texts = tok.batch_decode(gen[:, enc.input_ids.shape[1] :])
        out[name] = [gym.score(t, it) for t, it in zip(texts, items, strict=True)]
    return out


@torch.no_grad()
def sampled(model, tok, evaluation: dict[str, list[gym.Item]], seed: int) -> dict[str, dict]:
    """Per domain, SAMPLES_PER_PROMPT samples of each held-out prompt at temperature 1 (no top-k, no top-p): their
    scores, and the entropy of the full next-token distribution at every sampled token up to end-of-text."""
    out = {}
    for name, items in evaluation.items():
        torch.manual_seed(seed)
        repeated = [it for it in items for _ in range(SAMPLES_PER_PROMPT)]
        enc = _left_padded(tok, [it.prompt for it in repeated])
        gen = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=MAX_NEW_TOKENS,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                             output_logits=True, return_dict_in_generate=True)  # fmt: skip
        new = gen.sequences[:, enc.input_ids.shape[1] :]
        logp = torch.log_softmax(torch.stack(gen.logits, dim=1).float(), dim=-1)  # (B, T, V)
        entropy = -(logp.exp() * logp).sum(-1)
        # a token was sampled at t if no end-of-text came before t
        is_eos = (new == tok.eos_token_id).long()
        live = (torch.cumsum(is_eos, dim=1) - is_eos) == 0
        texts = tok.batch_decode(new)
        out[name] = {
            "scores": [gym.score(t, it) for t, it in zip(texts, repeated, strict=True)],
            "entropy_sum": entropy[live].sum().item(),
            "tokens": int(live.sum()),
        }
    return out


def evaluate(out: Path, evaluation: dict[str, list[gym.Item]], seed: int) -> dict:
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    assert next(model.parameters()).dtype == torch.bfloat16
    figures: dict = {"vocab_size": len(tok), "log_vocab": math.log(len(tok)), "domains": {}}
    start = time.time()
    greedy_scores = greedy(model, tok, evaluation)
    figures["greedy_eval_s"] = time.time() - start
    samples = sampled(model, tok, evaluation, seed)
    for name in evaluation:
        g, s = greedy_scores[name], samples[name]
        figures["domains"][name] = {
            "greedy_reward": sum(g) / len(g),
            "greedy_correct": sum(x == 1.0 for x in g) / len(g),
            "sampled_reward": sum(s["scores"]) / len(s["scores"]),
            "sampled_correct": sum(x == 1.0 for x in s["scores"]) / len(s["scores"]),
            "sampled_entropy": s["entropy_sum"] / s["tokens"],
            "sampled_tokens": s["tokens"],
        }
    figures["sampled_entropy"] = sum(s["entropy_sum"] for s in samples.values()) / sum(
        s["tokens"] for s in samples.values()
    )
    norms = [m.weight.float().flatten() for n, m in model.named_modules() if n.endswith("norm")]
    weights = torch.cat(norms)
    figures["norm_weight_min_max_std"] = [weights.min().item(), weights.max().item(), weights.std().item()]
    figures["size_bytes"] = sum(f.stat().st_size for f in out.iterdir() if f.is_file() and f.name != "README.md")
    return figures


# -----------------------------------------------------------------------------
# Model card and command line


def describe_cpu() -> str:
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())  # the first processor's
    except OSError:
        pass
    name = info.get("model name") or platform.processor() or platform.machine()
    if name.startswith("AMD") and info.get("cpu family") == "25" and "avx512f" in info.get("flags", "").split():
        name += " (Zen 4)"  # family 25 with AVX-512 is Zen 4; Zen 3, also family 25, has none
    return f"{name}, {os.cpu_count()} cores"


def model_card(figures: dict, args: argparse.Namespace) -> str:
    rows = "\n".join(
        f"| {name} | {d['greedy_reward']:.3f} | {d['greedy_correct']:.3f} | {d['sampled_reward']:.3f} "
        f"| {d['sampled_correct']:.3f} | {d['sampled_entropy']:.3f} |"
        for name, d in figures["domains"].items()
    )
    datasets = "".join(f"\n  - {d.name}: {', '.join(n for n, _ in d.datasets)}" for d in args.domains)
    new_tokens, samples = MAX_NEW_TOKENS, SAMPLES_PER_PROMPT
    params, mb = f"{figures['params'] / 1e6:.2f}M", f"{figures['size_bytes'] / 1e6:.2f} MB"
    train_min, run_min, cpu_min = (f"{figures[k] / 60:.1f}" for k in ("train_wall_s", "run_wall_s", "cpu_s"))
    low, high, std = figures["norm_weight_min_max_std"]
    versions = (
        f"torch {torch.__version__}, transformers {transformers.__version__}, reasoning-gym {version('reasoning_gym')}"
    )
    return f"""# {NAME}

A {params}-parameter Llama (bf16) with a character-level tokenizer, trained from scratch on the four built-in
domains of `roundalign.tasks.gym` (reasoning-gym's generators and verifiers). It is the policy for multi-domain RL
runs: its reward is neither 0 nor 1 in any domain, so groups of samples have mixed rewards. It is of no use as a
language model outside these tasks.

| | |
|---|---|
| architecture | `LlamaForCausalLM`: 4 layers, hidden 192, MLP 512 (SiLU), RMSNorm eps 1e-5 |
| attention | 6 query heads and 2 KV heads of head_dim 32, RoPE theta 10000, max 256 positions |
| lm_head | tied to the embeddings |
| parameters | {figures["params"]:,} ({params}), stored in bf16 |
| tokenizer | character level, {figures["vocab_size"]} tokens (below) |
| generation | `generation_config.json`: eos = pad = 0, greedy, {MAX_NEW_TOKENS} new tokens |
| files (weights, configs, tokenizer) | {mb} |

- Tokenizer: `<|endoftext|>` (id 0, end of text and pad), `<|unk|>` (id 1), newline and the 95 printable ASCII
  characters, one token each. Decoding concatenates, so printable ASCII with newlines round-trips exactly. No BOS.
- How to regenerate it, and what the figures mean: docs/tiny-model.md in the roundalign repository.

## Training

`OMP_NUM_THREADS=1 .venv/bin/python scripts/train_gym_model.py`, whose defaults are
`--seed {args.seed} --steps {args.steps} --batch-size {args.batch_size} --lr {args.lr} --mix {args.mix}`.
One thread, deterministic: the same seed and steps on the same machine and software give byte-identical weights.

- Data: every step, fresh items from seeded streams: {_counts_text(args)}.
  Arithmetic gets the most: with equal shares it stayed near 0 while spell_backward went to 1.
  The domains and their datasets:{datasets}
- The prompt is the question and `\\nAnswer:`; the completion is ` <answer>` and end-of-text.
- Loss: next-token cross-entropy on the completion tokens only (the answer and its end-of-text), in fp32.
- AdamW (betas 0.9/0.98, weight decay 0.1 except on norms), lr {args.lr}, 100 warm-up steps, cosine decay to a
  tenth, gradient clipping at 1. Saved in bf16; the figures below were measured on the saved weights.
- Held out: `make_items(domain, {EVAL_ITEMS}, seed={EVAL_SEED})` for each domain; no training item has one of their
  prompts.
- Wall time of training / whole run (with saving and evaluation): {train_min} / {run_min} min; CPU time (user +
  sys) {cpu_min} min; {THREADS} thread. Machine: {figures["cpu"]}, shared with other work.
- Software: {versions}.

## Measured figures (held-out items, {EVAL_ITEMS} a domain)

Reward is reasoning-gym's score (1.0 correct; spell_backward gives partial credit for the letters in place, and
coin_flip for a matching prefix, divided by the shorter length: any prefix of the right decimal, even `0`, scores
1.0, see docs/tiny-model.md). Greedy: one completion an item, up to {new_tokens} new tokens. Sampled: {samples}
completions an item at temperature 1 (no top-k, no top-p). "Correct" is the share that scores 1.0. Entropy: mean
entropy (nats) of the next-token distribution at the sampled tokens, end-of-text included.

| domain | greedy reward | greedy correct | sampled reward | sampled correct | entropy (nats) |
|---|---|---|---|---|---|
{rows}
{_partial_only(figures)}
| figure | value |
|---|---|
| steps done | {figures["steps_done"]} |
| training loss (completion tokens, mean of the last 50 steps) | {figures["final_loss_last50"]:.3f} |
| entropy at sampled tokens, all domains | {figures["sampled_entropy"]:.3f} nats |
| log(vocab), the entropy of a uniform distribution | {figures["log_vocab"]:.3f} nats |
| RMSNorm weights: min / max / std (all start at 1) | {low:.3f} / {high:.3f} / {std:.3f} |
"""


def _partial_only(figures: dict) -> str:
    """A note on the domains where no held-out item is answered fully correctly, greedy or sampled."""
    names = [n for n, d in figures["domains"].items() if d["greedy_correct"] == 0 and d["sampled_correct"] == 0]
    if not names:
        return ""
    return (
        f"\nIn {', '.join(names)}, no held-out item is answered fully correctly, greedy or sampled: the reward\n"
        "there is partial credit only.\n"
    )


def _counts_text(args) -> str:
    counts = domain_counts(parse_mix(args.mix, args.domains), args.batch_size)
    return ", ".join(f"{n} {name}" for name, n in counts.items())


def _train_and_save(tok, domains, args, out: Path) -> dict:
    exclude = {it.prompt for items in held_out(domains).values() for it in items}
    model, stats = train(tok, domains, args, exclude)
    stats["params"] = sum(p.numel() for p in model.parameters())  # tied: the embedding is counted once
    save(model, tok, out)
    return stats


def check_reproducible(tok, domains, args) -> int:
    digests = []
    for run in range(2):
        with tempfile.TemporaryDirectory() as tmp:
            _train_and_save(tok, domains, args, Path(tmp))
            digests.append(hashlib.sha256((Path(tmp) / "model.safetensors").read_bytes()).hexdigest())
            print(f"run {run + 1}: model.safetensors sha256 {digests[-1]}")
    same = digests[0] == digests[1]
    print("reproducible: identical weights" if same else "NOT reproducible: the two runs' weights differ")
    return 0 if same else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="model directory (default: the package's)")
    parser.add_argument("--steps", type=int, default=1100, help="optimizer steps (default 1100)")
    parser.add_argument("--minutes", type=float, default=None, help="stop training early past this wall time (a guard)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=64, help="items per step, split among the domains")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument("--mix", default=DOMAIN_MIX, help=f"weight of each domain's items (default {DOMAIN_MIX})")
    parser.add_argument("--no-eval", action="store_true", help="save the weights, skip the evaluation and the card")
    parser.add_argument(
        "--eval-every", type=int, default=0, help="greedy reward every N steps (does not change weights)"
    )
    parser.add_argument("--check-reproducible", action="store_true", help="train twice (no eval), compare weights")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 4:
        parser.error("--steps must be >= 1 and --batch-size >= 4 (one item of each domain at least)")

    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    print(json.dumps({k: str(v) for k, v in vars(args).items()}))
    args.domains = domains = parse_domains(gym.DEFAULT_DOMAINS)
    tok = build_tokenizer()
    args.evaluation = evaluation = held_out(domains)
    texts = [it.prompt + it.solution for items in evaluation.values() for it in items] + [CHARACTERS]
    if any(tok.unk_token_id in tok(t).input_ids or tok.decode(tok(t).input_ids) != t for t in texts):
        raise RuntimeError("the tokenizer does not cover the tasks' text or does not round-trip it")
    if args.check_reproducible:
        return check_reproducible(tok, domains, args)

    start = time.time()
    figures = _train_and_save(tok, domains, args, args.out) | {
        "threads": torch.get_num_threads(),
        "cpu": describe_cpu(),
    }
    if not args.no_eval:
        figures |= evaluate(args.out, evaluation, args.seed)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    figures["run_wall_s"], figures["cpu_s"] = time.time() - start, usage.ru_utime + usage.ru_stime
    print(json.dumps(figures, indent=1))
    if not args.no_eval:
        (args.out / "README.md").write_text(model_card(figures, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
