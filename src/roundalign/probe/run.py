"""``run_probe``: sample with the reference engine (or read a real engine's dump), recompute as a trainer, compare.

The steps, each one a progress tick:

1. Load the model once. The trainer side keeps the bf16 HF model; every engine backend copies it into its own
   served copy and runs its own code (``roundalign.engine``), so agreement between the two sides is evidence.
2. Rollouts: the first backend samples ``num_samples`` completions (``Engine.generate``), or they are read from
   ``engine_logprobs`` (a JSONL dump from vLLM/SGLang, ``roundalign.probe.jsonl``).
3. Engine references, per backend: ``decode`` (the log-probs the engine returns while sampling: batched KV-cache
   decode steps) and ``prefill`` (the engine's own one-sequence recompute, which takes decode's kernel and shape
   effects out and leaves rounding locations). An import has one reference, ``jsonl``.
4. Trainer log-probs per trainer profile, plus the fp32 reference forward (for rho and the entropy).
5. Metrics for every (trainer profile, backend, reference); per-region attribution; per-layer agreement; and the
   decode-shape experiment (which of attention or matmul shapes the aligned trainer's decode residual comes from).

Log-probs on both sides are ``raw``: full-vocabulary log-softmax of the temperature-1 logits, which is what a
trainer computes. Processed log-probs (after temperature, top-k, top-p) differ from them by sampling semantics,
not by rounding, and would bury the rounding signal (docs/engine.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from roundalign.probe import attribution as attr
from roundalign.probe.metrics import layer_agreement, log_ratios, mismatch_metrics
from roundalign.probe.report import build_report
from roundalign.probe.trainer import Rollout, TrainerSide, load_tokenizer, load_trainer_model
from roundalign.profiles import get_profile

BACKENDS = ("kernels", "inductor")
DECODE_SHAPE_VARIANTS = ((), ("attention",), ("matmul",), ("attention", "matmul"))


@dataclass
class ProbeConfig:
    """Everything ``roundalign probe`` takes; the CLI maps its options one to one onto these fields."""

    model: str | None = None  # None: the shipped tiny-qwen3
    engine_profile: str = "vllm"
    trainer_profiles: tuple[str, ...] | None = None  # None: ("hf", engine_profile)
    backends: tuple[str, ...] | None = None  # None: both for vllm (the inductor backend is vLLM's), else kernels
    prompts: list[str] | list[list[int]] | None = None  # None: arithmetic word problems
    num_samples: int = 16
    max_tokens: int = 48
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    engine_logprobs: str | None = None  # a JSONL dump from a real engine, instead of sampling
    layer_sequences: int = 4  # how many sequences the per-layer comparison runs over
    notes: list[str] = field(default_factory=list)

    def resolved(self) -> ProbeConfig:
        """Validate, and fill the defaults that depend on other fields."""
        engine = get_profile(self.engine_profile)  # unknown name: ValueError listing the profiles
        trainers = self.trainer_profiles or ("hf", engine.name)
        trainers = tuple(dict.fromkeys(get_profile(p).name for p in trainers))
        backends = self.backends
        if backends is None:
            backends = BACKENDS if engine.name == "vllm" else ("kernels",)
        unknown = [b for b in backends if b not in BACKENDS]
        if unknown:
            raise ValueError(f"unknown backend(s) {unknown}; choose from {', '.join(BACKENDS)}")
        if self.num_samples <= 0:
            raise ValueError(f"--num-samples must be positive, got {self.num_samples}")
        if self.layer_sequences < 0:
            raise ValueError(f"layer_sequences must be >= 0, got {self.layer_sequences}")
        return ProbeConfig(**{**self.__dict__, "trainer_profiles": trainers, "backends": tuple(backends)})


def default_prompts(n: int, seed: int) -> list[str]:
    """Arithmetic word problems, easy to hard, as the shipped model was trained on them."""
    from roundalign.tasks import arithmetic

    levels = sorted(arithmetic.LEVELS)
    per_level = [arithmetic.make_problems(n, level=lv, seed=seed + lv) for lv in levels]
    return [arithmetic.format_prompt(per_level[i % len(levels)][i // len(levels)]) for i in range(n)]


def _tokenize(prompts, tokenizer) -> list[list[int]]:
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError(
                    "the model directory has no tokenizer files, so text prompts cannot be encoded; add the "
                    "tokenizer files or pass --prompts FILE with one JSON token-id list per line"
                )
            ids = tokenizer(p, add_special_tokens=False)["input_ids"]
        else:
            ids = [int(t) for t in p]
        if not ids:
            raise ValueError(f"prompt {i + 1} is empty")
        out.append(ids)
    return out


def _shipped_model() -> Path:
    from roundalign import models

    return models.path("tiny-qwen3")


def _metrics(train, ref, fp32):
    return mismatch_metrics(train, ref, fp32)


def run_probe(cfg: ProbeConfig, step: Callable[[str], None] | None = None) -> tuple[dict, dict]:
    """Run the audit. Returns ``(report, arrays)``: the report dict (``roundalign.probe.report``) and the
    per-token log-ratios per comparison label, for the histogram plot. ``step(description)`` is called before
    each stage, for a progress bar (``plan(cfg)`` says how many stages there are)."""
    cfg = cfg.resolved()
    tick = step or (lambda _desc: None)
    notes = list(cfg.notes)

    tick("loading the model")
    model_path = Path(cfg.model) if cfg.model else _shipped_model()
    hf_model = load_trainer_model(model_path)
    config = hf_model.config
    trainer = TrainerSide(hf_model)
    engine_profile = get_profile(cfg.engine_profile)
    imported = cfg.engine_logprobs is not None

    # -- rollouts and engine references
    refs: dict[tuple[str, str], list[torch.Tensor]] = {}
    engines = {}
    if imported:
        from roundalign.probe.jsonl import read_engine_logprobs

        tick("reading the engine's log-probs")
        dump = read_engine_logprobs(
            cfg.engine_logprobs, vocab_size=config.vocab_size, max_model_len=config.max_position_embeddings
        )
        rollouts = [Rollout(list(r.prompt_token_ids), list(r.token_ids), list(r.logprobs)) for r in dump]
        refs[("jsonl", "jsonl")] = [torch.tensor(r.logprobs, dtype=torch.float32) for r in rollouts]
        backends: tuple[str, ...] = ()
        notes.append("per-layer agreement and the decode-shape experiment need the engine's internals; they are not "
                     "available for imported log-probs")
    else:
        from roundalign.engine import Engine, SamplingParams

        backends = cfg.backends
        tokenizer = load_tokenizer(model_path)
        for b in backends:
            tick(f"building the {b} engine")
            engines[b] = Engine(hf_model, profile=engine_profile, backend=b, tokenizer=tokenizer)
        prompts = cfg.prompts if cfg.prompts is not None else default_prompts(cfg.num_samples, cfg.seed)
        if not prompts:
            raise ValueError("no prompts: the prompt list is empty")
        if len(prompts) > cfg.num_samples:
            notes.append(f"{len(prompts)} prompts given, --num-samples {cfg.num_samples}: sampled the first "
                         f"{cfg.num_samples} prompts only")
        ids = _tokenize(prompts, tokenizer)
        batch = [ids[i % len(ids)] for i in range(cfg.num_samples)]
        params = SamplingParams(
            temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens, seed=cfg.seed,
            logprobs_mode="raw",
        )
        tick(f"sampling {cfg.num_samples} completions ({backends[0]} backend)")
        outs = engines[backends[0]].generate(batch, params)
        rollouts = [Rollout(list(o.prompt_token_ids), list(o.token_ids), list(o.logprobs)) for o in outs]
        prompts_ids = [r.prompt_token_ids for r in rollouts]
        completions = [r.token_ids for r in rollouts]
        for b in backends:
            tick(f"engine references ({b}: decode, prefill)")
            if b == backends[0]:
                refs[(b, "decode")] = [torch.tensor(r.logprobs, dtype=torch.float32) for r in rollouts]
            else:
                refs[(b, "decode")] = engines[b].score(prompts_ids, completions, mode="decode")
            refs[(b, "prefill")] = engines[b].score(prompts_ids, completions, mode="prefill")

    # -- trainer side
    tick("trainer log-probs (fp32 reference)")
    fp32, entropy = trainer.fp32_logprobs(rollouts)
    train: dict[str, list[torch.Tensor]] = {}
    for p in cfg.trainer_profiles:
        tick(f"trainer log-probs ({p})")
        train[p] = trainer.logprobs(p, rollouts)

    comparisons, arrays = [], {}
    for p in cfg.trainer_profiles:
        for (b, ref), ref_lp in refs.items():
            m = _metrics(train[p], ref_lp, fp32)
            comparisons.append({"trainer_profile": p, "backend": b, "reference": ref, "metrics": m})
            arrays[f"{p} vs {b}/{ref}"] = log_ratios(train[p], ref_lp)

    # -- per-region attribution
    attribution = []
    missing = attr.missing_regions(config)
    if missing:
        notes.append(f"regions this {config.model_type} model does not have, left out of the attribution: "
                     f"{', '.join(missing)}")
    for p in cfg.trainer_profiles:
        base = get_profile(p)
        if base == engine_profile:
            continue
        switches = attr.region_switches(base, engine_profile, config)
        tick(f"region attribution ({p} -> {engine_profile.name})")
        target_lp = train.get(engine_profile.name) or trainer.logprobs(engine_profile, rollouts)
        switch_lp = {s.region: trainer.logprobs(s.profile, rollouts) for s in switches if s.profile is not None}
        alone_lp = {s.region: trainer.logprobs(s.alone, rollouts) for s in switches if s.alone is not None}
        for (b, ref), ref_lp in refs.items():
            attribution.append(
                attr.attribution_entry(
                    base=base, engine=engine_profile, backend=b, reference=ref,
                    base_metrics=_metrics(train[p], ref_lp, fp32),
                    target_metrics=_metrics(target_lp, ref_lp, fp32),
                    switches=switches,
                    switch_metrics={r: _metrics(lp, ref_lp, fp32) for r, lp in switch_lp.items()},
                    alone_metrics={r: _metrics(lp, ref_lp, fp32) for r, lp in alone_lp.items()},
                )
            )

    # -- per-layer agreement and decode shapes (engine internals: not for imports)
    layers, decode_shapes = [], None
    if engines and cfg.layer_sequences:
        seqs = [r.prompt_token_ids + r.token_ids for r in rollouts[: cfg.layer_sequences]]
        for b, eng in engines.items():
            tick(f"per-layer hidden states ({b})")
            eng_h = [eng.hidden_states(s) for s in seqs]
            for p in cfg.trainer_profiles:
                tr_h = [trainer.hidden_states(p, s) for s in seqs]
                n_layers = len(tr_h[0])
                cat = [torch.cat([h[i] for h in tr_h]) for i in range(n_layers)]
                eng_cat = [torch.cat([h[i] for h in eng_h]) for i in range(n_layers)]
                layers.append({"trainer_profile": p, "backend": b, "layers": layer_agreement(cat, eng_cat)})
    if "kernels" in engines:
        tick("decode shapes (attention vs matmul)")
        aligned = train.get(engine_profile.name) or trainer.logprobs(engine_profile, rollouts)
        prompts_ids = [r.prompt_token_ids for r in rollouts]
        completions = [r.token_ids for r in rollouts]
        variants = []
        for shaped in DECODE_SHAPE_VARIANTS:
            lp = engines["kernels"].score(prompts_ids, completions, mode="decode", prefill_shaped=shaped)
            variants.append({"prefill_shaped": list(shaped), "metrics": _metrics(aligned, lp, fp32)})
        decode_shapes = {"backend": "kernels", "trainer_profile": engine_profile.name, "variants": variants}

    n_prompt = sum(len(r.prompt_token_ids) for r in rollouts)
    n_completion = sum(len(r.token_ids) for r in rollouts)
    all_entropy = torch.cat(entropy)
    report = build_report(
        model={
            "path": str(model_path),
            "model_type": config.model_type,
            "num_layers": config.num_hidden_layers,
            "vocab_size": config.vocab_size,
            "parameters": sum(p.numel() for p in hf_model.parameters()),
        },
        engine={
            "source": "jsonl" if imported else "roundalign.engine",
            "profile": engine_profile.to_dict(),
            "backends": list(backends),
            "sampling": None if imported else {
                "temperature": cfg.temperature, "top_p": cfg.top_p, "max_tokens": cfg.max_tokens, "seed": cfg.seed,
                "num_samples": cfg.num_samples, "sampled_by": backends[0], "logprobs_mode": "raw",
            },
            "jsonl": None if cfg.engine_logprobs is None else str(cfg.engine_logprobs),
        },
        tokens={
            "sequences": len(rollouts),
            "prompt_tokens": n_prompt,
            "completion_tokens": n_completion,
            "mean_entropy_nats": float(all_entropy.mean()) if all_entropy.numel() else None,
            "log_vocab": math.log(config.vocab_size),
        },
        comparisons=comparisons,
        attribution=attribution,
        layers=layers,
        decode_shapes=decode_shapes,
        notes=notes,
    )
    return report, {"log_ratios": arrays, "rollouts": rollouts}


def plan(cfg: ProbeConfig) -> int:
    """How many times ``run_probe`` calls ``step``: the length of the progress bar."""
    cfg = cfg.resolved()
    engine = get_profile(cfg.engine_profile)
    n_attr = sum(get_profile(p) != engine for p in cfg.trainer_profiles)
    if cfg.engine_logprobs is not None:
        return 1 + 1 + 1 + len(cfg.trainer_profiles) + n_attr
    b = len(cfg.backends)
    layers = b if cfg.layer_sequences else 0
    decode = 1 if "kernels" in cfg.backends else 0
    return 1 + b + 1 + b + 1 + len(cfg.trainer_profiles) + n_attr + layers + decode
