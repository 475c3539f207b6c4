"""Models shipped inside the package, as standard HF model directories that load offline.

Two ship today. Each one's model card (``README.md`` in its directory) and docs/tiny-model.md give the measured
figures and how long the training script takes (both scripts are deterministic and seeded).

- ``tiny-qwen3``: a 3.3M-parameter Qwen3 (bf16, hidden 256, 4 layers, head_dim 64, untied lm_head) with a
  word-level tokenizer of 264 tokens, trained from scratch on the arithmetic word problems of
  ``roundalign.tasks.arithmetic`` by ``scripts/train_tiny_model.py``. It exists so that ``roundalign probe`` audits
  trainer-vs-engine log-prob mismatch on a model whose next-token distributions are peaked and whose norm weights
  were moved by training, as a real LM's are, without a download.
- ``tiny-llama-chars``: a 1.6M-parameter Llama (bf16, hidden 192, 4 layers, 6 query heads and 2 KV heads of
  head_dim 32, tied lm_head) with a character-level tokenizer (printable ASCII and newline, 98 tokens), trained from
  scratch on the four built-in domains of ``roundalign.tasks.gym`` by ``scripts/train_gym_model.py``. It is the
  policy for multi-domain RL (docs/multi-domain.md): its reward is neither near 0 nor near 1 in any domain, so
  groups of samples have mixed rewards everywhere. It also gives the audit a second family: no q/k norm, tied
  embeddings, another head shape.

::

    import torch, transformers, roundalign.models
    path = roundalign.models.path("tiny-qwen3")          # or "tiny-llama-chars"
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)

The weights are committed once; regenerate them (only when needed) with their script, e.g.
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
_SCRIPTS = {"tiny-llama-chars": "OMP_NUM_THREADS=1 .venv/bin/python scripts/train_gym_model.py"}  # how to regenerate
_DEFAULT_SCRIPT = ".venv/bin/python scripts/train_tiny_model.py"


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
        how = _SCRIPTS.get(name, _DEFAULT_SCRIPT)
        raise MissingFile(
            f"shipped model {name!r} at {directory} lacks {', '.join(missing)}; "
            f"regenerate it with: {how} (from a roundalign checkout)"
        )
    return directory


__all__ = ["REQUIRED_FILES", "list_models", "path"]
