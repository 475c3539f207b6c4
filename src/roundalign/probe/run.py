"""``run_probe``: sample with the reference engine (or read a real engine's dump), recompute as a trainer, compare.

The stages, listed by ``stages(cfg)`` (which the run advances through, one progress step each):

1. Load the model once. The trainer side keeps the bf16 HF model; every engine backend copies it into its own
   served copy and runs its own code (``roundalign.engine``), so agreement between the two sides is evidence.
2. Rollouts: the first backend samples ``num_samples`` completions (``Engine.generate``), or they are read from
   ``engine_logprobs`` (a JSONL dump from vLLM/SGLang, ``roundalign.rollouts.jsonl``).
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

from roundalign.engines import ENGINES
from roundalign.errors import UserError, flag
from roundalign.numerics import attribution as attr
from roundalign.numerics.metrics import layer_agreement, log_ratios, mismatch_metrics
from roundalign.options import SAMPLING, check_sampling, option
from roundalign.probe.report import build_report
from roundalign.profiles import PROFILES, Profile, describe_engine, for_engine, get_profile
from roundalign.prompts import Prompts, default_prompts, round_robin, token_ids
from roundalign.rollouts import Rollout
from roundalign.rollouts.dumpdir import read_references
from roundalign.trainer import TrainerSide, check_device, load_trainer_model

DECODE_SHAPE_VARIANTS = ((), ("attention",), ("matmul",), ("attention", "matmul"))
# What sampling takes when the user does not say; an import (--engine-logprobs) takes none of it.
SAMPLING_DEFAULTS = {**{k: o.default for k, o in SAMPLING.items()}, "layer_sequences": 4}
_SAMPLING_ONLY = (*SAMPLING_DEFAULTS, "prompts", "backends")


@dataclass(frozen=True)
class ProbeConfig:
    """Everything ``roundalign probe`` takes; its options map one to one onto these fields (``--top-p`` is
    ``top_p``), and each field's help is the option's. ``validate()`` returns a checked copy with the defaults that
    depend on other fields filled in; ``run_probe`` validates a config that was not validated yet, once."""

    model: str | None = option(None, "HF model directory (default: the shipped tiny-qwen3)")
    engine_profile: str | None = option(
        None,
        "the engine's rounding profile: one of {profiles}, or a .json file (default: vllm-reference-kernels; for a "
        "real engine, the built-in profile of the build that ran, from its engine.json)",
    )
    trainer_profiles: tuple[str, ...] | None = option(
        None, "comma-separated trainer profiles (default: hf, the engine profile's rounding rules alone when it "
        "names kernels, and the engine profile)"
    )  # fmt: skip
    backends: tuple[str, ...] | None = option(
        None,
        "engine numerics backends: kernels, inductor (default: every backend that implements the engine profile; "
        "inductor implements vllm only)",
    )
    prompts: Prompts | None = option(
        None, "one prompt per line: text, or a JSON list of token ids (default: arithmetic word problems)"
    )
    num_samples: int | None = option(None, SAMPLING["num_samples"].help)  # None here and below: SAMPLING_DEFAULTS
    max_tokens: int | None = option(None, SAMPLING["max_tokens"].help)
    temperature: float | None = option(None, SAMPLING["temperature"].help)
    top_p: float | None = option(None, SAMPLING["top_p"].help)
    seed: int | None = option(None, SAMPLING["seed"].help)
    engine_logprobs: str | None = option(
        None,
        "a real engine's dump instead of sampling: a directory written by roundalign dump (decode and prefill "
        "references), or a JSONL file of {{prompt_token_ids, token_ids, logprobs}} lines (docs/real-engines.md); "
        "the sampling options do not apply",
    )
    engine: str | None = option(
        None,
        "sample with this real engine, in its own Python (--engine-python), and score the same sequences in its "
        "prefill: the trainer is compared with both (docs/real-engines.md)",
    )
    enforce_eager: bool = option(False, "with --engine vllm: its enforce_eager mode")
    engine_python: str | None = option(
        None,
        "the Python whose environment has the engine (default $ROUNDALIGN_ENGINE_PYTHON, else this one); "
        "`make vllm` builds .venv-vllm/bin/python",
    )
    quantization: str | None = option(
        None,
        "the engine serves a quantized copy in this scheme (w8a8-int8, w4a16, ...; docs/quantization.md): the "
        "reference engine computes it, or the real engine serves the checkpoint roundalign writes; the trainers "
        "compared are then stock bf16, rounding only, quantization-aligned and exact",
    )
    layer_sequences: int | None = option(
        None, "sequences the per-layer and decode-shape experiments run on (default {default}; 0 skips them)"
    )
    device: str = option(
        "cpu", "where the trainer's forwards run: cpu (default), cuda, cuda:1, ...; the reference engine samples on "
        "the CPU"
    )  # fmt: skip
    out: str = option("probe-out", "where report.json and the plots go (default {default})")  # run_probe writes nothing
    plots: bool = option(True, "skip the PNG plots")  # --no-plots
    notes: tuple[str, ...] = ()
    # name -> Profile of every trainer profile, filled by validate(): a profile given as a .json path is known by
    # its name in the report.
    profiles: dict[str, Profile] = field(default_factory=dict, repr=False, compare=False)
    validated: bool = field(default=False, repr=False, compare=False)  # set by validate(): validated once

    def validate(self) -> ProbeConfig:
        """Check every field, in the command line's terms; an option the chosen mode ignores is an error."""
        from roundalign.engine import BACKENDS, backends_for, check_backend

        if self.validated:
            return self
        if self.engine is not None:
            return self._validate_real_engine()
        if self.enforce_eager or self.engine_python is not None:
            given = "--enforce-eager" if self.enforce_eager else "--engine-python"
            raise UserError(f"{given} applies to a real engine's run; add --engine vllm")
        name = self.engine_profile or _default_engine_profile(self.engine_logprobs)
        base = get_profile(name)  # unknown name: UserError listing the profiles
        engine = _quantized(base, self.quantization, _dump_quantization(self.engine_logprobs))
        if engine is not base:  # the report and the stages name the engine profile by a name get_profile reads back
            if engine.name.partition("+")[0] not in PROFILES or get_profile(engine.name).rules() != engine.rules():
                raise UserError(
                    f"--quantization {engine.quantization} applies to a built-in engine profile; {name} is a profile "
                    "file: set its quantization (Profile.replace(quantization=...).save(path)) and give that file"
                )
            name = engine.name
        given = [self.profiles.get(p) or get_profile(p) for p in self.trainer_profiles or _default_trainers(engine)]
        profiles = {p.name: p for p in given}
        fields = dict(
            self.__dict__,
            validated=True,
            engine_profile=name,
            trainer_profiles=tuple(profiles),
            profiles=profiles,
            device=str(check_device(self.device)),
        )
        if self.engine_logprobs is not None:
            ignored = [flag(k) for k in _SAMPLING_ONLY if getattr(self, k) is not None]
            if ignored:
                raise UserError(
                    f"--engine-logprobs replaces sampling with the dump's tokens and log-probs, so "
                    f"{', '.join(ignored)} would be ignored; drop {'them' if len(ignored) > 1 else 'it'}"
                )
            return ProbeConfig(**fields)  # no engine internals: no per-layer or decode-shape experiment
        for key, default in SAMPLING_DEFAULTS.items():
            fields[key] = default if fields[key] is None else fields[key]
        backends = tuple(self.backends) if self.backends is not None else backends_for(engine)
        if not backends:
            raise UserError(f"--backends is empty; choose from {', '.join(BACKENDS)}")
        for b in backends:
            check_backend(b, engine)
        cfg = ProbeConfig(**{**fields, "backends": backends})
        check_sampling({k: getattr(cfg, k) for k in SAMPLING})
        if cfg.layer_sequences < 0:
            raise UserError(f"--layer-sequences must be >= 0, got {cfg.layer_sequences}")
        if cfg.prompts is not None and not cfg.prompts:
            raise UserError("no prompts: the prompt list is empty")
        return cfg

    def _validate_real_engine(self) -> ProbeConfig:
        """``--engine``: the real engine samples (in its own Python), then the run reads its dump directory."""
        from roundalign.engines.launch import engine_python

        if self.engine not in ENGINES:
            raise UserError(f"--engine {self.engine!r}: choose one of {', '.join(ENGINES)}")
        wrong = [flag(k) for k in ("engine_logprobs", "backends", "layer_sequences") if getattr(self, k) is not None]
        if wrong:
            raise UserError(
                f"--engine {self.engine} runs the real engine, so {', '.join(wrong)} would be ignored (--backends "
                "and --layer-sequences are the reference engine's; --engine-logprobs reads a dump instead); drop "
                f"{'them' if len(wrong) > 1 else 'it'}"
            )
        if self.enforce_eager and self.engine != "vllm":
            raise UserError("--enforce-eager is a vLLM option")
        if self.quantization is not None:
            from roundalign.quant import Scheme

            Scheme.parse(self.quantization)  # a wrong name fails now, not after the engine ran
            if self.engine != "vllm":
                raise UserError("--quantization with a real engine runs vLLM's quantized serving: use --engine vllm")
        for p in (self.engine_profile, *(self.trainer_profiles or ())):
            if p is not None:
                get_profile(self.profiles.get(p) or p)  # a wrong name fails now, not after the engine ran
        fields = dict(self.__dict__, device=str(check_device(self.device)), validated=True)
        for key, default in SAMPLING_DEFAULTS.items():
            if key != "layer_sequences":
                fields[key] = default if fields[key] is None else fields[key]
        fields["engine_python"] = engine_python(self.engine, self.engine_python)
        cfg = ProbeConfig(**fields)
        check_sampling({k: getattr(cfg, k) for k in SAMPLING})
        return cfg

    def after_dump(self, dump_dir: str | Path) -> ProbeConfig:
        """The same run, reading the dump the real engine wrote (its engine.json picks the default profile)."""
        sampling = {k: None for k in (*SAMPLING_DEFAULTS, "prompts")}
        fields = dict(
            self.__dict__, **sampling, engine=None, enforce_eager=False, engine_python=None, quantization=None
        )  # fmt: skip  (the dump's engine.json says what it served)
        return ProbeConfig(**{**fields, "engine_logprobs": str(dump_dir), "validated": False}).validate()


def _dump_quantization(engine_logprobs: str | None) -> str | None:
    """The scheme a dump directory's engine served (its engine.json), or None (bf16, or not a directory)."""
    if engine_logprobs is None or not Path(engine_logprobs).is_dir():
        return None
    from roundalign.rollouts.dumpdir import read_info

    served = read_info(engine_logprobs).get("quantization")
    return None if served in (None, "none") else str(served)


def _quantized(engine: Profile, given: str | None, served: str | None) -> Profile:
    """The engine profile with the scheme it serves: ``--quantization``, or what the dump says it served."""
    if given is not None and served is not None and given != served:
        raise UserError(f"--quantization {given}: the dump's engine served {served}; drop --quantization")
    scheme = given or served
    if scheme is None:
        return engine
    if engine.quantization.quantized and str(engine.quantization) != scheme:
        raise UserError(f"the engine profile {engine.name} serves {engine.quantization}, not {scheme}")
    return engine.replace(quantization=scheme)


def _default_trainers(engine: Profile) -> tuple:
    """The trainers a probe compares by default: stock HF, the engine's rounding rules and the engine profile itself;
    for a quantized engine stock HF (bf16, what users run today), the rounding rules in bf16, the rounding rules
    with the engine's quantization (quantization-aligned) and, where the engine profile or this Python has them,
    the engine's kernels too (exact)."""
    if not engine.quantization.quantized:
        return ("hf", engine.rounding_only(), engine) if engine.uses_engine_kernels else ("hf", engine)
    aligned = engine.rounding_only()
    exact = engine if engine.uses_engine_kernels else _exact_for(engine)
    return ("hf", aligned.replace(quantization="none"), aligned, *((exact,) if exact is not None else ()))


def _exact_for(engine: Profile) -> Profile | None:
    """The ``-kernels`` variant of a real engine's quantized profile, where the built-in exists and vLLM's kernels
    can run in this Python (the exact quantized trainer calls vLLM's own layers)."""
    from roundalign.extras import available

    base = engine.name.partition("+")[0]
    if f"{base}-kernels" not in PROFILES or not available("vllm"):
        return None
    return PROFILES[f"{base}-kernels"].replace(quantization=engine.quantization)


def _default_engine_profile(engine_logprobs: str | None) -> str:
    """For a dump directory the built-in profile of the engine build that wrote it; ``vllm`` for a jsonl file; else
    ``vllm-reference-kernels``: the reference engine with its decode-consistent kernels, so that the default run
    shows a trainer that is exactly on-policy beside stock HF and rounding alignment alone."""
    if engine_logprobs is not None and Path(engine_logprobs).is_dir():
        from roundalign.profiles import for_engine
        from roundalign.rollouts.dumpdir import read_info

        return for_engine(read_info(engine_logprobs))
    return "vllm" if engine_logprobs is not None else "vllm-reference-kernels"


def _shipped_model() -> Path:
    from roundalign import models

    return models.path("tiny-qwen3")


def _import(cfg: ProbeConfig, config, tick, notes):
    """Rollouts and references from a real engine's dump: ``jsonl`` from a file; ``decode`` and ``prefill`` (under
    the engine's name) from a dump directory. Returns (rollouts, refs, the dump's engine.json or None)."""
    tick("reading the engine's log-probs")
    rollouts, refs, info = read_references(cfg.engine_logprobs, config)
    notes.append(
        "per-layer agreement and the decode-shape experiment need the engine's internals; they are not "
        "available for imported log-probs (a real engine's dump)"
    )
    backend = info["engine"] if info else "jsonl"
    tensors = {(backend, ref): [torch.tensor(lp, dtype=torch.float32) for lp in lps] for ref, lps in refs.items()}
    return rollouts, tensors, info


def _run_engine(cfg: ProbeConfig, model_path: Path, tick) -> Path:
    """Sample with the real engine in its own Python; returns the dump directory (inside ``cfg.out``)."""
    from roundalign.engine.loader import read_tokenizer
    from roundalign.engines.dump import DumpConfig
    from roundalign.engines.launch import run_dump

    prompts = cfg.prompts if cfg.prompts is not None else default_prompts(cfg.num_samples, cfg.seed)
    ids = token_ids(prompts, read_tokenizer(model_path))  # the trainer's tokenizer: both sides see the same ids
    dump_dir = Path(cfg.out) / "engine-dump"
    dump = DumpConfig(
        engine=cfg.engine, model=str(model_path), out=str(dump_dir), enforce_eager=cfg.enforce_eager,
        num_samples=cfg.num_samples, max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
        seed=cfg.seed, quantization=cfg.quantization,
    )  # fmt: skip
    mode = " --enforce-eager" if cfg.enforce_eager else ""
    tick(f"running {cfg.engine}{mode}: {cfg.num_samples} completions, then prefill (its own Python)")
    run_dump(dump, cfg.engine_python, ids)
    return dump_dir


def _sample(cfg: ProbeConfig, hf_model, model_path: Path, engine_profile, tick, notes):
    """Engines per backend; the first samples the rollouts; every backend gives a decode and a prefill reference."""
    from roundalign.engine import Engine, SamplingParams
    from roundalign.engine.loader import read_tokenizer

    tokenizer = read_tokenizer(model_path)
    engines = {}
    for b in cfg.backends:
        tick(f"building the {b} engine")
        engines[b] = Engine(hf_model, profile=engine_profile, backend=b, tokenizer=tokenizer)
    prompts = cfg.prompts if cfg.prompts is not None else default_prompts(cfg.num_samples, cfg.seed)
    if len(prompts) > cfg.num_samples:
        notes.append(
            f"{len(prompts)} prompts given, --num-samples {cfg.num_samples}: sampled the first "
            f"{cfg.num_samples} prompts only"
        )
    batch = round_robin(token_ids(prompts, tokenizer), cfg.num_samples)
    params = SamplingParams(
        temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens, seed=cfg.seed, logprobs_mode="raw"
    )
    first = cfg.backends[0]
    tick(f"sampling {cfg.num_samples} completions ({first} backend)")
    outs = engines[first].generate(batch, params)
    rollouts = [Rollout(list(o.prompt_token_ids), list(o.token_ids), list(o.logprobs)) for o in outs]
    prompt_ids, completions = [r.prompt_token_ids for r in rollouts], [r.token_ids for r in rollouts]
    refs = {}
    for b, eng in engines.items():
        tick(f"engine references ({b}: decode, prefill)")
        if b == first:  # generate's own log-probs (raw mode) are the decode reference
            refs[(b, "decode")] = [torch.tensor(r.logprobs, dtype=torch.float32) for r in rollouts]
        else:  # the same tokens replayed through this backend's decode steps
            refs[(b, "decode")] = eng.score(prompt_ids, completions, mode="decode")
        refs[(b, "prefill")] = eng.score(prompt_ids, completions, mode="prefill")
    return rollouts, refs, engines


def _attribution(cfg, config, trainer, rollouts, refs, train, fp32, engine_profile, tick, notes) -> list[dict]:
    missing = attr.missing_regions(config)
    if missing:
        notes.append(
            f"regions this {config.model_type} model does not have, left out of the attribution: {', '.join(missing)}"
        )
    out = []
    for p in cfg.trainer_profiles:
        base = cfg.profiles[p]
        if base == engine_profile:
            continue
        switches = attr.region_switches(base, engine_profile, config)
        tick(f"region attribution ({p} -> {engine_profile.name})")
        target_lp = train.get(engine_profile.name) or trainer.logprobs(engine_profile, rollouts)
        switch_lp = {s.region: trainer.logprobs(s.profile, rollouts) for s in switches if s.profile is not None}
        alone_lp = {s.region: trainer.logprobs(s.alone, rollouts) for s in switches if s.alone is not None}
        for (b, ref), ref_lp in refs.items():
            out.append(
                attr.attribution_entry(
                    base=base, engine=engine_profile, backend=b, reference=ref,
                    base_metrics=mismatch_metrics(train[p], ref_lp, fp32),
                    target_metrics=mismatch_metrics(target_lp, ref_lp, fp32),
                    switches=switches,
                    switch_metrics={r: mismatch_metrics(lp, ref_lp, fp32) for r, lp in switch_lp.items()},
                    alone_metrics={r: mismatch_metrics(lp, ref_lp, fp32) for r, lp in alone_lp.items()},
                )
            )  # fmt: skip
    return out


def _layers(cfg, trainer, engines, rollouts, tick) -> list[dict]:
    """Residual stream after every layer, trainer vs engine, in prefill, pooled over the first sequences."""
    seqs = [r.prompt_token_ids + r.token_ids for r in rollouts[: cfg.layer_sequences]]

    def pooled(per_sequence):  # [sequence][layer] (tokens, hidden) -> [layer] (all tokens, hidden)
        return [torch.cat(layer) for layer in zip(*per_sequence, strict=True)]

    trainer_h = {p: pooled([trainer.hidden_states(cfg.profiles[p], s) for s in seqs]) for p in cfg.trainer_profiles}
    out = []
    for b, eng in engines.items():
        tick(f"per-layer hidden states ({b})")
        engine_h = pooled([eng.hidden_states(s) for s in seqs])
        for p in cfg.trainer_profiles:
            out.append({"trainer_profile": p, "backend": b, "layers": layer_agreement(trainer_h[p], engine_h)})
    return out


def _decode_shapes(cfg, trainer, engine, rollouts, train, fp32, engine_profile, tick) -> dict:
    """The aligned trainer against decode log-probs whose attention and/or matmuls are computed prefill-shaped.

    The matmul variant recomputes every linear over the whole sequence at each step (a prefill per token), so this
    runs on the per-layer subset. A sequence's decode log-probs do not depend on the rest of its batch (the
    engine's decode is batch-invariant), so the subset's plain-decode row is the decode reference's own.
    """
    tick("decode shapes (attention vs matmul)")
    subset = rollouts[: cfg.layer_sequences]
    aligned = (train.get(engine_profile.name) or trainer.logprobs(engine_profile, rollouts))[: len(subset)]
    prompt_ids, completions = [r.prompt_token_ids for r in subset], [r.token_ids for r in subset]
    variants = []
    for shaped in DECODE_SHAPE_VARIANTS:
        lp = engine.score(prompt_ids, completions, mode="decode", prefill_shaped=shaped)
        metrics = mismatch_metrics(aligned, lp, fp32[: len(subset)])
        variants.append({"prefill_shaped": list(shaped), "metrics": metrics})
    return {"backend": "kernels", "trainer_profile": engine_profile.name, "sequences": len(subset),
            "variants": variants}  # fmt: skip


def run_probe(cfg: ProbeConfig, step: Callable[[str, int], None] | None = None) -> tuple[dict, dict]:
    """Run the audit. Returns ``(report, arrays)``: the report dict (``roundalign.probe.report``), and the
    per-token log-ratios per comparison label (for the histogram) and the rollouts. ``step(description, total)`` is
    called as each stage of ``stages(cfg)`` starts, for a progress bar (``total`` grows once a real engine's dump
    says which profiles the run compares)."""
    cfg = cfg.validate()
    tick = _Stages(stages(cfg), step)
    if cfg.engine is not None:
        model_path = Path(cfg.model) if cfg.model else _shipped_model()
        cfg = cfg.after_dump(_run_engine(cfg, model_path, tick))
        tick.replan(stages(cfg))  # the dump's engine.json named the engine profile: the exact stages from here
    notes = list(cfg.notes)

    tick("loading the model")
    model_path = Path(cfg.model) if cfg.model else _shipped_model()
    hf_model = load_trainer_model(model_path)
    config = hf_model.config
    trainer = TrainerSide(hf_model)
    engine_profile = get_profile(cfg.engine_profile)
    imported = cfg.engine_logprobs is not None
    real = None  # a dump directory's engine.json
    if imported:
        (rollouts, refs, real), engines = _import(cfg, config, tick, notes), {}
        if real is not None:
            built_in = for_engine(real)
            notes.append(
                f"the dump's engine: {describe_engine(real)}, whose built-in profile is {built_in}"
                + ("" if cfg.engine_profile == built_in else f"; this run's engine profile is {cfg.engine_profile}")
            )
    else:
        rollouts, refs, engines = _sample(cfg, hf_model, model_path, engine_profile, tick, notes)
    hf_model.to(cfg.device)  # after the engines copied their weights from it: they serve from the CPU

    tick("trainer log-probs (fp32 reference)")
    fp32, entropy = trainer.fp32_logprobs(rollouts)
    train: dict[str, list[torch.Tensor]] = {}
    for p in cfg.trainer_profiles:
        tick(f"trainer log-probs ({p})")
        train[p] = trainer.logprobs(cfg.profiles[p], rollouts)
    comparisons, arrays = [], {}
    for p in cfg.trainer_profiles:
        for (b, ref), ref_lp in refs.items():
            metrics = mismatch_metrics(train[p], ref_lp, fp32)
            comparisons.append({"trainer_profile": p, "backend": b, "reference": ref, "metrics": metrics})
            arrays[f"{p} vs {b}/{ref}"] = log_ratios(train[p], ref_lp)

    attribution = _attribution(cfg, config, trainer, rollouts, refs, train, fp32, engine_profile, tick, notes)
    layers, decode_shapes = [], None
    if engines and cfg.layer_sequences:
        layers = _layers(cfg, trainer, engines, rollouts, tick)
        if "kernels" in engines:
            decode_shapes = _decode_shapes(cfg, trainer, engines["kernels"], rollouts, train, fp32, engine_profile,
                                           tick)  # fmt: skip

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
            "source": ("dump" if real else "jsonl") if imported else "roundalign.engine",
            "profile": engine_profile.to_dict(),
            "backends": [real["engine"]] if real else list(engines),
            "sampling": (real.get("sampling") if real else None) if imported else {
                "temperature": cfg.temperature, "top_p": cfg.top_p, "max_tokens": cfg.max_tokens, "seed": cfg.seed,
                "num_samples": cfg.num_samples, "sampled_by": cfg.backends[0], "logprobs_mode": "raw",
            },
            "jsonl": str(cfg.engine_logprobs) if imported else None,
            **({"real": {k: v for k, v in real.items() if k not in ("format", "version", "sampling")}} if real else {}),
        },
        tokens={
            "sequences": len(rollouts),
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in rollouts),
            "completion_tokens": sum(len(r.token_ids) for r in rollouts),
            "mean_entropy_nats": float(all_entropy.mean()) if all_entropy.numel() else None,
            "log_vocab": math.log(config.vocab_size),
        },
        comparisons=comparisons,
        attribution=attribution,
        layers=layers,
        decode_shapes=decode_shapes,
        notes=notes,
    )  # fmt: skip
    tick.finish()
    return report, {"log_ratios": arrays, "rollouts": rollouts}


def stages(cfg: ProbeConfig) -> list[str]:
    """Every stage ``run_probe`` runs, in order, as its progress bar names them. The run advances through this
    list and fails if it runs a stage the list does not have, so the two cannot drift apart. For a real engine the
    stages after its dump are an estimate until its engine.json names the engine profile (``run_probe`` replans)."""
    cfg = cfg.validate()
    if cfg.engine is not None:
        mode = " --enforce-eager" if cfg.enforce_eager else ""
        engine = cfg.engine_profile or "the engine's profile"
        given = cfg.trainer_profiles or ("hf", engine)
        return [
            f"running {cfg.engine}{mode}: {cfg.num_samples} completions, then prefill (its own Python)",
            "loading the model",
            "reading the engine's log-probs",
            "trainer log-probs (fp32 reference)",
            *(f"trainer log-probs ({p})" for p in given),
            *(f"region attribution ({p} -> {engine})" for p in given if p != engine),
        ]
    engine = get_profile(cfg.engine_profile)
    trainers = [
        *(f"trainer log-probs ({p})" for p in cfg.trainer_profiles),
        *(f"region attribution ({p} -> {engine.name})" for p in cfg.trainer_profiles if cfg.profiles[p] != engine),
    ]
    fp32 = "trainer log-probs (fp32 reference)"
    if cfg.engine_logprobs is not None:
        return ["loading the model", "reading the engine's log-probs", fp32, *trainers]
    first, layers = cfg.backends[0], cfg.layer_sequences
    return [
        "loading the model",
        *(f"building the {b} engine" for b in cfg.backends),
        f"sampling {cfg.num_samples} completions ({first} backend)",
        *(f"engine references ({b}: decode, prefill)" for b in cfg.backends),
        fp32,
        *trainers,
        *(f"per-layer hidden states ({b})" for b in cfg.backends if layers),
        *(["decode shapes (attention vs matmul)"] if layers and "kernels" in cfg.backends else []),
    ]


class _Stages:
    """The run's cursor in ``stages(cfg)``: each ``tick(description)`` must be the next planned stage."""

    def __init__(self, planned: list[str], step: Callable[[str, int], None] | None):
        self.planned, self.done, self.step = list(planned), 0, step

    def __call__(self, description: str) -> None:
        planned = self.planned[self.done] if self.done < len(self.planned) else None
        if description != planned:
            raise RuntimeError(f"probe stage {self.done + 1}: ran {description!r}, but stages() planned {planned!r}")
        self.done += 1
        if self.step is not None:
            self.step(description, len(self.planned))

    def replan(self, remaining: list[str]) -> None:
        """The stages from here on, replacing the estimate (``remaining`` starts where the run now is)."""
        self.planned = self.planned[: self.done] + remaining

    def finish(self) -> None:
        if self.done != len(self.planned):
            raise RuntimeError(f"probe ran {self.done} of the {len(self.planned)} stages stages() planned")
