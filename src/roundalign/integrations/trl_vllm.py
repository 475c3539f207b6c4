"""TRL's ``GRPOTrainer`` sampling with the real vLLM in the trainer's process: ``VllmRolloutFunc``.

TRL 1.16's own vLLM path supports vLLM 0.22 to 0.31 (``trl.import_utils.is_vllm_available`` warns outside that
range) and its colocated mode is written for GPUs, so roundalign brings vLLM in as a ``rollout_func`` instead: the
same hook as ``EngineRolloutFunc`` (TRL's IS correction, ``sampling/*`` and roundalign's metrics on the sampler's
log-probs; docs/trl.md), with ``roundalign.engines.vllm.inprocess.VllmEngine`` (a ``vllm.LLM`` driven as
``roundalign train --engine vllm`` drives it) in place of the reference engine::

    rollout = VllmRolloutFunc(model_dir, enforce_eager=True)      # starts vLLM first: it binds the threads
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    patch_policy(model, rollout.trainer_profile)                  # the build's -kernels profile: exact
    trainer = GRPOTrainer(model=model, args=args, ..., rollout_func=rollout)
    rollout.attach(trainer)
    trainer.train()

After every optimizer step the policy's weights go into vLLM in place (``collective_rpc("reload_weights")`` and a
prefix-cache reset), exported with the sync mode (``rne``, ``stochastic``, ``error-feedback``: ``roundalign.sync
.Exporter``, its state kept across steps). With the policy patched with ``trainer_profile`` in ``enforce_eager``
mode and ``sync="rne"``, every log-prob TRL computes is the sampler's bit for bit (tests/test_real_vllm_trl.py):
the policy's compute copy is then the served copy. With ``stochastic`` or ``error-feedback`` the served copy is
*meant* to differ from the policy's round-to-nearest compute copy, so TRL's IS correction sees that difference;
``roundalign train --engine vllm`` computes its loss on the served copy instead and stays exact in those modes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from roundalign.integrations.trl import EngineRolloutFunc
from roundalign.profiles import Profile
from roundalign.sync import Exporter

__all__ = ["VllmRolloutFunc"]


class VllmRolloutFunc(EngineRolloutFunc):
    """A TRL ``rollout_func`` backed by a real ``vllm.LLM`` in this process (module docstring).

    Args:
        model_dir: the HF model directory vLLM loads (the policy's checkpoint; the policy's own weights are
            exported into vLLM at ``attach`` and after every step).
        enforce_eager: vLLM's eager mode, where the ``-kernels`` profile is exact (docs/kernels.md); False runs
            vLLM's default compiled mode.
        sync, seed, attribution_every, attribution_base, track_updates, lag_window: as ``EngineRolloutFunc``.
        engine: an already started ``roundalign.engines.vllm.inprocess.VllmEngine`` on ``model_dir`` to reuse (one
            vLLM per process is what fits in memory); by default one is started here.
        quantization: vLLM serves a quantized copy in this scheme (``w8a8-int8``, ``fp8``, ``w4a16``, ...;
            docs/quantization.md): the checkpoint written to ``served_dir`` (default: a new temporary directory),
            exported onto the scheme's grid by ``sync`` at every sync; ``trainer_profile`` then computes it too.

    ``trainer_profile`` is the profile that makes the policy exact against this build (its ``-kernels`` profile);
    ``engine_profile`` (the metrics' target) is the same.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        enforce_eager: bool = True,
        sync: str = "rne",
        seed: int = 0,
        attribution_every: int = 0,
        attribution_base: str | Profile = "hf",
        track_updates: bool = True,
        lag_window: int = 256,
        engine=None,
        quantization: str | None = None,
        served_dir: str | Path | None = None,
    ) -> None:
        from roundalign.engines.vllm.inprocess import VllmEngine
        from roundalign.engines.vllm.profile import trainer_profile

        self.trainer_profile = trainer_profile(enforce_eager) + (
            f"+quantization={quantization}" if quantization else ""
        )
        super().__init__(
            self.trainer_profile,
            sync=sync,
            seed=seed,
            attribution_every=attribution_every,
            attribution_base=attribution_base,
            track_updates=track_updates,
            lag_window=lag_window,
        )
        self.model_dir, self.enforce_eager = Path(model_dir), bool(enforce_eager)
        served = None if engine is None or engine.scheme is None else str(engine.scheme)
        if engine is not None and (engine.model_dir, engine.info["enforce_eager"], served) != (
            self.model_dir,
            enforce_eager,
            quantization,
        ):
            raise ValueError(
                f"engine= runs {engine.model_dir} (enforce_eager={engine.info.get('enforce_eager')}, quantization="
                f"{served}); this rollout asks for {self.model_dir} (enforce_eager={enforce_eager}, quantization="
                f"{quantization}): pass a matching engine or none"
            )
        if engine is None:
            if quantization and served_dir is None:
                import tempfile

                served_dir = Path(tempfile.mkdtemp(prefix="roundalign-served-")) / "served-model"
            engine = VllmEngine(
                self.model_dir, enforce_eager=self.enforce_eager, seed=seed, dtype=torch.bfloat16,
                quantization=quantization, served_dir=served_dir,
            )  # fmt: skip
        self.vllm = engine
        # A quantized vLLM is exported onto its grid by the sync mode (Fair Cast on the grid, roundalign.sync.grid).
        self.scheme = quantization
        self.exporter = Exporter(sync, seed=seed, dtype=torch.bfloat16, scheme=quantization)

    def _make_engine(self, trainer, policy):
        if trainer.accelerator.num_processes > 1:
            raise ValueError(
                "VllmRolloutFunc runs one vLLM inside the trainer's process; under DDP every rank would start its "
                "own. Train in one process, or serve vLLM separately and use TRL's vllm_mode='server' with "
                "log_mismatch"
            )
        vocab = self.vllm.llm.llm_engine.vllm_config.model_config.get_vocab_size()
        if policy.config.vocab_size != vocab:
            raise ValueError(
                f"the policy's vocabulary ({policy.config.vocab_size}) is not the one vLLM serves from "
                f"{self.model_dir} ({vocab}): give VllmRolloutFunc the policy's own checkpoint directory"
            )
        return self.vllm

    def _load(self, master: dict) -> dict:
        served = self.exporter.export(master)
        self.vllm.load_weights(served)
        if self.scheme is None:
            return served
        from roundalign.quant.schemes import Scheme
        from roundalign.sync.grid import served_weights

        return served_weights(served, Scheme.parse(self.scheme))  # what the engine multiplies by, by HF name
