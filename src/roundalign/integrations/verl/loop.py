"""``python -m roundalign.integrations.verl.loop``: verl's whole GRPO loop (``main_ppo``) with roundalign inside it,
on this machine's CPU, with vLLM's CPU build as its rollout; then verl's own mismatch metrics, step by step.

It writes what the run needs into ``--out`` (the arithmetic task as verl's parquet rows, the shipped tiny-qwen3 with
a chat template that passes the prompt through, verl's reward function is ``reward.py``), then runs
``python -m roundalign.integrations.verl.main_ppo`` with verl's CPU platform (``cpu.py``), verl's metrics logged to
``metrics.jsonl`` and its output to ``verl.log``, and summarizes: per step ``rollout_corr/k3_kl``,
``training/rollout_probs_diff_max`` and the IS ratios, and (``--audit``) whether each engine replica served exactly
the weights the trainer exported at every sync (``audit.py``). ``--trainer exact`` is the exact trainer for the vLLM
installed here (``engines.vllm.profile.trainer_profile``), ``stock`` leaves verl's actor as it is.

Every hydra override it passes is listed by ``overrides(cfg)`` with what it is for (docs/verl.md); ``--dry-run``
prints the command instead of running it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from roundalign import durable
from roundalign.errors import UserError
from roundalign.integrations.verl import audit, cpu
from roundalign.integrations.verl import reward as reward_module
from roundalign.integrations.verl.supervise import first_failure, supervise
from roundalign.options import field_help, option
from roundalign.sync import MODES as SYNC_MODES

# Passes the prompt text through unchanged: the shipped model was trained on the bare prompt (tasks.format_prompt).
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
METRICS = (
    "rollout_corr/k3_kl", "rollout_corr/kl", "training/rollout_probs_diff_max", "rollout_corr/rollout_is_mean",
    "rollout_corr/rollout_is_max", "rollout_corr/rollout_is_min", "critic/score/mean", "actor/grad_norm",
    "actor/entropy", "timing_s/step",
)  # fmt: skip


@dataclass(frozen=True)
class LoopConfig:
    out: str = option("verl-run", "run directory: data, model, verl.log, metrics.jsonl, summary.json")
    steps: int = option(3, "GRPO steps (default {default})")
    trainer: str = option("exact", "exact (vLLM's kernels and rules: bit-equal log-probs), stock (verl unchanged), "
                          "aligned (rounding rules only), or a profile name (default {default})")  # fmt: skip
    sync: str = option("rne", "weight export: rne (verl's cast), stochastic or error-feedback (default {default})")
    ranks: int = option(2, "FSDP ranks, and vLLM replicas (one per rank, tensor parallel 1) (default {default})")
    prompts: int = option(4, "prompts per step (default {default})")
    samples: int = option(4, "responses per prompt, the GRPO group (default {default})")
    max_response_length: int = option(32, "max response tokens (default {default})")
    level: int = option(
        3, "arithmetic task level, 1-3; the shipped model solves about half of level 3 (default {default})"
    )
    entropy_coeff: float = option(0.0, "verl's entropy bonus; moves a model that earns no reward (default {default})")
    lr: float = option(1e-4, "actor learning rate (default {default})")
    seed: int = option(0, "data and sampling seed (default {default})")
    audit: bool = option(True, "check every sync's served weights against the export (default {default})")
    model: str = option("", "HF model directory (default: the shipped tiny-qwen3)")
    timeout: float = option(0.0, "seconds before the run is stopped, 0 for none (default {default})")

    def validate(self) -> None:
        if self.steps < 1 or self.ranks < 1 or self.prompts < 1 or self.samples < 2:
            raise UserError("--steps, --ranks and --prompts must be at least 1 and --samples at least 2 (GRPO groups)")
        if (self.prompts * self.samples) % self.ranks:
            raise UserError(
                f"--prompts x --samples ({self.prompts * self.samples}) must divide among {self.ranks} ranks"
            )
        if self.sync not in SYNC_MODES:
            raise UserError(f"--sync {self.sync!r}: choose {', '.join(SYNC_MODES)}")


def trainer_profile(trainer: str) -> str | None:
    """The profile ``--trainer`` names (None: stock verl)."""
    if trainer == "stock":
        return None
    from roundalign.engines.vllm.build import build_info
    from roundalign.engines.vllm.profile import trainer_profile as exact
    from roundalign.profiles import for_engine

    if trainer == "exact":
        return exact(enforce_eager=True)
    return for_engine(build_info(True)) if trainer == "aligned" else trainer


def write_inputs(cfg: LoopConfig, out: Path) -> dict[str, Path]:
    """The task's rows (train and a small validation set) and the model directory, under ``out``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from roundalign.models import path as model_path
    from roundalign.tasks import format_prompt, make_problems

    paths = {"train": out / "data" / "train.parquet", "val": out / "data" / "val.parquet", "model": out / "model"}
    paths["train"].parent.mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", cfg.prompts * cfg.steps, cfg.seed), ("val", cfg.prompts, cfg.seed + 1)):
        rows = [
            {"data_source": reward_module.DATA_SOURCE, "prompt": [{"role": "user", "content": format_prompt(p)}],
             "ability": "arithmetic", "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
             "extra_info": {"index": i, "split": split}}
            for i, p in enumerate(make_problems(n, cfg.level, seed))
        ]  # fmt: skip
        pq.write_table(pa.Table.from_pylist(rows), paths[split])
    source = Path(cfg.model) if cfg.model else Path(model_path("tiny-qwen3"))
    shutil.copytree(source, paths["model"], dirs_exist_ok=True)
    tokenizer_config = paths["model"] / "tokenizer_config.json"
    settings = json.loads(tokenizer_config.read_text())
    settings.setdefault("chat_template", CHAT_TEMPLATE)
    tokenizer_config.write_text(json.dumps(settings, indent=2))
    return paths


def overrides(cfg: LoopConfig, paths: dict[str, Path]) -> list[str]:
    """verl's hydra overrides for this run; docs/verl.md says what each is for."""
    batch = cfg.prompts
    return [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        "algorithm.rollout_correction.rollout_is=token",  # verl's IS weights and their rollout_corr/* metrics
        f"data.train_files={paths['train']}", f"data.val_files={paths['val']}",
        f"data.train_batch_size={batch}", "data.max_prompt_length=96",
        f"data.max_response_length={cfg.max_response_length}", "data.dataloader_num_workers=0",
        f"data.seed={cfg.seed}",
        f"actor_rollout_ref.model.path={paths['model']}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",  # flash-attention 2 needs a GPU
        "actor_rollout_ref.model.use_remove_padding=False",  # packed sequences need flash-attention's varlen kernel
        "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.ref.strategy=fsdp2",  # FSDP1 wants a GPU id
        f"actor_rollout_ref.actor.optim.lr={cfg.lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_kl_loss=False", f"actor_rollout_ref.actor.entropy_coeff={cfg.entropy_coeff}",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.n={cfg.samples}", "actor_rollout_ref.rollout.enforce_eager=True",
        f"actor_rollout_ref.rollout.max_model_len={96 + cfg.max_response_length}",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.calculate_log_probs=True",  # the sampler's log-probs, for the mismatch metrics
        "actor_rollout_ref.rollout.agent.num_workers=1",  # verl starts 8 agent-loop actors, 0.7 GB each
        f"actor_rollout_ref.rollout.seed={cfg.seed}",
        "+actor_rollout_ref.rollout.enable_sleep_mode=False",  # vLLM's CPU build has no sleep mode
        "actor_rollout_ref.rollout.free_cache_engine=False",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=naive",  # the others move weights with CUDA
        f"reward.custom_reward_function.path={reward_module.__file__}",
        "reward.custom_reward_function.name=compute_score", "reward.num_workers=1",
        "trainer.logger=[console,file]", "trainer.project_name=roundalign",
        f"trainer.experiment_name={cfg.trainer}", f"trainer.total_training_steps={cfg.steps}",
        "trainer.total_epochs=1", "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=False",
        f"trainer.n_gpus_per_node={cfg.ranks}", "trainer.nnodes=1", "trainer.device=cpu",
        f"trainer.default_local_dir={paths['model'].parent / 'checkpoints'}",
        "ray_kwargs.ray_init.num_cpus=32",  # TransferQueue's actors each ask Ray for a CPU; 2 cores would hang
        f"+ray_kwargs.ray_init.num_gpus={cfg.ranks}",  # logical GPUs: the CPU platform's resource places the ranks
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]  # fmt: skip


def environment(cfg: LoopConfig, out: Path, profile: str | None) -> dict[str, str]:
    """The environment of verl's driver: the CPU platform, roundalign's settings, verl's file logger."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROUNDALIGN_")}
    env.update(cpu.environment(env))
    env.update({"VERL_FILE_LOGGER_PATH": str(out / "metrics.jsonl"), "HF_HUB_OFFLINE": "1", "RAY_DEDUP_LOGS": "0",
                "TOKENIZERS_PARALLELISM": "false",
                # vLLM's CPU attention splits a long sequence's keys among threads by the thread count; unsplit, the
                # engine's attention is the same at any thread count, and the exact trainer's kernel reads the same
                # variable (kernels/vllm_cpu.py). 1 GiB of KV cache per engine is ample here.
                "VLLM_CPU_ATTN_SPLIT_KV": "0", "VLLM_CPU_KVCACHE_SPACE": "1"})  # fmt: skip
    if profile is not None:
        env["ROUNDALIGN_PROFILE"] = profile
    if cfg.sync != "rne":
        env["ROUNDALIGN_SYNC"] = cfg.sync
    if cfg.audit:
        env[audit.ENV] = str(out / "audit")
    return env


def summarize(out: Path, with_audit: bool) -> dict:
    """verl's metrics per step (``METRICS``) from ``metrics.jsonl``, and the audit's verdict."""
    steps = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        data = record.get("data", record)
        steps.append({"step": record.get("step"), **{k: data.get(k) for k in METRICS}})
    summary = {"steps": steps}
    if with_audit:
        summary["audit"] = audit.check(out / "audit")
    return summary


def run(cfg: LoopConfig, dry_run: bool = False) -> dict:
    """Write the inputs, run verl, return ``summarize``; a failed run raises with the log's last lines."""
    cfg.validate()
    out = Path(cfg.out).resolve()
    for stale in ("metrics.jsonl", "audit"):
        target = out / stale
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    profile = trainer_profile(cfg.trainer)
    paths = write_inputs(cfg, out)
    command = [sys.executable, "-m", "roundalign.integrations.verl.main_ppo", *overrides(cfg, paths)]
    env = environment(cfg, out, profile)
    (out / "command.sh").write_text(
        " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()) if k.startswith(("ROUNDALIGN_", "VERL_")))
        + " \\\n  "
        + " \\\n  ".join(shlex.quote(c) for c in command)
        + "\n"
    )
    if dry_run:
        return {"command": str(out / "command.sh")}
    code = supervise(command, env, out, cfg.timeout)
    if code != 0 or not (out / "metrics.jsonl").exists():
        raise RuntimeError(
            f"verl's main_ppo exited with {code}; the first process to fail, from {out / 'verl.log'}:\n"
            + first_failure((out / "verl.log").read_text(errors="replace"))
        )
    summary = {"trainer": cfg.trainer, "profile": profile, "sync": cfg.sync, **summarize(out, cfg.audit)}
    durable.write_text(out / "summary.json", json.dumps(summary, indent=2))
    return summary


def table(summaries: dict[str, dict]) -> str:
    """A markdown table, step by step, of verl's mismatch metrics and step time for each run (``summary.json``)."""
    names = list(summaries)
    head = "| step | " + " | ".join(
        f"{n}: `rollout_corr/k3_kl` | {n}: `training/rollout_probs_diff_max` | {n}: IS ratio min-max | {n}: s/step"
        for n in names
    )
    rows = [head + " |", "|---" * (1 + 4 * len(names)) + "|"]
    steps = max(len(s["steps"]) for s in summaries.values())
    for i in range(steps):
        cells = []
        for n in names:
            st = summaries[n]["steps"][i] if i < len(summaries[n]["steps"]) else {}
            lo, hi = st.get("rollout_corr/rollout_is_min"), st.get("rollout_corr/rollout_is_max")
            cells += [_num(st.get("rollout_corr/k3_kl")), _num(st.get("training/rollout_probs_diff_max")),
                      f"{_num(lo)}-{_num(hi)}" if lo is not None else "", _num(st.get("timing_s/step"), 3)]  # fmt: skip
        rows.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _num(value, digits: int = 3) -> str:
    if value is None:
        return ""
    return "0" if value == 0 else f"{value:.{digits}g}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m roundalign.integrations.verl.loop", description=__doc__.split("\n\n")[0]
    )
    for f in dataclasses.fields(LoopConfig):
        name = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(name, action=argparse.BooleanOptionalAction, default=f.default,
                                help=field_help(LoopConfig, f.name))  # fmt: skip
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            parser.add_argument(name, type=kind, default=f.default, help=field_help(LoopConfig, f.name))
    parser.add_argument("--dry-run", action="store_true", help="write the inputs and command.sh, run nothing")
    parser.add_argument("--report", nargs="+", metavar="DIR", help="print the table of finished runs, run nothing")
    return parser


def main(argv=None) -> int:
    args = vars(_parser().parse_args(argv))
    dry_run, report = args.pop("dry_run"), args.pop("report")
    try:
        if report:
            summaries = {Path(d).name: _read_summary(Path(d)) for d in report}
            print(table(summaries))
            return 0
        summary = run(LoopConfig(**args), dry_run=dry_run)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if dry_run:
        print(f"inputs and the command written: {summary['command']}")
        return 0
    print(table({summary["trainer"]: summary}))
    audit_result = summary.get("audit")
    if audit_result is not None:
        problems = audit_result["problems"]
        verdict = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        verdict = verdict or "every weight served as exported"
        print(f"audit: {audit_result['syncs']} syncs x {audit_result['replicas']} replicas: {verdict}")
        engines = ", ".join(f"{e['threads']} threads, attention KV split {'on' if e['attn_split_kv'] else 'off'}"
                            for e in audit_result["engine"])  # fmt: skip
        print(f"engines: {engines}")
    print(f"summary: {Path(args['out']).resolve() / 'summary.json'}")
    return 1 if audit_result and audit_result["problems"] else 0


def _read_summary(directory: Path) -> dict:
    path = directory / "summary.json"
    if not path.is_file():
        raise UserError(f"{path} does not exist: --report takes directories of finished runs (--out)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not a run summary ({e}); rerun the loop into that directory") from None


if __name__ == "__main__":
    sys.exit(main())
