"""Read a fingerprint results file: which rounding rule each region follows, per mode, and the evidence.

For every run (an engine in one mode) and every region, the reader recomputes the battery's cases under each
candidate rule with ``roundalign.ops`` and compares the engine's outputs with them element by element:

- ``equal``: the fraction of output elements bitwise equal to the candidate's, over all of the region's cases, and
  ``worst_case``, the lowest fraction in any one case;
- ``max_ulp``: the largest distance, in bf16 ulps, between the engine's output and the candidate's.

Decision (one criterion for every region, not tuned per engine): a candidate *matches* when ``equal >= 0.999`` and
``max_ulp <= 1``. The slack is for reduction order, not rounding points: compiled RMSNorm sums ``x^2`` in another
order than eager and then differs from its own rule in about 1e-5 of the elements, by one ulp each
(docs/vllm-compiled.md), and GPU ``cos``/``sin`` may differ from the CPU's in a last bit. A wrong rounding point moves
a sixth to three quarters of the elements of some case (the battery picks near-tie values so that it does). A region is

- ``determined`` when exactly one candidate matches and every candidate that predicts different outputs stays far
  below: under 99% equal in at least one case (``worst_case < 0.99``), so that one case that separates two rules is
  not outvoted by cases that do not;
- ``indistinguishable`` when the matching candidate stands for several rules that predict the same outputs at the op
  level: ``round_at_attention`` and ``never_round`` differ only in where an engine splits its graphs, which op
  outputs cannot show (``roundalign fit`` separates them from log-probs);
- ``ambiguous`` when more than one prediction matches or another one reaches 99% in every case;
- ``no_rule`` when nothing matches: the engine rounds somewhere no rule in ``roundalign.profiles`` does.

Joint regions: the add + norm cases depend on the norm rule too, and the q/k-norm chain on the RoPE rule of its head
dim, so their candidates are combinations; the region's answer is the rule part of the matching combination. RoPE
is decided per head dim (SGLang's depends on it).

A battery made with ``--model`` is read twice: the generic cases per region as above, and the cases shaped like the
model (``model: True``) on their own, with the same criterion, as ``entry["model"]``: the rules at the model's own
shapes (RoPE at its head dim and theta), and the regions where they differ from the generic answer.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field

import torch

from roundalign.errors import MissingFile, UserError
from roundalign.fingerprint import battery as B
from roundalign.fingerprint import runner as R
from roundalign.numerics.bf16 import bf16_order_key
from roundalign.ops import residual_add, rms_norm, rope, swiglu
from roundalign.profiles import QKNormRule, ResidualRule, RMSNormRule, SwiGLURule

MATCH_EQUAL, MATCH_ULP, FAR_BELOW = 0.999, 1, 0.99
ROUNDED_CARRY = (ResidualRule.NORMALIZE_ROUNDED_SUM, ResidualRule.NORMALIZE_FP32_SUM)
OP_LEVEL_TWINS = {ResidualRule.ROUND_AT_ATTENTION.value, ResidualRule.NEVER_ROUND.value}


@dataclass
class Region:
    """The answer for one region in one run."""

    region: str
    status: str  # determined | indistinguishable | ambiguous | no_rule
    rules: list[str]  # the matching rule(s); for rope a "hd64: ..." summary
    evidence: list[dict]  # per candidate rule: best equal fraction and its max ulp
    note: str = ""
    per_head_dim: dict = field(default_factory=dict)  # rope only: head_dim -> Region

    def to_dict(self) -> dict:
        out = {"status": self.status, "rules": self.rules, "evidence": self.evidence, "note": self.note}
        if self.per_head_dim:
            out["per_head_dim"] = {str(k): v.to_dict() for k, v in self.per_head_dim.items()}
        return out


# ----------------------------------------------------------------------------------------------------------------
# predictions: each case under each (partial) rule, from roundalign.ops


def _rope_rule(x, positions, p, rule: str):
    cs, rounding = rule.split("/")
    cos, sin = B.cos_sin(
        positions, p["head_dim"], p["theta"], p["max_position"], B.DTYPE if cs == "bf16" else torch.float32
    )
    return rope(x, cos, sin, rounding, out_dtype=B.DTYPE)


def _heads(t, hd):
    return t.view(t.shape[0], -1, hd)


def predict(case: dict, **rule) -> list[torch.Tensor]:
    """The outputs ``case`` gives under ``rule`` (the keyword names depend on the op)."""
    op, p, w = case["op"], case["params"], case["inputs"]
    if op == "rms_norm":
        return [rms_norm(w["x"], w["weight"], p["eps"], rule["norm"])]
    if op == "add_rms_norm":
        res, x = residual_add(w["x"], w["residual"], rule["residual"])
        return [rms_norm(x, w["weight"], p["eps"], rule["norm"], out_dtype=B.DTYPE), res]
    if op == "add_rms_norm_chain":
        res, x = residual_add(w["x1"], w["residual"], rule["residual"])
        out1 = rms_norm(x, w["weight1"], p["eps"], rule["norm"], out_dtype=B.DTYPE)
        carried = res if rule["residual"] in ROUNDED_CARRY else x  # compiled engines carry S inside a graph
        res, x = residual_add(w["x2"], carried, rule["residual"])
        return [out1, rms_norm(x, w["weight2"], p["eps"], rule["norm"], out_dtype=B.DTYPE), res]
    if op in ("silu_and_mul", "expert_silu_and_mul"):
        x = w["x"]
        d = x.shape[-1] // 2
        return [swiglu(x[..., :d], x[..., d:], rule["swiglu"])]
    hd = p["head_dim"]
    if op == "rope":
        return [_rope_rule(_heads(w[k], hd), w["positions"], p, rule["rope"]).reshape(w[k].shape) for k in "qk"]
    if op == "qk_norm_rope":
        out = []
        for k in "qk":
            normed = rms_norm(_heads(w[k], hd), w[f"{k}_weight"], p["eps"], rule["qk_norm"], out_dtype=B.DTYPE)
            out.append(_rope_rule(normed, w["positions"], p, rule["rope"]).reshape(w[k].shape))
        return out
    raise UserError(f"battery case {case['name']!r}: unknown op {op!r}")


# ----------------------------------------------------------------------------------------------------------------
# comparison and decision


def _compare(got: list[torch.Tensor], want: list[torch.Tensor]) -> tuple[int, int, int]:
    """(equal elements, elements, max ulp) of two output lists given as ``bf16_order_key``."""
    equal = total = worst = 0
    for g, w in zip(got, want, strict=True):
        d = (g - w).abs_()
        n = int(torch.count_nonzero(d))
        equal, total = equal + g.numel() - n, total + g.numel()
        if n:
            worst = max(worst, int(d.max()))
    return equal, total, worst


@dataclass
class _Scored:
    cand: dict
    equal: float  # over all of the region's output elements
    worst_case: float  # the lowest per-case fraction
    max_ulp: int
    preds: list


def _decide(region: str, part: str, candidates: list[dict], outputs: dict, cases: list[dict]) -> Region:
    """``candidates``: dicts of partial rules; ``part`` is the key whose value is this region's rule."""
    cache: dict = {}
    got = {c["name"]: [bf16_order_key(t) for t in outputs[c["name"]]] for c in cases}
    scored = []
    for cand in candidates:
        equal = total = worst = 0
        worst_case, preds = 1.0, []
        for case in cases:
            keys = _keys_for(case, cand)
            key = (case["name"], keys)
            if key not in cache:
                cache[key] = [bf16_order_key(t) for t in predict(case, **dict(keys))]
            preds.append(cache[key])
            e, t, u = _compare(got[case["name"]], cache[key])
            equal, total, worst, worst_case = equal + e, total + t, max(worst, u), min(worst_case, e / t)
        scored.append(_Scored(cand, equal / total, worst_case, worst, preds))
    # Candidates whose predictions are bitwise identical on this battery form one class (keyed by a digest of
    # their bytes; the digests of the cached predictions are computed once).
    digests: dict[int, bytes] = {}

    def digest(t):
        if id(t) not in digests:
            digests[id(t)] = hashlib.sha256(t.numpy().tobytes()).digest()
        return digests[id(t)]

    by_key: dict[tuple, list[_Scored]] = {}
    for item in scored:
        by_key.setdefault(tuple(digest(t) for pred in item.preds for t in pred), []).append(item)
    classes = sorted(by_key.values(), key=lambda cls: -cls[0].equal)
    matching = [cls for cls in classes if cls[0].equal >= MATCH_EQUAL and cls[0].max_ulp <= MATCH_ULP]
    evidence = _evidence(scored, part)
    if not matching:
        best = classes[0][0]
        return Region(
            region,
            "no_rule",
            [],
            evidence,
            f"no rule matches: the closest, {_label(best.cand)}, has {best.equal:.2%} of elements equal "
            f"and {best.max_ulp} ulp at most; the engine rounds somewhere no roundalign rule does",
        )
    others = [cls[0] for cls in classes if cls is not matching[0]]
    close = [o for o in others if o.worst_case >= FAR_BELOW]
    if len(matching) > 1 or close:
        rules = sorted({str(c.cand[part]) for cls in matching for c in cls} | {str(o.cand[part]) for o in close})
        return Region(
            region,
            "ambiguous",
            rules,
            evidence,
            f"the battery does not separate these: {_label(close[0].cand if close else matching[1][0].cand)} "
            f"has {(close[0] if close else matching[1][0]).worst_case:.2%} equal in every case",
        )
    winner = matching[0]
    rules = sorted({str(c.cand[part]) for c in winner})
    rest = {k: str(v) for k, v in winner[0].cand.items() if k != part}
    note = ("with " + ", ".join(f"{k}={v}" for k, v in rest.items())) if rest else ""
    if len(rules) == 1:
        return Region(region, "determined", rules, evidence, note)
    if set(rules) == OP_LEVEL_TWINS:
        note = (
            f"{' and '.join(rules)} give the same op outputs (they differ in where an engine splits its graphs); "
            "use `roundalign fit` on dumped log-probs to tell them apart" + (f"; {note}" if note else "")
        )
    return Region(region, "indistinguishable", rules, evidence, note)


def _keys_for(case: dict, cand: dict) -> tuple:
    """The part of a candidate a case depends on (the q/k chain reads the RoPE rule of its own head dim)."""
    keys = dict(cand)
    if case["op"] == "qk_norm_rope":
        keys["rope"] = keys.pop(f"rope@{case['params']['head_dim']}")
        keys = {k: v for k, v in keys.items() if not k.startswith("rope@")}
    return tuple(sorted((k, str(v)) for k, v in keys.items()))


def _label(cand: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in cand.items())


def _evidence(scored: list[_Scored], part: str) -> list[dict]:
    """For each value of the region's rule, its best candidate: equal fraction (all cases, and the worst case)
    and max ulp."""
    best: dict[str, _Scored] = {}
    for item in scored:
        rule = str(item.cand[part])
        if rule not in best or item.equal > best[rule].equal:
            best[rule] = item
    rows = [
        {
            "rule": r,
            "equal": b.equal,
            "worst_case": b.worst_case,
            "max_ulp": b.max_ulp,
            "with": {k: str(v) for k, v in b.cand.items() if k != part},
        }
        for r, b in best.items()
    ]
    return sorted(rows, key=lambda row: -row["equal"])


# ----------------------------------------------------------------------------------------------------------------
# regions


def _by_region(battery: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for case in battery["cases"]:
        out.setdefault(case["region"], []).append(case)
    return out


REGION_ORDER = ("rms_norm", "qk_norm", "residual", "rope", "swiglu", "expert_swiglu")


def read_run(battery: dict, outputs: dict, model: bool = False) -> dict[str, Region]:
    """The Region per region, from the generic cases, or (``model=True``) from the cases shaped like the model:
    then only the regions it has, and RoPE at its one head dim decided as one region."""
    cases = _by_region({"cases": [c for c in battery["cases"] if bool(c.get("model")) == model]})
    norms = [r.value for r in RMSNormRule]
    regions = {"rms_norm": _decide("rms_norm", "norm", [{"norm": n} for n in norms], outputs, cases["rms_norm"])}
    res = [{"residual": r.value, "norm": n} for r in ResidualRule for n in norms]
    regions["residual"] = _decide("residual", "residual", res, outputs, cases["residual"])
    per_hd = {}
    for case in cases["rope"]:
        per_hd[case["params"]["head_dim"]] = _decide(
            "rope", "rope", [{"rope": r} for r in B.ROPE_RULES], outputs, [case]
        )
    regions["rope"] = next(iter(per_hd.values())) if model else _rope_region(per_hd)
    if "qk_norm" in cases:
        hds = sorted({c["params"]["head_dim"] for c in cases["qk_norm"]})
        qk = [
            {"qk_norm": q.value, **{f"rope@{hd}": r for hd, r in zip(hds, rr, strict=True)}}
            for q in QKNormRule
            for rr in itertools.product(B.ROPE_RULES, repeat=len(hds))
        ]
        regions["qk_norm"] = _decide("qk_norm", "qk_norm", qk, outputs, cases["qk_norm"])
    for region in ("swiglu", "expert_swiglu"):
        if region in cases:
            regions[region] = _decide(
                region, "swiglu", [{"swiglu": s.value} for s in SwiGLURule], outputs, cases[region]
            )
    return {name: regions[name] for name in REGION_ORDER if name in regions}


def read_model(battery: dict, outputs: dict, generic: dict[str, Region]) -> dict | None:
    """The model's line: its constants, the Region per region at its shapes, and the regions whose rules differ
    from the generic cases' (RoPE compared at the model's head dim, when the generic cases have it)."""
    if not battery.get("model"):
        return None
    regions = read_run(battery, outputs, model=True)
    differs = []
    for name, region in regions.items():
        other = generic.get(name)
        if name == "rope":
            other = other.per_head_dim.get(battery["model"]["head_dim"]) if other is not None else None
        if other is not None and region.rules != other.rules:
            differs.append(name)
    return {"constants": battery["model"], "regions": regions, "differs": differs}


def _rope_region(per_hd: dict[int, Region]) -> Region:
    summary = [f"hd{hd}: {'|'.join(r.rules) or '-'}" for hd, r in sorted(per_hd.items())]
    statuses = {r.status for r in per_hd.values()}
    status = (
        "determined"
        if statuses == {"determined"}
        else next(s for s in ("no_rule", "ambiguous", "indistinguishable") if s in statuses)
    )
    distinct = {tuple(r.rules) for r in per_hd.values()}
    rules = list(next(iter(distinct))) if len(distinct) == 1 else summary
    note = "" if len(distinct) == 1 else "the rule depends on head_dim"
    evidence = [{"head_dim": hd, **row} for hd, r in sorted(per_hd.items()) for row in r.evidence[:2]]
    return Region("rope", status, rules, evidence, note, per_head_dim=per_hd)


# ----------------------------------------------------------------------------------------------------------------
# results files


def check_results(results, where: str = "results") -> None:
    """Raise ValueError unless ``results`` is a complete results file for this battery version."""
    if not isinstance(results, dict) or results.get("format") != R.RESULTS_FORMAT:
        raise UserError(
            f"{where} is not a fingerprint results file; the runner writes one "
            "(`python run_fingerprint.py battery.pt --engine vllm --out results.pt`)"
        )
    if results.get("version") != R.RESULTS_VERSION:
        raise UserError(
            f"{where} has results version {results.get('version')}; this roundalign reads "
            f"{R.RESULTS_VERSION}: rerun the runner copied from this roundalign "
            "(`roundalign fingerprint runner`)"
        )
    B.check_battery(results.get("battery"), f"{where}'s battery")
    battery = results["battery"]
    runs = results.get("runs") or []
    if not runs:
        raise UserError(f"{where} holds no runs")
    names = [c["name"] for c in battery["cases"]]
    for run in runs:
        tag = f"{where}: the {run.get('engine')} {run.get('mode')} run"
        if run.get("mode") not in R.MODES:
            raise UserError(f"{tag} has unknown mode {run.get('mode')!r}; expected one of {R.MODES}")
        outputs = run.get("outputs", {})
        missing = [n for n in names if n not in outputs]
        extra = [n for n in outputs if n not in names]
        if missing or extra:
            raise UserError(
                f"{tag}: missing case(s) {missing}, unknown case(s) {extra}; rerun the runner on this battery"
            )
        for case in battery["cases"]:
            want = R.expected_shapes(case)
            got = outputs[case["name"]]
            shapes = [(tuple(t.shape), t.dtype) for t in got] if isinstance(got, (list, tuple)) else got
            if shapes != [(s, B.DTYPE) for s in want]:
                raise UserError(
                    f"{tag}: case {case['name']!r} has outputs {shapes}; expected {[(s, B.DTYPE) for s in want]}"
                )


def load_results(path) -> dict:
    """A results file (``fingerprint run --out``), read with ``torch.load(weights_only=True)``: tensors and plain
    data only, so opening one runs no code; anything else is a ``UserError`` naming the file."""
    try:
        results = torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise MissingFile(f"fingerprint results {str(path)!r} do not exist") from None
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, EOFError, ... for a file that is not one
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UserError(
            f"{path}: not fingerprint results ({type(e).__name__}: {first}); `roundalign fingerprint run --out` "
            "writes them"
        ) from None
    check_results(results, str(path))
    return results


def read_results(results: dict) -> list[dict]:
    """One entry per run: engine, mode, versions, device, the Region per region, and ``model``: the model's line
    (``read_model``), or None for a battery made without ``--model``."""
    check_results(results)
    out = []
    battery = results["battery"]
    for run in results["runs"]:
        info = run.get("info", {})
        regions = read_run(battery, run["outputs"])
        out.append(
            {
                "engine": run["engine"],
                "mode": run["mode"],
                "engine_version": info.get("engine_version", "?"),
                "device": run.get("device", "?"),
                "torch": results.get("torch", "?"),
                "regions": regions,
                "model": read_model(battery, run["outputs"], regions),
            }
        )
    return out
