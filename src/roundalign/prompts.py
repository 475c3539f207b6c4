"""Prompts for the commands that sample: read from a file, generated (arithmetic word problems), and tokenized.

``probe``, ``dump``, ``calibrate`` and ``fit`` all take the same prompt file format and the same default prompts,
and turn them into token ids the same way, so that the engine side and the trainer side of a comparison see the
same ids. A prompt is text, encoded without special tokens (the shipped model's tokenizer has none to add), or a
list of token ids taken as given.
"""

from __future__ import annotations

import json
from pathlib import Path

from roundalign.errors import UserError
from roundalign.untrusted import read_text

Prompts = list[str] | list[list[int]]


def default_prompts(n: int, seed: int) -> list[str]:
    """Arithmetic word problems, easy to hard, as the shipped model was trained on them."""
    from roundalign.tasks import arithmetic

    levels = sorted(arithmetic.LEVELS)
    per_level = [arithmetic.make_problems(n, level=lv, seed=seed + lv) for lv in levels]
    return [arithmetic.format_prompt(per_level[i % len(levels)][i // len(levels)]) for i in range(n)]


def read_prompts(path: str | Path) -> Prompts:
    """Prompts from a file: one per line, text or a JSON list of token ids. Blank lines are errors."""
    path = Path(path)
    lines = read_text(path, "a prompt file (UTF-8 text, one prompt per line)").splitlines()
    if not any(line.strip() for line in lines):
        raise UserError(f"prompt file {str(path)!r} is empty; put one prompt per line")
    prompts = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            raise UserError(f"{path}:{i}: blank line; every line is one prompt (remove it)")
        if line.lstrip().startswith("["):
            try:
                ids = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{i}: looks like a token-id list but is not valid JSON: {exc}") from None
            if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise UserError(f"{path}:{i}: a token-id prompt must be a non-empty JSON list of integers")
            prompts.append(ids)
        else:
            prompts.append(line)
    return prompts


def token_ids(prompts: Prompts, tokenizer) -> list[list[int]]:
    """Each prompt as token ids: text encoded by ``tokenizer`` without special tokens, id lists as given."""
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise UserError(
                    "the model directory has no tokenizer files, so text prompts cannot be encoded; add the "
                    "tokenizer files or pass --prompts FILE with one JSON token-id list per line"
                )
            ids = tokenizer(p, add_special_tokens=False)["input_ids"]
        else:
            ids = [int(t) for t in p]
        if not ids:
            raise UserError(f"prompt {i + 1} is empty")
        out.append(list(ids))
    return out


def round_robin(ids: list[list[int]], n: int) -> list[list[int]]:
    """``n`` prompts, the given ones used in turn (``--num-samples`` larger or smaller than the prompt list)."""
    return [ids[i % len(ids)] for i in range(n)]


__all__ = ["Prompts", "default_prompts", "read_prompts", "round_robin", "token_ids"]
