"""``roundalign dump``: run a real engine on a model and write a dump directory that probe, fit and calibrate read.

    roundalign dump --engine vllm --model PATH --out dump-dir                  # vLLM's default (compiled) mode
    roundalign dump --engine vllm --enforce-eager --model PATH --out dump-dir
    roundalign dump --engine sglang --model PATH --out dump-dir                # written from source, not run here

Run it in the engine's Python (on your GPU machine, or the CPU vLLM of ``make vllm``); roundalign must be installed
there too (``pip install --no-deps -e .`` from your clone: the engine already brings torch and transformers). It
samples ``--num-samples`` completions, scores the same sequences again in prefill, and writes ``decode.jsonl``,
``prefill.jsonl`` and ``engine.json`` (``roundalign.rollouts.dumpdir``). Bring the directory back and pass it to
``roundalign probe --engine-logprobs DIR`` or ``roundalign fit --engine-logprobs DIR``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields
from pathlib import Path

from roundalign.errors import MissingFile, UserError

ENGINES = ("vllm", "sglang")


@dataclass
class DumpConfig:
    """Everything ``roundalign dump`` takes (``--max-tokens`` is ``max_tokens``)."""

    engine: str = "vllm"
    model: str | None = None  # None: the shipped tiny-qwen3
    out: str = "dump"
    enforce_eager: bool = False
    prompts: list[str] | list[list[int]] | None = None  # None: arithmetic word problems
    num_samples: int = 16
    max_tokens: int = 48
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False
    max_model_len: int | None = None  # None: the model's
    memory_fraction: float = 0.3  # vLLM's gpu_memory_utilization (on its CPU build, a fraction of RAM)

    def validate(self) -> DumpConfig:
        if self.engine not in ENGINES:
            raise UserError(f"--engine {self.engine!r}: choose one of {', '.join(ENGINES)}")
        if self.enforce_eager and self.engine != "vllm":
            raise UserError("--enforce-eager is a vLLM option; SGLang runs eagerly unless its server compiles")
        if self.engine == "sglang" and (self.temperature != 1.0 or self.top_p != 1.0):
            raise UserError(
                "SGLang returns log-probs after temperature and top-p, so a dump must sample at --temperature 1 "
                "--top-p 1, where they equal the raw log-probs a trainer computes"
            )
        from roundalign import models

        model = self.model or str(models.path())  # the shipped tiny-qwen3
        if not (Path(model) / "config.json").is_file():
            raise MissingFile(f"--model {model}: no config.json there; give the HF model directory the engine serves")
        for name in ("num_samples", "max_tokens"):
            if getattr(self, name) <= 0:
                raise UserError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.temperature < 0:
            raise UserError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0 < self.memory_fraction <= 1:
            raise UserError(f"--memory-fraction must be in (0, 1], got {self.memory_fraction}")
        if self.prompts is not None and not self.prompts:
            raise UserError("no prompts: the prompt list is empty")
        return DumpConfig(**{**self.__dict__, "model": model})

    def prompt_ids(self, tokenizer) -> list[list[int]]:
        """The prompts as token ids, used round-robin up to ``num_samples`` (as ``roundalign probe`` does)."""
        from roundalign.probe.run import default_prompts

        prompts = self.prompts if self.prompts is not None else default_prompts(self.num_samples, self.seed)
        ids = []
        for i, p in enumerate(prompts):
            t = tokenizer(p, add_special_tokens=False)["input_ids"] if isinstance(p, str) else [int(x) for x in p]
            if not t:
                raise UserError(f"prompt {i + 1} is empty")
            ids.append(list(t))
        return [ids[i % len(ids)] for i in range(self.num_samples)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DumpConfig()
    a = parser.add_argument
    a("--engine", required=True, choices=ENGINES, help="the engine to run (it must be importable in this Python)")
    a("--model", metavar="PATH", help="HF model directory the engine serves (default: the shipped tiny-qwen3)")
    a("--out", metavar="DIR", default=d.out, help=f"the dump directory to write (default {d.out})")
    a("--enforce-eager", action="store_true", help="vLLM: no torch.compile, custom ops on (enforce_eager=True)")
    a("--prompts", metavar="FILE", help="one prompt per line: text, or a JSON list of token ids")
    a(
        "--num-samples",
        type=int,
        default=d.num_samples,
        help=f"completions, prompts round-robin (default {d.num_samples})",
    )
    a("--max-tokens", type=int, default=d.max_tokens, help=f"max completion tokens (default {d.max_tokens})")
    a("--temperature", type=float, default=d.temperature, help="sampling temperature (default 1)")
    a("--top-p", type=float, default=d.top_p, help="nucleus sampling, in (0, 1] (default 1)")
    a("--seed", type=int, default=d.seed, help="sampling seed (default 0)")
    a("--ignore-eos", action="store_true", help="every completion runs to --max-tokens (more tokens per prompt)")
    a("--max-model-len", type=int, metavar="N", help="the engine's context length (default: the model's)")
    a(
        "--memory-fraction",
        type=float,
        default=d.memory_fraction,
        help="vLLM gpu_memory_utilization / SGLang mem_fraction_static "
        f"(default {d.memory_fraction}; on vLLM's CPU build it is a fraction of RAM)",
    )


def config_from_args(args: argparse.Namespace) -> DumpConfig:
    from roundalign.probe.cli import read_prompts

    given = {f.name: getattr(args, f.name) for f in fields(DumpConfig)}  # options named as the fields
    return DumpConfig(**{**given, "prompts": read_prompts(args.prompts) if args.prompts else None})


def dump(cfg: DumpConfig, log=print) -> Path:
    """Run the engine and write the dump directory; returns its path."""
    import importlib.util
    import sys

    from roundalign.errors import MissingDependency
    from roundalign.rollouts.dumpdir import write_dump

    package = {"vllm": "vllm", "sglang": "sglang"}[cfg.engine]
    if importlib.util.find_spec(package) is None:
        raise MissingDependency(
            package,
            purpose=f"roundalign dump --engine {cfg.engine}",
            install=f"it is not importable in this Python ({sys.executable}); run the dump in the engine's Python "
            "(for vLLM's CPU build, `make vllm` in your roundalign clone builds .venv-vllm; docs/real-engines.md)",
        )
    runner = importlib.import_module(f"roundalign.dump.{cfg.engine}")
    rollouts, prefill, info = runner.run(cfg, log=log)
    info = {
        **info,
        "model": str(Path(cfg.model).resolve()),
        "sampling": {
            "num_samples": cfg.num_samples, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature,
            "top_p": cfg.top_p, "seed": cfg.seed, "ignore_eos": cfg.ignore_eos,
        },
    }  # fmt: skip
    return write_dump(cfg.out, rollouts, prefill, info)


def run(cfg: DumpConfig) -> int:
    from roundalign.errors import ExitStatus

    out = dump(cfg, log=lambda m: print(f"dump: {m}", flush=True))
    info = json.loads((out / "engine.json").read_text())
    print(
        f"dump: {out}/ decode.jsonl, prefill.jsonl, engine.json ({info['engine']} {info['engine_version']}, "
        f"{'enforce_eager' if info.get('enforce_eager') else 'compiled'}, attention {info.get('attention_backend')})",
        flush=True,
    )
    return ExitStatus.OK
