"""verl's real FSDP engine on the CPU: a CPU platform for verl's plugin registry, and the engine built from configs.

verl 0.9.1 resolves its device through ``verl.plugin.platform`` and registers only GPU/NPU platforms; without one it
falls back to CUDA. roundalign's ``PlatformCPU`` (``roundalign.integrations.verl.cpu``, registered with verl's own
``PlatformRegistry``) is selected with ``VERL_PLATFORM=cpu``, so ``FSDPEngine`` builds device meshes, loads and shards
on the CPU with gloo. Two things are adjusted for this test environment, not for verl users:

- attention is ``sdpa`` (``override_config``): verl defaults to flash-attention 2, which needs a GPU;
- verl's ``apply_monkey_patch`` imports TRL's ``AutoModelForCausalLMWithValueHead`` whenever TRL is installed, and
  TRL 1.16 (our ``[trl]`` extra) no longer has it, so the import fails. ``hide_trl_from_verl`` makes verl's
  ``is_trl_available`` say no; verl's own pin (``trl==0.27``) does not have the problem.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

MODEL = Path(__file__).resolve().parents[1] / "src" / "roundalign" / "models" / "tiny-qwen3"


def require_verl():
    """verl, or skip on a machine without it; in CI (``CI=true``), where the trainer's lock installs it, fail."""
    try:
        import verl
    except ImportError as e:
        if os.environ.get("CI") == "true":
            raise RuntimeError(
                "verl is not importable in CI: requirements/trainer.lock should have installed it"
            ) from e
        pytest.skip(f"verl is not installed ({e}); run `make install` (requirements/trainer.lock has it)")
    return verl


def use_cpu_platform() -> None:
    """Select roundalign's CPU platform for verl (``roundalign.integrations.verl.cpu``, what a user of
    ``python -m roundalign.integrations.verl.loop`` gets); call before verl resolves its platform."""
    from roundalign.integrations.verl import cpu

    os.environ.update(cpu.environment())
    cpu.register()


def hide_trl_from_verl() -> None:
    import verl.models.transformers.monkey_patch as verl_monkey_patch

    verl_monkey_patch.is_trl_available = lambda: False


def build_engine(lr: float = 1e-6, strategy: str = "fsdp2"):
    """verl's ``FSDPEngine`` for the shipped tiny-qwen3 actor, initialized (model, FSDP, optimizer) on this rank."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    model_config = HFModelConfig(
        path=str(MODEL),
        use_remove_padding=False,
        enable_gradient_checkpointing=False,
        load_tokenizer=False,
        override_config={"attn_implementation": "sdpa"},
    )
    engine_config = FSDPEngineConfig(strategy=strategy, use_torch_compile=False)
    optimizer_config = FSDPOptimizerConfig(lr=lr, weight_decay=0.0)
    engine = FSDPEngine(model_config, engine_config, optimizer_config, CheckpointConfig())
    engine.initialize()
    return engine


__all__ = ["MODEL", "build_engine", "hide_trl_from_verl", "require_verl", "use_cpu_platform"]
