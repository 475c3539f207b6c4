"""``roundalign dump``: run a real engine on a model and write a dump directory that probe, fit and calibrate read.

    roundalign dump --engine vllm --model PATH --out dump-dir                  # vLLM's default (compiled) mode
    roundalign dump --engine vllm --enforce-eager --model PATH --out dump-dir
    roundalign dump --engine sglang --model PATH --out dump-dir                # written from source, not run here

Run it in the engine's Python (on your GPU machine, or the CPU vLLM of ``make vllm``); roundalign must be installed
there too (``pip install --no-deps -e .`` from your clone: the engine already brings torch and transformers). It
samples ``--num-samples`` completions, scores the same sequences again in prefill, and writes ``decode.jsonl``,
``prefill.jsonl`` and ``engine.json`` (``roundalign.rollouts.dumpdir``). Bring the directory back and pass it to
``roundalign probe --engine-logprobs DIR`` or ``roundalign fit --engine-logprobs DIR``. The run itself is
``roundalign.engines.dump``; this module is its command line.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

from roundalign.engines import ENGINES
from roundalign.engines.dump import DumpConfig, dump
from roundalign.options import SAMPLING, add_sampling_arguments, field_help


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DumpConfig()

    def a(name, **kw):
        parser.add_argument(f"--{name.replace('_', '-')}", help=field_help(DumpConfig, name), **kw)

    a("engine", required=True, choices=ENGINES)
    a("model", metavar="PATH")
    a("out", metavar="DIR", default=d.out)
    a("enforce_eager", action="store_true")
    a("quantization", metavar="SCHEME")
    a("prompts", metavar="FILE")
    add_sampling_arguments(parser.add_argument, DumpConfig, {k: getattr(d, k) for k in SAMPLING})
    a("ignore_eos", action="store_true")
    a("max_model_len", type=int, metavar="N")
    a("memory_fraction", type=float, default=d.memory_fraction)


def config_from_args(args: argparse.Namespace) -> DumpConfig:
    from roundalign.prompts import read_prompts

    given = {f.name: getattr(args, f.name) for f in fields(DumpConfig)}  # options named as the fields
    return DumpConfig(**{**given, "prompts": read_prompts(args.prompts) if args.prompts else None})


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
