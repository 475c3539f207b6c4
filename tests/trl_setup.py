"""A small GRPOTrainer on the shipped tiny-qwen3, built locally (no hub): shared by test_integration_trl.py and the
two-process script trl_ddp_train.py.

One arithmetic problem of level 3 (the shipped model solves about half of them, so groups get mixed rewards and the
policy moves) per step, sampled ``num_generations`` times; a Python reward (1 for the exact answer);
``datasets.Dataset.from_dict``; ``use_cpu=True``, ``report_to="none"``. ``fp32=True`` is TRL's realistic setup:
fp32 parameters, ``bf16=True`` (CPU autocast); ``fp32=False`` holds bf16 parameters and trains without autocast.
"""

from __future__ import annotations

import os
import warnings

import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is "experimental" in TRL 1.16


def reward_exact(prompts, completions, answer, **kwargs):
    from roundalign.tasks.arithmetic import extract_answer

    return [1.0 if extract_answer(c) == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def dataset(n: int = 16, seed: int = 0):
    import datasets

    from roundalign.tasks import format_prompt, make_problems

    problems = make_problems(n, level=3, seed=seed)
    return datasets.Dataset.from_dict(
        {"prompt": [format_prompt(p) for p in problems], "answer": [p.answer for p in problems]}
    )


def policy(fp32: bool = True):
    import transformers

    import roundalign.models

    path = roundalign.models.path("tiny-qwen3")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32 if fp32 else torch.bfloat16, attn_implementation="sdpa"
    )
    return model, tokenizer


def reward_brevity(prompts, completions, **kwargs):
    """A small reward for shorter completions: a group of sampled completions nearly always differs in length, so
    every step has a gradient, whichever answers the CPU's numerics happened to sample."""
    return [-len(c) / 1000 for c in completions]


def trainer(
    model, tokenizer, out: str, *, fp32: bool = True, steps: int = 3, generations: int = 8, rollout_func=None,
    rewards=(reward_exact,), train_dataset=None, **config,
):  # fmt: skip
    """A GRPOTrainer; ``rewards`` its reward functions, ``train_dataset`` (default ``dataset()``) its prompts,
    ``config`` overrides GRPOConfig fields."""
    from trl import GRPOConfig, GRPOTrainer

    kw = dict(
        output_dir=out,
        use_cpu=True,
        report_to="none",
        bf16=fp32,
        per_device_train_batch_size=generations,
        num_generations=generations,
        max_completion_length=40,
        max_steps=steps,
        logging_steps=1,
        learning_rate=1e-4,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    kw.update(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = GRPOConfig(**kw)
        return GRPOTrainer(
            model=model,
            args=args,
            reward_funcs=list(rewards),
            train_dataset=dataset() if train_dataset is None else train_dataset,
            processing_class=tokenizer,
            rollout_func=rollout_func,
        )


def step_logs(trainer) -> list[dict]:
    """The per-step entries of the log history (the last entry is the run summary)."""
    return [entry for entry in trainer.state.log_history if "train_runtime" not in entry]
