"""TRL's ``GRPOTrainer`` with roundalign: a rounding-aligned policy, the reference engine as sampler, Fair Cast sync.

A TRL user keeps ``GRPOTrainer`` and adds a few lines (docs/trl.md)::

    from roundalign.integrations.trl import EngineRolloutFunc, patch_policy

    patch_policy(model, "vllm")                       # the policy rounds where the engine does
    rollout = EngineRolloutFunc(engine_profile="vllm", sync="stochastic", seed=0)
    trainer = GRPOTrainer(model=model, args=args, reward_funcs=reward, train_dataset=ds, rollout_func=rollout)
    rollout.attach(trainer)                           # turns on TRL's IS correction, the sync and the metrics
    trainer.train()

- ``patch_policy`` runs ``roundalign.apply(policy, profile, allow_non_bf16=True)`` on the unwrapped policy (and on
  the trainer's reference model, when given a trainer that has one). TRL's usual CPU/GPU setup holds fp32
  parameters and computes under bf16 autocast; ``allow_non_bf16`` lets the patched ops round where the engine does
  there too.
- ``EngineRolloutFunc`` is a TRL ``rollout_func`` backed by ``roundalign.engine.Engine``: its own numerics profile, its
  own served 16-bit copy of the weights. It returns what TRL 1.16's contract asks for (prompt ids, completion ids,
  the sampler's per-token log-probs, ``processed`` as vLLM's ``processed_logprobs``), so TRL trains on the engine's
  samples as it would on vLLM's.
- After every optimizer step the fp32 master is exported to the engine with a ``roundalign.sync`` mode (``rne``,
  ``stochastic``, ``error-feedback``: ``Engine.load_weights(master, sync=, seed=)``), from the unwrapped policy,
  so under DDP every rank syncs its own engine from its own replica (same seed: the same served copy).

**TRL 1.16 applies no importance-sampling correction to a ``rollout_func``'s log-probs unless ``use_vllm`` is on**
(``grpo_trainer.py``: the correction, ``old_per_token_logps`` and the ``sampling/*`` metrics all sit behind
``if self.use_vllm and self.vllm_importance_sampling_correction``), and ``use_vllm=True`` cannot be set without vLLM
installed (``VLLMGeneration`` is built in ``__init__``). ``attach`` therefore sets the trainer's *attribute*
``use_vllm = True`` after construction and gives it ``vllm_generation``, a stand-in whose ``sync_weights()`` is
TRL's own per-step weight-sync call. That is the whole hook: TRL's vLLM branch then computes ``old_per_token_logps``,
its IS ratio (``vllm_importance_sampling_mode`` / ``_clip_min`` / ``_clip_max``) and ``sampling/*`` from the
engine's log-probs, exactly as it does for vLLM's. ``tests/test_integration_trl.py`` proves both halves.

A policy whose profile names engine kernels (``vllm-reference-kernels``, a vLLM ``-kernels`` profile) is exactly
on-policy: ``attach`` replaces TRL's fused log-prob head on it with the engine's log-softmax (``trl_logprobs.py``),
so every log-prob TRL computes is the sampler's bit for bit. The real vLLM as sampler: ``trl_vllm.VllmRolloutFunc``.

Metrics (``trl_metrics.py``) go into TRL's own metric buffers, so they appear in ``trainer.state.log_history`` and
every ``report_to`` backend with TRL's averaging over ``logging_steps``.
"""

from __future__ import annotations

import hashlib

import torch

from roundalign.engine import BACKENDS, Engine, SamplingParams
from roundalign.integrations import trl_metrics
from roundalign.integrations.seams import TRL_IS_BRANCH, check_source
from roundalign.integrations.trl_policy import (
    check_not_sharded,
    check_trainer,
    install_for_trainer,
    patch_policy,
    unwrap_policy,
)
from roundalign.numerics.dtypes import LOW_PRECISION
from roundalign.profiles import Profile, get_profile
from roundalign.sync import MODES, UpdateTracker

__all__ = ["EngineRolloutFunc", "log_mismatch", "patch_policy", "unwrap_policy"]


def _stream_seed(seed: int, rank: int, call: int) -> int:
    """The sampling seed of one rollout call: SHA-256 of (seed, rank, call), so ranks and steps draw apart."""
    digest = hashlib.sha256(f"roundalign.trl.rollout:{seed}:{rank}:{call}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class _EngineGeneration:
    """What ``GRPOTrainer`` calls ``vllm_generation`` once ``use_vllm`` is on. TRL calls ``sync_weights()`` before
    each new step's first rollout; the callback already synced after the optimizer step, so this only catches up
    when it did not run (a removed callback)."""

    def __init__(self, rollout: EngineRolloutFunc) -> None:
        self._rollout = rollout

    def sync_weights(self) -> None:
        self._rollout._sync_if_stale()


class EngineRolloutFunc:
    """A TRL ``rollout_func`` backed by the reference engine, with weight sync and mismatch metrics.

    Args:
        engine_profile: the engine's numerics (a profile name or ``Profile``); the policy is patched separately
            (``patch_policy``), to this profile for the aligned trainer or left stock for the baseline.
        backend: the engine backend, ``"kernels"`` or ``"inductor"`` (docs/engine.md).
        sync: how the fp32 master is exported to the engine after each optimizer step: ``"rne"``,
            ``"stochastic"`` or ``"error-feedback"`` (docs/sync.md). The last two need fp32 parameters.
        seed: seeds the export noise (per tensor, ``roundalign.sync.tensor_seed``) and the sampling (per rank and
            call).
        dtype: the engine's served dtype, ``torch.bfloat16`` or ``torch.float16``.
        attribution_every: every N training steps, re-score the step's rollouts with one region at a time switched
            from ``attribution_base`` to the engine profile and log the per-region shares; 0 turns it off.
        attribution_base: the trainer profile the attribution starts from (default stock ``"hf"``); its k3_kl on
            the same rollouts is logged next to the engine profile's.
        prefill_check: also re-score every batch with the engine's own one-sequence prefill at the sampling weights
            and log the trainer against it (``prefill/*``, as ``roundalign train --prefill-check``): the
            rounding-location gap without decode's attention shapes. Costs one engine prefill per completion.
        track_updates: log ``sync/*`` update visibility (``roundalign.sync.UpdateTracker``) at each sync.
        lag_window: the tracker's lag window (its memory is ``lag_window x 65536`` fp32 values).
    """

    def __init__(
        self,
        engine_profile: str | Profile = "vllm",
        *,
        backend: str = "kernels",
        sync: str = "rne",
        seed: int = 0,
        dtype: torch.dtype = torch.bfloat16,
        attribution_every: int = 0,
        attribution_base: str | Profile = "hf",
        prefill_check: bool = False,
        track_updates: bool = True,
        lag_window: int = 256,
    ) -> None:
        self.engine_profile = get_profile(engine_profile)
        self.attribution_base = get_profile(attribution_base)
        if backend not in BACKENDS:
            raise ValueError(f"unknown engine backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if sync not in MODES:
            raise ValueError(f"unknown sync mode {sync!r}; choose one of {', '.join(MODES)}")
        for name, value, least in (
            ("seed", seed, 0),
            ("attribution_every", attribution_every, 0),
            ("lag_window", lag_window, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        if dtype not in LOW_PRECISION:
            raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
        self.backend, self.sync_mode, self.seed, self.dtype = backend, sync, seed, dtype
        self.attribution_every, self.prefill_check = attribution_every, bool(prefill_check)
        self.tracker = UpdateTracker(lag_window=lag_window, seed=seed) if track_updates else None
        self.engine: Engine | None = None
        self.trainer = None
        self.syncs = 0  # exports done, the first at attach
        self.last_rollout: dict | None = None  # what the latest call returned (for inspection and tests)
        self.metrics: trl_metrics.MismatchLogger | None = None
        self._calls = 0
        self._synced_step: int | None = None

    # ----------------------------------------------------------------------------------------------------------
    # attaching to a trainer

    def attach(self, trainer) -> EngineRolloutFunc:
        """Bind to ``trainer`` (once, right after building it): check its generation settings, build the engine from
        the unwrapped policy, turn on TRL's IS correction for the engine's log-probs (module docstring), install the
        metrics and the sync callback, and export the policy once. Sets ``trainer.rollout_func`` when it is None."""
        if self.trainer is trainer:
            return self
        if self.trainer is not None:
            raise ValueError("this EngineRolloutFunc is already attached to another trainer; make one per trainer")
        check_trainer(trainer)
        for name, needles in TRL_IS_BRANCH:  # the hook below has no documented seam (integrations/seams.py)
            check_source(getattr(type(trainer), name), needles, "the vLLM branch's IS correction", "TRL")
        install_for_trainer(trainer)  # an engine-kernel policy scores as the engine does
        if trainer.rollout_func is None:
            trainer.rollout_func = self
        elif trainer.rollout_func is not self:
            raise ValueError("the trainer already has another rollout_func; pass rollout_func=this EngineRolloutFunc")
        policy = unwrap_policy(trainer)
        check_not_sharded(policy, "policy")
        if self.sync_mode != "rne":
            dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in policy.parameters()} - {"float32"})
            if dtypes:
                raise TypeError(
                    f"sync={self.sync_mode!r} exports fp32 master weights, but the policy has {', '.join(dtypes)} "
                    "parameters; load it in fp32 and train with bf16=True (TRL's usual setup), or use sync='rne'"
                )
        self.engine = self._make_engine(trainer, policy)
        self.trainer = trainer
        # The hook: TRL's vLLM branch (IS correction, sampling/* metrics, per-step sync call) reads these at run time.
        trainer.use_vllm = True
        trainer.vllm_generation = _EngineGeneration(self)
        trainer._last_loaded_step = trainer.state.global_step
        self.metrics = trl_metrics.MismatchLogger(
            self.engine_profile,
            self.attribution_every,
            self.attribution_base,
            self._prefill_logps if self.prefill_check else None,
        )
        self.metrics.install(trainer)
        trainer.add_callback(trl_metrics.RoundalignCallback(self))
        self.sync()
        return self

    def _make_engine(self, trainer, policy):
        """The sampler, built at ``attach`` from the unwrapped policy: the reference engine here."""
        return Engine(policy, profile=self.engine_profile, backend=self.backend, dtype=self.dtype)

    # ----------------------------------------------------------------------------------------------------------
    # the rollout_func

    def __call__(self, prompts: list, trainer) -> dict:
        if self.trainer is not trainer:
            raise RuntimeError(
                "call rollout.attach(trainer) right after building the GRPOTrainer, before train(): "
                "it turns on TRL's IS correction for the engine's log-probs and the weight sync"
            )
        prompt_ids, images, _ = trainer._tokenize_prompts(prompts)  # TRL's own chat template and tokenization
        if images is not None:
            raise ValueError("EngineRolloutFunc samples text only; this batch has images (a vision-language model)")
        prompt_ids = [list(map(int, p)) for p in prompt_ids]
        params = SamplingParams(
            temperature=float(trainer.temperature),
            top_p=float(trainer.top_p),
            top_k=int(trainer.top_k or 0),
            max_tokens=int(trainer.max_completion_length),
            stop_token_ids=tuple(trainer.eos_token_ids),
            logprobs_mode="processed",  # vLLM's processed_logprobs, what TRL asks its vLLM for
            seed=_stream_seed(self.seed, trainer.accelerator.process_index, self._calls),
        )
        self._calls += 1
        # TRL's sampler already repeats each prompt num_generations times: one completion per prompt received.
        outs = self.engine.generate(prompt_ids, params)
        self.last_rollout = {
            "prompt_ids": [o.prompt_token_ids for o in outs],
            "completion_ids": [o.token_ids for o in outs],
            "logprobs": [o.logprobs for o in outs],
        }
        return dict(self.last_rollout)

    def _prefill_logps(self, output: dict, mode: str) -> torch.Tensor:
        """The engine's prefill re-score of the latest rollout at TRL's temperature, (B, T) as TRL pads it."""
        r = self.last_rollout
        lps = self.engine.score(
            r["prompt_ids"], r["completion_ids"], mode="prefill", temperature=float(self.trainer.temperature)
        )
        out = torch.zeros(output["completion_mask"].shape, dtype=torch.float32)
        for row, lp in zip(out, lps, strict=True):
            row[: len(lp)] = lp
        return out.to(output["completion_mask"].device)

    # ----------------------------------------------------------------------------------------------------------
    # weight sync

    def sync(self) -> dict:
        """Export the unwrapped policy's weights to the engine with the sync mode; returns the ``sync/*`` update
        visibility (empty without ``track_updates``)."""
        if self.trainer is None:
            raise RuntimeError("EngineRolloutFunc.sync before attach(trainer)")
        policy = unwrap_policy(self.trainer)
        with torch.no_grad():
            master = {name: t.detach() for name, t in policy.state_dict().items()}
            served = self._load(master)
        self.syncs += 1
        self._synced_step = self.trainer.state.global_step
        if self.tracker is None:
            return {}
        # The tracker measures what reached the engine from the master; a bf16 policy's master is its own weights.
        return self.tracker.update({n: t.float() for n, t in master.items()}, {n: served[n] for n in master})

    def _load(self, master: dict) -> dict:
        """Export ``master`` with the sync mode into the engine; returns the served copy (HF names)."""
        self.engine.load_weights(master, sync=self.sync_mode, seed=self.seed)
        return self.engine.weights.state_dict()

    def _sync_if_stale(self) -> None:
        if self._synced_step != self.trainer.state.global_step:
            trl_metrics.log_sync(self.trainer, self.sync())


def log_mismatch(
    trainer,
    engine_profile: str | Profile = "vllm",
    *,
    attribution_every: int = 0,
    attribution_base: str | Profile = "hf",
) -> trl_metrics.MismatchLogger:
    """Log the mismatch metrics (``rollout_corr/*``, raw IS ratios, and every ``attribution_every`` steps the
    per-region attribution) on a trainer whose sampler is not an ``EngineRolloutFunc``: TRL's own vLLM
    (``use_vllm=True``), whose log-probs TRL hands back as ``sampling_per_token_logps``. ``engine_profile`` names
    the vLLM server's numerics, the target of the attribution. ``EngineRolloutFunc.attach`` does this itself."""
    install_for_trainer(trainer)
    logger = trl_metrics.MismatchLogger(get_profile(engine_profile), attribution_every, get_profile(attribution_base))
    logger.install(trainer)
    return logger
