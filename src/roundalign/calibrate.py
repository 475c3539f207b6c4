"""``roundalign calibrate``: measure the installed engine build and write its rounding profile, with the evidence.

    roundalign calibrate --engine vllm --model PATH                      # vLLM's default (compiled) mode
    roundalign calibrate --engine vllm --enforce-eager --model PATH --out calibrate-eager

Three measurements of the same engine, in its own Python (``roundalign.engines.launch``):

1. **dump**: the engine samples ``--num-samples`` completions of ``--max-tokens`` tokens and scores them again in
   prefill (``roundalign dump``; about 2,000 tokens by default).
2. **fingerprint**: the op-level battery, shaped like the model, through the engine's own layers in the same mode
   (``roundalign.fingerprint``): exact per-op answers, blind to what a whole-model graph fuses across ops.
3. **fit**: every rule combination on the trainer side against the prefill dump (``roundalign.fit``): the whole
   engine, kernels included, so a region can stay unclear where kernel differences drown it.

A region is settled by the fit where the dump decides it, else by the fingerprint where the battery determines it;
``calibration.json`` records each source and every disagreement. The contenders are the rules that agree with
every settled region: the combination (the fit's best guess in the open regions), the fit's best and its best by
RMS log-ratio among the agreeing candidates, and the engine build's built-in profile. Each, and stock ``hf``, is
scored against both the sampler's (decode) and the prefill log-probs, and the closest (lowest RMS log-ratio) is
saved, so the file says how good the result is, not only what it is. A candidate that contradicts a settled region
is never chosen, however its RMS looks: where kernels drown the rounding (vLLM's eager CPU kernels truncate on CPUs
without AVX512-BF16), a dump can prefer a wrong rule.
Writes ``profile.json``, ``calibration.json``, ``dump/`` and ``fingerprint.pt`` into ``--out``. ``--dump DIR`` reuses
a dump directory of the same engine and mode (from ``roundalign dump`` or ``probe --engine``) instead of step 1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from roundalign import durable
from roundalign.errors import ExitStatus, Failure, UserError
from roundalign.options import SAMPLING, add_sampling_arguments, check_sampling, field_help, option

RMS = "mismatch/log_ratio_rms"
# 16 completions run to 125 tokens each (ignore_eos): 2,000 tokens, enough for the fit to decide what rounding does
DUMP_DEFAULTS = {"num_samples": 16, "max_tokens": 125, "seed": 0}


class NotExplained(Failure):
    """No rounding profile explains the engine's dump (fit's model check): the engine served other weights."""

    status = ExitStatus.NOT_FITTED


@dataclass(frozen=True)
class CalibrateConfig:
    """``roundalign calibrate``'s options (``--max-tokens`` is ``max_tokens``); each field's ``metadata["help"]`` is
    its option's help (``{default}``: the default shown)."""

    engine: str = option("vllm", "the engine to measure (its Python: --engine-python)")
    enforce_eager: bool = option(False, "measure vLLM's enforce_eager mode (default: its compiled mode)")
    model: str | None = option(None, "HF model directory the engine serves (default: the shipped tiny-qwen3)")
    out: str = option("calibrate-out", "where the profile and the evidence go (default {default})")
    engine_python: str | None = option(
        None, "the Python whose environment has the engine (default $ROUNDALIGN_ENGINE_PYTHON, else this one)"
    )
    # num_samples, max_tokens, seed: None is DUMP_DEFAULTS, when calibrate runs the dump
    num_samples: int | None = option(None, "completions in the dump (default {default})")
    max_tokens: int | None = option(None, "tokens per completion, each run to the end (default {default})")
    seed: int | None = option(None, SAMPLING["seed"].help)
    device: str = option("cpu", "where the trainer side's forwards run (default {default})")
    name: str | None = option(None, "the profile's name (default calibrated-ENGINE-VERSION-DEVICE[-eager])")
    quantization: str | None = option(
        None,
        "the engine serves a quantized copy in this scheme (w8a8-int8, fp8, w4a16, ...; docs/quantization.md): the "
        "dump serves the checkpoint roundalign writes, and every fitted and scored profile computes the scheme",
    )
    dump: str | None = option(
        None,
        "use this roundalign dump directory (same engine and mode) instead of running a new dump; "
        "--num-samples, --max-tokens and --seed then do not apply",
    )

    def validate(self) -> CalibrateConfig:
        from dataclasses import replace

        from roundalign.engines.launch import engine_python
        from roundalign.trainer import check_device

        if self.engine != "vllm":
            raise UserError(
                f"--engine {self.engine}: calibrate runs vLLM (its fingerprint runner and dump); for SGLang, "
                "run roundalign dump and roundalign fingerprint on its machine and roundalign fit on the dump"
            )
        given = [f"--{k.replace('_', '-')}" for k in DUMP_DEFAULTS if getattr(self, k) is not None]
        if self.dump is not None and given:
            raise UserError(f"--dump reuses a dump, so {', '.join(given)} would be ignored; drop them")
        sizes = {k: DUMP_DEFAULTS[k] if getattr(self, k) is None else getattr(self, k) for k in DUMP_DEFAULTS}
        check_sampling(sizes)
        from roundalign import models

        model = self.model or str(models.path())  # the shipped tiny-qwen3
        if not (Path(model) / "config.json").is_file():
            raise UserError(f"--model {model}: no config.json there; give the HF model directory the engine serves")
        if self.quantization is not None:
            from roundalign.quant import Scheme

            Scheme.parse(self.quantization)
        if self.dump is not None:
            from roundalign.rollouts.dumpdir import read_info

            info = read_info(self.dump)  # not a dump directory: UserError naming it
            served = info.get("quantization") or "none"
            if self.quantization is not None and served != self.quantization:
                raise UserError(f"--dump {self.dump} served {served}, not --quantization {self.quantization}")
            if info["engine"] != self.engine or bool(info.get("enforce_eager")) != self.enforce_eager:
                mode = "--enforce-eager" if info.get("enforce_eager") else "its default mode"
                raise UserError(
                    f"--dump {self.dump} was written by {info['engine']} in {mode}; calibrate the same engine and "
                    "mode (the fingerprint runs in the mode given here), or drop --dump"
                )
        python = engine_python(self.engine, self.engine_python)
        return replace(self, **sizes, model=model, engine_python=python, device=str(check_device(self.device)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = CalibrateConfig()

    def a(name: str, **kw) -> None:
        parser.add_argument(f"--{name.replace('_', '-')}", help=field_help(CalibrateConfig, name), **kw)

    a("engine", required=True, choices=("vllm",))
    a("enforce_eager", action="store_true")
    a("model", metavar="PATH")
    a("out", metavar="DIR", default=d.out)
    a("engine_python", metavar="PATH")
    # No argparse defaults: a dump size given with --dump is an error, so "not given" must show.
    add_sampling_arguments(parser.add_argument, CalibrateConfig, DUMP_DEFAULTS, unset=True)
    a("device", default=d.device, metavar="DEV")
    a("name")
    a("quantization", metavar="SCHEME")
    a("dump", metavar="DIR")


def config_from_args(args: argparse.Namespace) -> CalibrateConfig:
    from dataclasses import fields

    return CalibrateConfig(**{f.name: getattr(args, f.name) for f in fields(CalibrateConfig)})


def _fingerprint(cfg: CalibrateConfig, out: Path, device: str, log) -> dict:
    """The battery shaped like the model, through the engine's layers in this mode; the reader's entry."""
    from roundalign.engines.launch import EngineFailed
    from roundalign.fingerprint.battery import model_constants, save_battery
    from roundalign.fingerprint.reader import load_results, read_results

    battery, results, logfile = out / "battery.pt", out / "fingerprint.pt", out / "fingerprint.log"
    save_battery(battery, model=model_constants(cfg.model))
    mode = "eager" if cfg.enforce_eager else "compiled"
    args = [cfg.engine_python, "-m", "roundalign.fingerprint.runner", str(battery), "--engine", cfg.engine]
    args += ["--modes", mode, "--device", device, "--out", str(results)]
    results.unlink(missing_ok=True)
    log(f"fingerprint battery ({mode}) through the engine's layers")
    with logfile.open("w") as f:
        proc = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT, check=False)
    if not results.is_file():
        tail = "\n".join(logfile.read_text(errors="replace").splitlines()[-25:])
        raise EngineFailed(f"the fingerprint runner exited with status {proc.returncode}; its log ({logfile}):\n{tail}")
    return read_results(load_results(results))[0]


def _combine(fit_regions: dict, fp_entry: dict, space) -> tuple[dict[str, str], dict]:
    """Per searched region: the rule and where it came from (module docstring), and the evidence of both."""
    fp_regions = {**fp_entry["regions"], **((fp_entry.get("model") or {}).get("regions") or {})}
    rules, evidence = {}, {}
    for region in space.regions:
        f = fit_regions[region]
        fp = fp_regions.get(region)
        fp_rules = [str(r) for r in fp.rules] if fp is not None else []
        fp_determined = fp is not None and fp.status == "determined"
        if f["status"] == "determined":
            rule, source = f["rule"], "fit (the dump decides it)"
        elif fp_determined and (region != "rope" or fp_entry.get("model")):
            rule, source = fp_rules[0], f"fingerprint (the fit left it {f['status']})"
        else:
            rule, source = f["rule"], f"fit's best ({f['status']}; the fingerprint: {fp.status if fp else 'absent'})"
        agree = None if not fp_determined else f["rule"] in fp_rules
        rules[region] = rule
        evidence[region] = {
            "rule": rule,
            "source": source,
            "fit": {k: v for k, v in f.items() if k in ("rule", "status", "z", "vs", "why")},
            "fingerprint": None if fp is None else {"status": fp.status, "rules": fp_rules, "note": fp.note},
            "fit_agrees_with_fingerprint": agree,
        }
    return rules, evidence


def _score(model, rollouts, refs: dict, profiles: dict) -> dict:
    """mismatch metrics of each profile against each reference (decode, prefill)."""
    import torch

    from roundalign.numerics.metrics import mismatch_metrics
    from roundalign.trainer import TrainerSide

    trainer = TrainerSide(model)
    fp32, _ = trainer.fp32_logprobs(rollouts)
    out = {}
    for label, profile in profiles.items():
        lp = trainer.logprobs(profile, rollouts)
        out[label] = {
            ref: mismatch_metrics(lp, [torch.tensor(x, dtype=torch.float32) for x in lps], fp32)
            for ref, lps in refs.items()
        }
    return out


def calibrate(cfg: CalibrateConfig, log=print) -> dict:
    """Run the three measurements, write the profile and the evidence; returns calibration.json's content."""
    from roundalign.engine.loader import read_tokenizer
    from roundalign.engines.dump import DumpConfig
    from roundalign.engines.launch import run_dump
    from roundalign.fit.search import DumpNotExplained, fit
    from roundalign.fit.space import Candidate, Space
    from roundalign.profiles import describe_engine, for_engine, get_profile
    from roundalign.prompts import default_prompts, token_ids
    from roundalign.rollouts import Rollout
    from roundalign.rollouts.dumpdir import read_dump
    from roundalign.trainer import load_trainer_model

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = load_trainer_model(Path(cfg.model))
    dump_dir = Path(cfg.dump) if cfg.dump else out / "dump"
    seconds = {"dump": 0.0}
    if cfg.dump is None:
        ids = token_ids(default_prompts(cfg.num_samples, cfg.seed), read_tokenizer(Path(cfg.model)))
        dump_cfg = DumpConfig(
            engine=cfg.engine, model=cfg.model, out=str(dump_dir), enforce_eager=cfg.enforce_eager,
            num_samples=cfg.num_samples, max_tokens=cfg.max_tokens, seed=cfg.seed, ignore_eos=True,
            quantization=cfg.quantization,
        )  # fmt: skip
        log(f"dump: {cfg.engine} samples {cfg.num_samples} x {cfg.max_tokens} tokens, then scores them in prefill")
        seconds["dump"] = run_dump(dump_cfg, cfg.engine_python, ids)
    dump = read_dump(dump_dir, vocab_size=model.config.vocab_size,
                     max_model_len=model.config.max_position_embeddings)  # fmt: skip
    info = dump.info
    served = info.get("quantization")
    quantization = None if served in (None, "none") else str(served)  # what every fitted profile computes
    t = time.perf_counter()
    entry = _fingerprint(cfg, out, info.get("device", "cpu"), log)
    seconds["fingerprint"] = time.perf_counter() - t

    t = time.perf_counter()
    log(f"fit: every rule combination against the prefill dump ({sum(len(r.token_ids) for r in dump.rollouts)} tokens)")
    scored = [Rollout(r.prompt_token_ids, r.token_ids, lp) for r, lp in zip(dump.rollouts, dump.prefill, strict=True)]
    model.to(cfg.device)
    try:
        result = fit(model, scored, quantization=quantization)
    except DumpNotExplained as exc:  # the engine did not serve these weights, or returned processed log-probs
        raise NotExplained(f"{exc} (calibrate's dump: {dump_dir})") from None
    seconds["fit"] = time.perf_counter() - t
    space = Space.of(model, quantization)
    rules, evidence = _combine(result.regions, entry, space)

    mode = "eager" if cfg.enforce_eager else "compiled"
    version = info.get("engine_version", "?")
    name = cfg.name or f"calibrated-{cfg.engine}-{version}-{info.get('device', 'cpu')}" + (
        "-eager" if cfg.enforce_eager else ""
    )
    built_in = for_engine(info)
    # A region decided by either measurement is settled: a contender must agree with it (the fit's dump can prefer
    # a wrong rule by RMS where kernels drown the rounding, as truncating CPU kernels do in vLLM's eager mode).
    settled = {r: e["rule"] for r, e in evidence.items() if not e["source"].startswith("fit's best")}

    def consistent(c: Candidate) -> bool:
        return all(c.rule(r) == rule for r, rule in settled.items())

    agreeing = [e for e in result.ranking if consistent(e.candidate)]
    contenders = {"fit + fingerprint": Candidate(space.regions, tuple(rules[r] for r in space.regions))}
    if agreeing:
        contenders[f"fit's best by {result.rank_by}, agreeing with the settled regions"] = agreeing[0].candidate
        by_rms = min(agreeing, key=lambda e: e.metrics[RMS])
        contenders["fit's best by RMS log-ratio, agreeing with the settled regions"] = by_rms.candidate
    if consistent(space.key_of(built_in)):
        contenders[f"built-in {built_in}"] = space.key_of(built_in)
    t = time.perf_counter()
    log("scoring each contender, and hf, against decode and prefill")
    profiles = {label: space.profile(c, name=label, fill=built_in) for label, c in contenders.items()}
    metrics = _score(model, dump.rollouts, dump.references(), {**profiles, "hf": get_profile("hf")})
    seconds["score"] = time.perf_counter() - t

    def mean_rms(label: str) -> float:
        return sum(m[RMS] for m in metrics[label].values()) / len(metrics[label])

    chosen = min(contenders, key=mean_rms)  # ties: the first listed (the measured combination)
    profile = space.profile(
        contenders[chosen],
        name=name,
        fill=built_in,
        engines=f"{describe_engine(info)}; calibrated on {Path(cfg.model).name}",
        source=f"roundalign calibrate: the {chosen} (lowest RMS log-ratio against the engine's decode and prefill "
        "log-probs among the measured contenders); per region, fit and fingerprint: "
        + "; ".join(f"{r}: {e['source']}" for r, e in evidence.items())
        + f"; regions the model does not exercise from {built_in}. Evidence: calibration.json",
    )
    seconds["total"] = time.perf_counter() - t0
    profile.save(out / "profile.json")
    report = {
        "profile": profile.to_dict(),
        "chosen": chosen,
        "settled": settled,
        "contenders": {label: c.as_dict() for label, c in contenders.items()},
        "engine": {k: v for k, v in info.items() if k not in ("format", "version")},
        "mode": mode,
        "built_in": built_in,
        "regions": evidence,
        "not_exercised": space.idle,
        "fit": {"best": result.best.candidate.as_dict(), "margin": result.margin, "stats": result.stats},
        "metrics": metrics,
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
    }
    durable.write_text(out / "calibration.json", json.dumps(report, indent=2, allow_nan=False, default=str) + "\n")
    return report


def run(cfg: CalibrateConfig) -> int:
    from roundalign.console import key_value_table, make_console

    console = make_console()
    report = calibrate(cfg, log=lambda m: console.print(f"calibrate: {m}", highlight=False))
    rows = [(r, f"{e['rule']}  ({e['source']})") for r, e in report["regions"].items()]
    console.print(key_value_table(rows, title="per region: what the fit and the fingerprint say"))
    console.print(f"profile {report['profile']['name']}: the {report['chosen']}", highlight=False)
    for label, refs in report["metrics"].items():  # every contender, and stock hf
        cells = "; ".join(
            f"{ref}: bitwise {m['mismatch/bitwise_equal_frac']:.3f}, rms {m['mismatch/log_ratio_rms']:.3g}, "
            f"k3 {m['rollout_corr/k3_kl']:.2e}"
            for ref, m in refs.items()
        )
        console.print(f"  {label:28s} {cells}", highlight=False)
    disagree = [r for r, e in report["regions"].items() if e["fit_agrees_with_fingerprint"] is False]
    if disagree:
        console.print(f"fit and fingerprint disagree on: {', '.join(disagree)} (calibration.json has both)")
    console.print(f"profile: {Path(cfg.out) / 'profile.json'}; evidence: {Path(cfg.out) / 'calibration.json'}")
    return ExitStatus.OK
