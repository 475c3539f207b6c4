"""A real engine's dump: what ``roundalign dump`` takes (``DumpConfig``) and the run that writes the directory.

Runs in the engine's own Python, so it imports only the engine, torch and roundalign's core. The engine's half
(``engines.vllm.dump``, ``engines.sglang``) samples the prompts and scores the same sequences again in prefill;
``dump`` adds what was asked for and writes ``decode.jsonl``, ``prefill.jsonl`` and ``engine.json``
(``roundalign.rollouts.dumpdir``), which ``probe``, ``fit`` and ``calibrate`` read.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from pathlib import Path

from roundalign.engines import ENGINES, failure
from roundalign.errors import MissingFile, UserError
from roundalign.extras import require_engine
from roundalign.options import SAMPLING, check_sampling, option
from roundalign.prompts import Prompts, default_prompts, round_robin, token_ids


@dataclass(frozen=True)
class DumpConfig:
    """Everything ``roundalign dump`` takes (``--max-tokens`` is ``max_tokens``). ``validate()`` returns a checked
    copy with the model path filled in."""

    engine: str = option("vllm", "the engine to run (it must be importable in this Python)")
    model: str | None = option(None, "HF model directory the engine serves (default: the shipped tiny-qwen3)")
    out: str = option("dump", "the dump directory to write (default {default})")
    enforce_eager: bool = option(False, "vLLM: no torch.compile, custom ops on (enforce_eager=True)")
    quantization: str | None = option(
        None,
        "serve a quantized copy in this scheme (w8a8-int8, w4a16, ...; docs/quantization.md): --model (bf16) is "
        "quantized into DIR/served-model, a compressed-tensors checkpoint, and the engine serves that (fp8-online: "
        "vLLM quantizes --model itself at load). A --model that is already a compressed-tensors checkpoint is "
        "served as it is",
    )
    prompts: Prompts | None = option(
        None, "one prompt per line: text, or a JSON list of token ids (default: arithmetic word problems)"
    )
    num_samples: int = option(SAMPLING["num_samples"].default, "completions, prompts round-robin (default {default})")
    max_tokens: int = option(SAMPLING["max_tokens"].default, SAMPLING["max_tokens"].help)
    temperature: float = option(SAMPLING["temperature"].default, SAMPLING["temperature"].help)
    top_p: float = option(SAMPLING["top_p"].default, SAMPLING["top_p"].help)
    seed: int = option(SAMPLING["seed"].default, SAMPLING["seed"].help)
    ignore_eos: bool = option(False, "every completion runs to --max-tokens (more tokens per prompt)")
    max_model_len: int | None = option(None, "the engine's context length (default: the model's)")
    memory_fraction: float = option(
        0.3,
        "vLLM gpu_memory_utilization / SGLang mem_fraction_static (default {default}; on vLLM's CPU build it is a "
        "fraction of RAM)",
    )

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
        check_sampling({k: getattr(self, k) for k in SAMPLING})
        if not 0 < self.memory_fraction <= 1:
            raise UserError(f"--memory-fraction must be in (0, 1], got {self.memory_fraction}")
        if self.prompts is not None and not self.prompts:
            raise UserError("no prompts: the prompt list is empty")
        served = served_scheme(model)
        if self.quantization is not None:
            from roundalign.quant import Scheme

            scheme = Scheme.parse(self.quantization)
            scheme.check_vllm_cpu()
            if self.engine != "vllm":
                raise UserError("--quantization is served by vLLM's compressed-tensors support: use --engine vllm")
            if served is not None and served != scheme.name:
                raise UserError(f"--model {model} is already quantized ({served}); drop --quantization or give the "
                                "bf16 model")  # fmt: skip
        return dataclasses.replace(self, model=model)

    def prompt_ids(self, tokenizer) -> list[list[int]]:
        """The prompts as token ids, used round-robin up to ``num_samples`` (as ``roundalign probe`` does)."""
        prompts = self.prompts if self.prompts is not None else default_prompts(self.num_samples, self.seed)
        return round_robin(token_ids(prompts, tokenizer), self.num_samples)


def served_scheme(model: str | Path) -> str | None:
    """The scheme of a compressed-tensors checkpoint at ``model`` (None for a bf16 model)."""
    from roundalign.untrusted import read_json_object

    config = read_json_object(Path(model) / "config.json", "a model's config.json")
    if "quantization_config" not in config:
        return None
    from roundalign.quant import from_compressed_tensors

    return from_compressed_tensors(config["quantization_config"]).name


def _served_copy(cfg: DumpConfig, log) -> tuple[DumpConfig, dict]:
    """What the engine serves: ``--model`` itself, or its quantized copy (written to ``OUT/served-model``); and what
    engine.json records of it."""
    from roundalign.quant import Scheme, checkpoint

    served = served_scheme(cfg.model)
    if cfg.quantization is None or served is not None:
        return cfg, {"quantization": served or "none", "served_model": str(Path(cfg.model).resolve())}
    if Scheme.parse(cfg.quantization).online:  # the engine quantizes the bf16 checkpoint itself
        return cfg, {"quantization": cfg.quantization, "served_model": str(Path(cfg.model).resolve())}
    path = Path(cfg.out) / "served-model"
    checkpoint.write(cfg.model, path, Scheme.parse(cfg.quantization))
    log(f"quantized {cfg.model} to {cfg.quantization}: {path}")
    return dataclasses.replace(cfg, model=str(path)), {
        "quantization": cfg.quantization,
        "served_model": str(path.resolve()),
    }


_RUNNERS = {"vllm": "roundalign.engines.vllm.dump", "sglang": "roundalign.engines.sglang"}  # imported on use


def dump(cfg: DumpConfig, log=print) -> Path:
    """Run the engine and write the dump directory; returns its path."""
    from roundalign.rollouts.dumpdir import write_dump

    require_engine(
        cfg.engine,
        f"roundalign dump --engine {cfg.engine}",
        "run the dump in the engine's Python (for vLLM's CPU build, `make vllm` in your roundalign clone builds "
        ".venv-vllm; docs/real-engines.md)",
    )
    runner = importlib.import_module(_RUNNERS[cfg.engine])
    failure.capture()
    serving, served = _served_copy(cfg, log)
    with failure.guard("dump", "; nothing was written (a dump directory appears only whole)"):
        rollouts, prefill, info = runner.run(serving, log=log)
    info = {
        **info,
        **served,
        "model": str(Path(cfg.model).resolve()),
        "sampling": {
            "num_samples": cfg.num_samples, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature,
            "top_p": cfg.top_p, "seed": cfg.seed, "ignore_eos": cfg.ignore_eos,
        },
    }  # fmt: skip
    return write_dump(cfg.out, rollouts, prefill, info)


__all__ = ["DumpConfig", "dump"]
