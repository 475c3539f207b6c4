"""The GRPO loop of ``roundalign train``: rollout, recompute, update, sync, once per step.

One step, with the timing key each phase is logged under:

1. ``timing_s/rollout``: the engine (the reference engine, or a real vLLM: rl/vllm.py) samples ``group_size``
   completions for each of ``prompts_per_step`` problems, from its served 16-bit copy (the reference engine under
   the engine profile). Its decode-time log-probs (``processed``: after temperature and top-p, verl's default
   ``logprobs_mode``) are the sampler's log-probs, as verl and TRL take them.
   Rewards are exact-answer checks.
2. ``timing_s/recompute``: the trainer recomputes every completion's log-probs on its compute copy (verl's
   ``old_log_prob``), one unpadded sequence per forward. Trainer-vs-sampler mismatch metrics (the probe's, with
   verl's and TRL's names) and the importance-sampling weights come from these and the sampler's log-probs.
3. ``timing_s/update``: ``inner_epochs`` passes of the objective (rl/objective.py) over the batch, one sequence per
   micro-batch, gradients summed in fp32 into the master; each pass ends with clipping and an optimizer step on the
   fp32 master, and the next pass computes on the refreshed compute copy.
   Sequences whose advantage is 0 (every completion of their group got the same reward) add exactly nothing to the
   gradient, so they are skipped; ``actor/*`` statistics cover the sequences that were trained on.
4. ``timing_s/sync``: the master is exported to the engine (``roundalign.sync``, ``--sync``), the trainer's compute
   copy is refreshed (the RNE cast, or the served copy under ``--loss-on-served``), and the update visibility of the
   export is measured.

Every ``eval_every`` steps (and at step 0 and the last step) the engine answers the held-out problems greedily:
``eval/accuracy``. ``docs/train.md`` lists every metric.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from roundalign import durable
from roundalign.engine import Engine, SamplingParams
from roundalign.errors import ExitStatus, Failure, UserError
from roundalign.numerics.correction import is_weights
from roundalign.numerics.dtypes import BY_NAME as DTYPE
from roundalign.numerics.metrics import mismatch_metrics
from roundalign.profiles import PROFILES, get_profile
from roundalign.rl import checkpoint, faults
from roundalign.rl.config import TRAINER_QUANTIZATION_ALIGNED, TRAINER_SAME_AS_ENGINE, TrainConfig
from roundalign.rl.data import make_task, sampling_seed
from roundalign.rl.logbook import Logbook, Progress
from roundalign.rl.objective import group_advantages, policy_loss
from roundalign.rl.osol_step import OsolStep
from roundalign.rl.policy import NonFiniteError, Policy
from roundalign.sync import Exporter, UpdateTracker
from roundalign.sync.grid import served_weights

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # a checkpoint's served copy: what is cast back on resume

# The prefill check logs these mismatch metrics, renamed prefill/<name>.
PREFILL_KEYS = (
    "rollout_corr/k3_kl",
    "mismatch/log_ratio_rms",
    "mismatch/bitwise_equal_frac",
    "mismatch/log_ratio_max_abs",
)


class TrainingDiverged(Failure, RuntimeError):
    """A non-finite loss or gradient stopped the run; the message names the step, the quantity and the checkpoint."""

    status = ExitStatus.DIVERGED


def _pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) fp32 values (0 in padding) and the (B, T) bool mask of real tokens."""
    width = max(len(r) for r in rows)
    values = torch.zeros(len(rows), width)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        values[i, : len(r)] = r
        mask[i, : len(r)] = True
    return values, mask


class Run:
    """The state of one run: engine, policy, exporter, tracker, task, logbook."""

    def __init__(self, config: TrainConfig, out: Path, console=None, tensorboard: bool = True):
        self.config, self.out = config, out
        self.model_dir = _model_dir(config.model)
        if config.engine == "vllm":  # started first: it binds this process's threads, which the trainer then shares
            from roundalign.engines.vllm.inprocess import VllmEngine

            self.engine = VllmEngine(
                self.model_dir, enforce_eager=config.enforce_eager, seed=config.seed, dtype=DTYPE[config.dtype],
                quantization=config.quantization, served_dir=out / "served-model",
            )  # fmt: skip
        else:
            self.engine = Engine(
                self.model_dir, config.engine_profile, config.engine_backend, dtype=DTYPE[config.dtype]
            )
        self.policy = Policy(self.model_dir, config)
        if self.engine.tokenizer is None:
            raise UserError(f"{str(self.model_dir)!r} has no tokenizer files; train needs one to build prompts")
        # A quantized engine is exported onto its grid by the sync mode (Fair Cast on the grid, roundalign.sync.grid).
        self.exporter = Exporter(config.sync, seed=config.seed, dtype=DTYPE[config.dtype], scheme=config.served_scheme)
        self.tracker = UpdateTracker(lag_window=config.lag_window, seed=config.seed)
        self.task = make_task(config)
        self.osol = OsolStep(config, len(self.task.domains)) if config.adv_estimator == "osol" else None
        self.correction = config.correction()
        self.console = console
        self.tensorboard = tensorboard

    # ----------------------------------------------------------------------------------------------------------

    def sync(self, step: int = 0) -> dict:
        master = self.policy.master_state()
        served = self.exporter.export(master)
        faults.point("export", step)
        self._serve(served)
        metrics = self.tracker.update(master, served_weights(served, self.config.served_scheme))
        if self.config.audit_served:  # every weight read back from vLLM; a mismatch stops the run, naming it
            metrics["sync/served_checked"] = self.engine.audit(served)
        return metrics

    def _serve(self, served: dict) -> None:
        """The engine serves ``served``; the trainer computes on it (--loss-on-served) or on the master's RNE cast."""
        self.engine.load_weights(served)
        source = served if self.config.resolved_loss_on_served else None
        self.policy.set_compute_weights(source)
        if self.osol is not None:  # the new weights become pi_k; the ones before, the footprint's pi_{k-1}
            rne = self.config.sync == "rne" and not self.config.served_scheme.quantized  # served == the RNE cast
            self.osol.remember(self.policy, source, served if rne else None)
        self.served = served

    def evaluate(self) -> dict:
        """Greedy held-out reward: ``eval/accuracy`` (over several domains, their macro average) and, with
        ``--domains``, ``eval/<domain>/reward``."""
        task = self.task
        prompts = [task.prompt(p) for p in task.eval_set]
        outs = self.engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=self.config.max_tokens))
        scores = [task.reward(o.text, p) for o, p in zip(outs, task.eval_set, strict=True)]
        if not self.config.domains:
            return {"eval/accuracy": sum(scores) / len(scores)}
        out = per_domain(scores, [task.domain(p) for p in task.eval_set], task.domains, "eval/{}/reward")
        out["eval/accuracy"] = sum(out.values()) / len(out)  # the macro average: every domain counts the same
        return out

    def step(self, step: int) -> dict:
        c, m = self.config, {}
        t0 = time.perf_counter()
        problems = self.task.train_batch(step, c.prompts_per_step)
        batch = [p for p in problems for _ in range(c.group_size)]  # groups are consecutive
        params = SamplingParams(
            temperature=c.temperature,
            top_p=c.top_p,
            max_tokens=c.max_tokens,
            seed=sampling_seed(c.seed, step),
            logprobs_mode="processed",
        )
        outs = self.engine.generate([self.task.prompt(p) for p in batch], params)
        faults.point("sampling", step)
        rewards = torch.tensor([self.task.reward(o.text, p) for o, p in zip(outs, batch, strict=True)])
        domains = [self.task.domain(p) for p in batch]
        if c.domains:
            m |= per_domain(rewards.tolist(), domains, self.task.domains, "reward/{}/mean")
        lengths = torch.tensor([len(o.token_ids) for o in outs], dtype=torch.float64)
        m["reward/mean"], m["reward/std"] = float(rewards.mean()), float(rewards.std())
        m["accuracy/train"] = float((rewards == 1).double().mean())
        m["response_length/mean"], m["response_length/max"] = float(lengths.mean()), float(lengths.max())
        m["response_length/clip_ratio"] = sum(o.finish_reason == "length" for o in outs) / len(outs)
        t1 = time.perf_counter()

        old, entropy = zip(*(self.policy.logprobs(o.prompt_token_ids, o.token_ids) for o in outs), strict=True)
        bad = sum(int((~torch.isfinite(x)).sum()) for x in old)
        if bad:
            raise NonFiniteError(f"step {step}: the trainer's recomputed log-probs are non-finite at {bad} tokens")
        sampler = [torch.tensor(o.logprobs, dtype=torch.float32) for o in outs]
        m |= mismatch_metrics(list(old), sampler)
        m["actor/entropy"] = float(torch.cat(entropy).double().mean())
        old_pad, mask = _pad(list(old))
        weights, is_metrics = is_weights(old_pad, _pad(sampler)[0], mask, self.correction)
        m |= is_metrics
        if c.prefill_check:
            m |= self._prefill_check(outs, list(old))
        faults.point("recompute", step)
        t2 = time.perf_counter()

        advantages = group_advantages(rewards, c.group_size)
        if self.osol is not None:  # per-token advantages: OSOL's footprint on the focus domain's tokens
            advantages, osol_metrics = self.osol.advantages(
                step, self.policy, outs, domains, advantages, old_pad, mask, _pad(sampler)[0]
            )
            m |= osol_metrics
        t_update = time.perf_counter() if self.osol is not None else t2  # the phases sum to timing_s/step
        m |= self._update(step, outs, old_pad, mask, weights, advantages)
        t3 = time.perf_counter()
        m |= self.sync(step)
        t4 = t5 = time.perf_counter()
        if self.osol is not None:  # how much of the last update this one undid, on the focus tokens
            m |= self.osol.backtracking(step, self.policy, outs)
            t5 = time.perf_counter()
            m["timing_s/osol"] = t5 - t4 + (t_update - t2)  # its two forwards: the phases sum to timing_s/step
        m |= {
            "timing_s/rollout": t1 - t0,
            "timing_s/recompute": t2 - t1,
            "timing_s/update": t3 - t_update,
            "timing_s/sync": t4 - t3,
            "timing_s/step": t5 - t0,
        }
        return m

    def _prefill_check(self, outs, old: list[torch.Tensor]) -> dict:
        """The trainer's recompute against the engine's own prefill re-score of the same tokens (raw log-probs at
        the step's temperature): what is left of the mismatch when decode's attention shapes are taken out, i.e.
        the rounding-location gap alone. 0 and 1.0 exactly when the trainer rounds where the engine does."""
        scored = self.engine.score(
            [o.prompt_token_ids for o in outs],
            [o.token_ids for o in outs],
            mode="prefill",
            temperature=self.config.temperature,
        )
        full = mismatch_metrics(old, scored)
        return {f"prefill/{k.split('/', 1)[1]}": full[k] for k in PREFILL_KEYS}

    def _update(self, step, outs, old_pad, mask, weights, advantages) -> dict:
        """``inner_epochs`` passes over the batch, each ending with an optimizer step (verl's ``ppo_epochs`` with
        one mini-batch per epoch). Between passes the compute copy is refreshed by the step's rule (the RNE cast,
        or an export with the run's exporter under ``--loss-on-served``); the engine is synced once, after the last.
        Statistics are means over the passes."""
        c, policy = self.config, self.policy
        trained = [i for i in range(len(outs)) if bool((advantages[i] != 0).any())]
        n_tokens = int(mask[trained].sum()) if trained else 0
        totals = {"actor/pg_loss": 0.0, "actor/pg_clipfrac": 0.0, "actor/ppo_kl": 0.0}
        updates: list[dict] = []
        for epoch in range(c.inner_epochs):
            if epoch:
                served = self.exporter.export(policy.master_state()) if c.resolved_loss_on_served else None
                policy.set_compute_weights(served)
            policy.zero_grad()
            for i in trained:
                o, n = outs[i], len(outs[i].token_ids)
                logp = policy.logprobs_with_grad(o.prompt_token_ids, o.token_ids)
                bad = int((~torch.isfinite(logp)).sum())
                if bad:
                    raise NonFiniteError(
                        f"step {step}: the loss is non-finite: the trainer's log-probs are non-finite "
                        f"at {bad} of {n} completion tokens of sequence {i}"
                    )
                result = policy_loss(
                    logp[None],
                    old_pad[i : i + 1, :n],
                    advantages[i : i + 1] if advantages.dim() == 1 else advantages[i : i + 1, :n],
                    mask[i : i + 1, :n],
                    loss_type=c.loss_type,
                    clip_eps=c.resolved_clip_eps,
                    clip_eps_high=c.clip_eps_high,
                    is_weights=weights[i : i + 1, :n],
                    normalizer=n_tokens,
                )
                policy.backward(result.loss, step)
                totals["actor/pg_loss"] += float(result.loss.detach()) / c.inner_epochs
                for k in ("actor/pg_clipfrac", "actor/ppo_kl"):  # token means: weight each sequence by its tokens
                    totals[k] += result.stats[k] * n / (n_tokens * c.inner_epochs)
            faults.point("backward", step)
            updates.append(policy.step(step))
        out = {k: (v if trained else None) for k, v in totals.items()}
        out["actor/trained_sequence_frac"] = len(trained) / len(outs)
        return out | {k: sum(u[k] for u in updates) / len(updates) for k in updates[0]}

    # ----------------------------------------------------------------------------------------------------------

    def state(self) -> dict:
        return {
            "policy": self.policy.state_dict(),
            "exporter": self.exporter.state_dict(),
            "tracker": self.tracker.state_dict(),
        } | ({"osol": self.osol.state_dict()} if self.osol is not None else {})

    def restore(self) -> int | None:
        """Load the newest readable checkpoint; its step, or None when the run has none."""
        loaded = checkpoint.load_latest(self.out, report=self._say)
        if loaded is None:
            return None
        master, served, state = loaded
        self.policy.load_state_dict(master, state["policy"])
        self.exporter.load_state_dict(state["exporter"])
        self.tracker.load_state_dict(state["tracker"])
        self._serve({k: v.to(DTYPE[self.config.dtype]) if v.dtype in _FLOATS else v for k, v in served.items()})
        if self.osol is not None:  # after _serve, which remembered the weights before the restore
            self.osol.load_state_dict(state.get("osol"))
        return int(state["step"])

    def _say(self, message: str) -> None:
        if self.console is not None:
            self.console.print(f"[yellow]{message}[/yellow]")

    def save(self, step: int) -> Path:
        return checkpoint.save(self.out, step, self.policy.master_state(), self.served, self.state())


def per_domain(values: list[float], domains: list[int], names: tuple[str, ...], key: str) -> dict[str, float | None]:
    """The mean of ``values`` per domain, under ``key.format(name)`` (None for a domain without values)."""
    out: dict[str, float | None] = {}
    for i, name in enumerate(names):
        mine = [v for v, d in zip(values, domains, strict=True) if d == i]
        out[key.format(name)] = sum(mine) / len(mine) if mine else None
    return out


def _model_dir(model: str | None) -> Path:
    """``--model``: a directory, or the name of a shipped model (default tiny-qwen3)."""
    from roundalign.models import list_models
    from roundalign.models import path as model_path

    if model is None or (model in list_models() and not Path(model).is_dir()):
        return model_path(model or "tiny-qwen3")
    return Path(model)


def _restart(out: Path, console, why: str) -> None:
    """Start the run in ``out`` over from step 0, saying so: its metrics (and TensorBoard events) are cleared."""
    if console is not None:
        console.print(f"[yellow]{out}: {why}; starting it over from step 0[/yellow]")
    (out / "metrics.jsonl").unlink(missing_ok=True)
    shutil.rmtree(out / "tensorboard", ignore_errors=True)


def resolved(config: TrainConfig) -> TrainConfig:
    """``config`` with its names resolved as the run records them in config.json: ``--trainer-profile engine``
    (with vLLM) and ``quantization-aligned`` as the profiles they stand for, and the reference engine's profile
    with ``--quantization``'s scheme. ``roundalign compare`` compares a finished cell's settings with these."""
    if config.engine == "vllm" and config.trainer_profile == TRAINER_SAME_AS_ENGINE:
        from roundalign.engines.vllm.profile import trainer_profile

        # The exact trainer of this vLLM build, named in config.json (a resumed run keeps it).
        exact = trainer_profile(config.enforce_eager)
        quantized = f"+quantization={config.quantization}" if config.quantization else ""
        config = config.replace(trainer_profile=exact + quantized)
    elif config.engine == "reference" and config.quantization:
        # The reference engine serves the scheme: its profile says so (and the trainer's, under 'engine').
        engine = get_profile(config.engine_profile).replace(quantization=config.quantization)
        if engine.name.partition("+")[0] not in PROFILES or get_profile(engine.name).rules() != engine.rules():
            raise UserError(
                f"--quantization applies to a built-in --engine-profile; {config.engine_profile} is a profile file: "
                "set its quantization (Profile.replace(quantization=...).save(path)) and give that file"
            )
        config = config.replace(engine_profile=engine.name)
    if config.trainer_profile == TRAINER_QUANTIZATION_ALIGNED:
        config = config.replace(trainer_profile=_quantization_aligned(config))
    return config


def _quantization_aligned(config: TrainConfig) -> str:
    """The profile ``--trainer-profile quantization-aligned`` names: the engine's rounding rules (for vLLM, its
    build's) and its scheme, computed with torch's kernels."""
    if config.engine == "vllm":
        from roundalign.engines.vllm.profile import trainer_profile

        base = get_profile(trainer_profile(config.enforce_eager)).rounding_only().name
        return base + (f"+quantization={config.quantization}" if config.quantization else "")
    return get_profile(config.engine_profile).rounding_only().name  # keeps the engine's scheme


def train(
    config: TrainConfig,
    out: Path,
    *,
    resume: bool = False,
    console=None,
    progress: bool = True,
    tensorboard: bool = True,
) -> Path:
    """Run (or resume) a training run into ``out``; returns ``out``. See the module docstring."""
    out = Path(out)
    metrics_path = out / "metrics.jsonl"
    if not resume and metrics_path.exists():
        if checkpoint.list_checkpoints(out):
            raise UserError(
                f"{str(out)!r} already holds a run (metrics.jsonl and checkpoints); continue it with --resume {out} or "
                "choose another --out"
            )
        _restart(out, console, "it holds a run that stopped before its first checkpoint")
    config = resolved(config)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)  # nothing in a step draws from the global generator; this is belt and braces
    run = Run(config, out, console, tensorboard)
    start = run.restore() if resume else None
    if start is not None:
        if start >= config.steps:
            raise UserError(
                f"{str(out)!r} is already at step {start} of {config.steps}; pass --steps N > {start} to continue it"
            )
        checkpoint.truncate_metrics(metrics_path, start)
    elif resume:  # a run killed before its first checkpoint: nothing to continue from, so it starts over
        _restart(out, console, "it has no checkpoint yet")
    # what the run now is (--steps, --save-every and --save-minutes may change on resume)
    durable.write_text(out / "config.json", json.dumps(config.to_dict(), indent=2) + "\n")
    if start is None:
        start = 0
        run.sync()  # step 0: the first export (exact for a 16-bit checkpoint) initialises the tracker
    book = Logbook(out, tensorboard, console)
    last_save = time.monotonic()
    bar = Progress(config.steps, start, console, progress)
    try:
        if start == 0:
            t = time.perf_counter()
            book.write(0, run.evaluate() | {"timing_s/eval": time.perf_counter() - t})
        for step in range(start + 1, config.steps + 1):
            try:
                metrics = run.step(step)
            except NonFiniteError as exc:
                kept = checkpoint.list_checkpoints(out)
                where = f"the last good checkpoint is {kept[-1]}" if kept else "no checkpoint was saved before it"
                raise TrainingDiverged(f"{exc}; the run stops here and {where}") from None
            if step == config.steps or (config.eval_every and step % config.eval_every == 0):
                t = time.perf_counter()
                metrics |= run.evaluate()
                metrics["timing_s/eval"] = time.perf_counter() - t
            book.write(step, metrics)
            faults.point("metrics", step)
            bar.update(metrics)
            due = config.save_minutes and time.monotonic() - last_save >= 60 * config.save_minutes
            if step == config.steps or (config.save_every and step % config.save_every == 0) or due:
                run.save(step)
                last_save = time.monotonic()
    finally:
        bar.close()
        book.close()
    return out
