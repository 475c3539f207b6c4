"""Models shipped inside the package, as standard HF model directories that load offline.

One ships today, ``tiny-qwen3``: a 3.3M-parameter Qwen3 (bf16, hidden 256, 4 layers, head_dim 64, untied lm_head)
with a word-level tokenizer of 264 tokens, trained from scratch on the arithmetic word problems of
``roundalign.tasks.arithmetic`` by ``scripts/train_tiny_model.py`` (deterministic and seeded; docs/tiny-model.md
says how long it takes). It exists so that ``roundalign probe`` audits trainer-vs-engine log-prob mismatch on a
model whose next-token distributions are peaked and whose norm weights were moved by training, as a real LM's are,
without a download. Its model card (``README.md`` in its directory) and docs/tiny-model.md give the measured figures::

    import torch, transformers, roundalign.models
    path = roundalign.models.path("tiny-qwen3")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)

The weights are committed once; regenerate them (only when needed) with
``.venv/bin/python scripts/train_tiny_model.py``.
"""

from __future__ import annotations

from pathlib import Path

from roundalign.errors import MissingFile, UserError

_HERE = Path(__file__).resolve().parent
# What a directory needs to load with AutoTokenizer and AutoModelForCausalLM.
REQUIRED_FILES = (
    "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
)  # fmt: skip
_REGENERATE = "regenerate it with: .venv/bin/python scripts/train_tiny_model.py (from a roundalign checkout)"


def list_models() -> list[str]:
    """Names of the models that ship with the package, sorted."""
    return sorted(p.name for p in _HERE.iterdir() if p.is_dir() and p.name[0] not in "._")


def path(name: str = "tiny-qwen3") -> Path:
    """The directory of shipped model ``name``, for ``from_pretrained``.

    Raises ValueError for a name that does not ship (the message lists those that do), and FileNotFoundError if the
    directory lacks a file it needs to load.
    """
    if not isinstance(name, str):
        raise TypeError(f"model name must be a str, got {type(name).__name__}")
    directory = _HERE / name
    if name in ("", ".", "..") or "/" in name or "\\" in name or not directory.is_dir():
        raise UserError(f"no shipped model named {name!r}; the shipped models are: {', '.join(list_models())}")
    missing = [f for f in REQUIRED_FILES if not (directory / f).is_file()]
    if missing:
        raise MissingFile(f"shipped model {name!r} at {directory} lacks {', '.join(missing)}; {_REGENERATE}")
    return directory


__all__ = ["REQUIRED_FILES", "list_models", "path"]
