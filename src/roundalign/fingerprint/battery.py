"""The fingerprint battery: fixed bf16 inputs that make every region's rounding rules give different outputs.

``make_battery()`` builds the cases, ``save_battery`` writes them (``roundalign fingerprint make``). Each case names
the engine op it feeds (``op``), the profile region it tests (``region``), what it separates (``separates``), its
constants (``params``: eps, RoPE theta, head_dim, ...) and its bf16 inputs. The runner script feeds the inputs to
the engine's own layers; the reader recomputes every rule from the same inputs and names the rule the outputs
follow (``roundalign.fingerprint.reader``).

Why these inputs:

- Weights are not all ones (uniform in [0.2, 1.8), every mantissa bit used): with ``w = 1`` the RMSNorm rules
  ``r(w*r(x*nu))`` and ``r(x*nu*w)`` coincide.
- Element-wise cases (SwiGLU, RoPE) are picked near rounding ties: for each element (each rotated pair, for RoPE)
  the generator draws candidates (24; 8 per pair) and keeps one where the rules give different bf16 results, e.g.
  ``r(r(silu(g))*u) != r(silu(g)*u)``. A quarter of the rows keep their first draw, as typical values. Norm rows are
  plain random draws (a row's ``nu`` ties every element together), at several scales; a quarter to a third of
  their elements already separate the rules.
- Several hidden sizes and head dims: 64, 128 and 256, which SGLang's fp32-cos/sin RoPE kernel takes, and 80 and
  96, which it does not (``profiles.sglang``); positions up to 65,535, where fp32 angles are large.
- Compiled chains: "q/k RMSNorm then RoPE" in one graph (Inductor may skip the norm's output rounding:
  ``qk_norm=fused_into_rope``) and two "add + RMSNorm" calls in one graph (is the residual carried between them
  rounded?).

Shaped like the user's model (``make_battery(model=model_constants(path))``, ``roundalign fingerprint make --model``):
the same case builders again, at the constants of the model's config.json (head_dim, RoPE theta and max positions,
rms_norm_eps, hidden_size, intermediate_size, moe_intermediate_size), marked ``model: True``, with those constants
recorded in ``battery["model"]``. Kernels pick code paths by shape (SGLang's RoPE by head_dim), so the rule that
matters is the one at the model's shapes; the reader reports it on its own line.

Deterministic: every case draws from its own seeded CPU generator, so two runs give bitwise equal tensors; the
battery's ``id`` (a SHA-256 of every tensor and constant) lets the reader check that a results file carries the
battery it was run on, unmodified. Version 2 added the model cases and ``battery["model"]``; version-1 files (no
model cases) are still read, with their own id formula.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

from roundalign import durable
from roundalign.engine.native import cos_sin_cache
from roundalign.errors import MissingFile, UserError
from roundalign.ops import rope, swiglu
from roundalign.profiles import SEARCHED_ROPE_RULES

FORMAT = "roundalign-fingerprint-battery"
VERSION = 2
VERSIONS = (1, 2)  # what this roundalign reads
QK_NORM_MODELS = ("qwen3", "qwen3_moe")  # model types with a per-head q/k RMSNorm before RoPE
DTYPE = torch.bfloat16
EPS = 1e-6
MAX_POSITION = 65536
CANDIDATES = 8  # draws per rotated pair when picking near-tie RoPE inputs
SWIGLU_CANDIDATES = 24  # per SwiGLU element: each draw separates the rules with p ~ 0.28

ROPE_RULES = tuple(map(str, SEARCHED_ROPE_RULES))  # what the reader tries
# The inputs are picked where the rules that round to nearest disagree; truncation differs from them on about half
# of all elements anyway, and keeping it out of the picking keeps the battery (version 2) what it was.
NEAR_TIE_RULES = tuple(r for r in ROPE_RULES if not r.endswith("/truncate"))


def _gen(seed: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1000 + index)


def _weight(n: int, g: torch.Generator) -> torch.Tensor:
    return (0.2 + 1.6 * torch.rand(n, generator=g)).to(DTYPE)


def _rows(tokens: int, hidden: int, g: torch.Generator) -> torch.Tensor:
    """Random rows at a few scales (1, 8, 1/64) so that nu(x) varies, with a few outliers per row."""
    x = torch.randn(tokens, hidden, generator=g)
    scale = torch.tensor([1.0, 8.0, 1 / 64])[torch.arange(tokens) % 3].unsqueeze(-1)
    spikes = (torch.rand(tokens, hidden, generator=g) < 0.01) * 16.0
    return (x * scale * (1 + spikes)).to(DTYPE)


def inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """RoPE inverse frequencies in fp32, as vLLM's and SGLang's ``_compute_inv_freq``."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


@functools.lru_cache(maxsize=16)
def _cache(head_dim: int, theta: float, max_position: int) -> torch.Tensor:
    return cos_sin_cache(inv_freq(head_dim, theta), max_position, torch.float32)  # fp32; .to(bf16) is vLLM's cast


def cos_sin(positions: torch.Tensor, head_dim: int, theta: float, max_position: int, cos_sin_dtype: torch.dtype):
    """(cos, sin), (tokens, 1, head_dim) in rotate-half layout, from the engines' cache, in ``cos_sin_dtype``."""
    cache = _cache(head_dim, float(theta), max_position).index_select(0, positions).to(cos_sin_dtype)
    cos, sin = cache.chunk(2, dim=-1)  # (tokens, head_dim / 2) each
    return torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((sin, sin), -1).unsqueeze(1)


def rope_rule_outputs(
    x: torch.Tensor, positions: torch.Tensor, head_dim: int, theta: float, max_position: int, rules=ROPE_RULES
):
    """RoPE of ``x`` (tokens, heads, head_dim) under each of ``rules``: a dict rule -> bf16 output."""
    out = {}
    for rule in rules:
        cs, rounding = rule.split("/")
        cos, sin = cos_sin(positions, head_dim, theta, max_position, DTYPE if cs == "bf16" else torch.float32)
        out[rule] = rope(x, cos, sin, rounding, out_dtype=DTYPE)
    return out


def _pick(candidates: torch.Tensor, score: torch.Tensor, typical_rows: int) -> torch.Tensor:
    """Per element, the candidate (dim 0) with the highest score; the first ``typical_rows`` rows keep draw 0."""
    best = score.argmax(0)
    best[:typical_rows] = 0
    return candidates.gather(0, best.unsqueeze(0)).squeeze(0)


def _swiglu_near_ties(tokens: int, d: int, g: torch.Generator) -> torch.Tensor:
    """Merged [gate, up] (tokens, 2d) where, outside the typical rows, r(r(silu(g))*u) != r(silu(g)*u)."""
    gate = (2 * torch.randn(SWIGLU_CANDIDATES, tokens, d, generator=g)).to(DTYPE)
    up = (2 * torch.randn(SWIGLU_CANDIDATES, tokens, d, generator=g)).to(DTYPE)
    score = (swiglu(gate, up, "round_silu") != swiglu(gate, up, "once")).int()
    pair = torch.stack((gate, up), -1)  # (K, tokens, d, 2): a gate and its up are picked together
    picked = _pick(pair, score.unsqueeze(-1).expand_as(pair), tokens // 4)
    return torch.cat((picked[..., 0], picked[..., 1]), -1)


def _rope_near_ties(
    tokens: int,
    heads: int,
    head_dim: int,
    positions,
    theta: float,
    g: torch.Generator,
    max_position: int = MAX_POSITION,
):
    """q or k (tokens, heads * head_dim) whose rotated pairs (x1, x2) make the four round-to-nearest RoPE rules
    disagree."""
    x = (2 * torch.randn(CANDIDATES, tokens, heads, head_dim, generator=g)).to(DTYPE)
    outs = [
        rope_rule_outputs(x[k], positions, head_dim, theta, max_position, NEAR_TIE_RULES) for k in range(CANDIDATES)
    ]
    half = head_dim // 2
    score = torch.zeros(CANDIDATES, tokens, heads, half, dtype=torch.int32)
    for k, by_rule in enumerate(outs):
        values = list(by_rule.values())
        for i in range(len(values)):
            for j in range(i + 1, len(values)):
                diff = values[i] != values[j]
                score[k] += (diff[..., :half] | diff[..., half:]).int()  # a pair counts once for o1 or o2
    score = torch.cat((score, score), -1)  # x1 and x2 of a pair follow the same choice
    return _pick(x, score, tokens // 4).reshape(tokens, heads * head_dim)


def _positions(tokens: int, g: torch.Generator, max_position: int = MAX_POSITION) -> torch.Tensor:
    """A quarter small (0, 1, ...), the rest random up to ``max_position - 1``, which is included."""
    small = torch.arange(tokens // 4)
    large = torch.randint(0, max_position, (tokens - tokens // 4,), generator=g)
    large[-1] = max_position - 1
    return torch.cat((small, large))


_SEP_NORM = "round_before_weight r(w*r(x*nu)) vs round_after_weight r(x*nu*w)"
_SEP_ADD = "norm of the rounded sum R=r(a+h) vs of the fp32 sum S (x the norm rule); the residual output is r(S)"
_SEP_CHAIN = (
    "two add+norm calls in one graph: residual carried rounded (normalize_*_sum) vs fp32 inside the "
    "graph (round_at_attention / never_round)"
)
_SEP_SWIGLU = "round_silu r(r(silu(g))*u) vs once r(silu(g)*u)"
_SEP_ROPE = "cos/sin bf16 vs fp32 x per_op r(r(x1*c)-r(x2*s)) vs once r(x1*c-x2*s)"
_SEP_QK = "q/k norm round_before_weight vs round_after_weight vs fused_into_rope (norm unrounded into RoPE)"


def make_battery(seed: int = 0, model: dict | None = None) -> dict:
    """The battery as a dict (see the module docstring); bitwise the same for the same ``seed`` and ``model``
    (``model_constants``: adds the cases shaped like that model)."""
    cases: list[dict] = []

    def add(name, op, region, separates, params, inputs, is_model=False):
        cases.append(
            dict(name=name, op=op, region=region, separates=separates, params=params, inputs=inputs, model=is_model)
        )

    tokens = 16  # rows; small hidden sizes get more, so that every case has at least 8192 elements
    for hidden in (128, 1024, 4096):
        g = _gen(seed, len(cases))
        add(
            f"rms_norm/h{hidden}",
            "rms_norm",
            "rms_norm",
            _SEP_NORM,
            {"eps": EPS},
            {"x": _rows(max(tokens, 8192 // hidden), hidden, g), "weight": _weight(hidden, g)},
        )
    for hidden in (1024, 4096):
        g = _gen(seed, len(cases))
        add(
            f"add_rms_norm/h{hidden}",
            "add_rms_norm",
            "residual",
            _SEP_ADD,
            {"eps": EPS},
            {"x": _rows(tokens, hidden, g), "residual": _rows(tokens, hidden, g), "weight": _weight(hidden, g)},
        )
    g = _gen(seed, len(cases))
    add(
        "add_rms_norm_chain/h1024",
        "add_rms_norm_chain",
        "residual",
        _SEP_CHAIN,
        {"eps": EPS},
        {
            "x1": _rows(tokens, 1024, g),
            "residual": _rows(tokens, 1024, g),
            "x2": _rows(tokens, 1024, g),
            "weight1": _weight(1024, g),
            "weight2": _weight(1024, g),
        },
    )
    for d in (512, 1536):
        g = _gen(seed, len(cases))
        add(f"silu_and_mul/d{d}", "silu_and_mul", "swiglu", _SEP_SWIGLU, {}, {"x": _swiglu_near_ties(tokens, d, g)})
    g = _gen(seed, len(cases))
    add(
        "expert_silu_and_mul/d768",
        "expert_silu_and_mul",
        "expert_swiglu",
        _SEP_SWIGLU,
        {},
        {"x": _swiglu_near_ties(2 * tokens, 768, g)},
    )  # tokens x top-k rows, as the fused MoE's intermediate

    rope_tokens, q_heads, k_heads = 32, 4, 2
    for head_dim, theta in ((64, 1e4), (128, 1e6), (256, 1e6), (80, 1e4), (96, 1e6)):
        g = _gen(seed, len(cases))
        pos = _positions(rope_tokens, g)
        params = {"head_dim": head_dim, "theta": theta, "max_position": MAX_POSITION}
        add(
            f"rope/hd{head_dim}",
            "rope",
            "rope",
            _SEP_ROPE,
            params,
            {
                "positions": pos,
                "q": _rope_near_ties(rope_tokens, q_heads, head_dim, pos, theta, g),
                "k": _rope_near_ties(rope_tokens, k_heads, head_dim, pos, theta, g),
            },
        )
    for head_dim in (128, 80):
        g = _gen(seed, len(cases))
        pos = _positions(rope_tokens, g)
        params = {"head_dim": head_dim, "theta": 1e6, "max_position": MAX_POSITION, "eps": EPS}
        add(
            f"qk_norm_rope/hd{head_dim}",
            "qk_norm_rope",
            "qk_norm",
            _SEP_QK,
            params,
            {
                "positions": pos,
                "q": _rows(rope_tokens, q_heads * head_dim, g),
                "k": _rows(rope_tokens, k_heads * head_dim, g),
                "q_weight": _weight(head_dim, g),
                "k_weight": _weight(head_dim, g),
            },
        )

    if model is not None:
        _model_cases(add, lambda: _gen(seed, len(cases)), model)
    battery = {"format": FORMAT, "version": VERSION, "dtype": "bfloat16", "seed": seed, "model": model, "cases": cases}
    battery["id"] = battery_id(battery)
    return battery


def _model_cases(add, gen, m: dict) -> None:
    """The generic builders again at the model's constants (``model_constants``), each case marked ``model``."""
    hidden, eps, hd = m["hidden_size"], m["rms_norm_eps"], m["head_dim"]
    rows = max(16, 8192 // hidden)  # at least 8192 elements per norm case, as the generic ones
    g = gen()
    add(
        f"model/rms_norm/h{hidden}",
        "rms_norm",
        "rms_norm",
        _SEP_NORM,
        {"eps": eps},
        {"x": _rows(rows, hidden, g), "weight": _weight(hidden, g)},
        True,
    )
    g = gen()
    add(
        f"model/add_rms_norm/h{hidden}",
        "add_rms_norm",
        "residual",
        _SEP_ADD,
        {"eps": eps},
        {"x": _rows(rows, hidden, g), "residual": _rows(rows, hidden, g), "weight": _weight(hidden, g)},
        True,
    )
    g = gen()
    add(
        f"model/add_rms_norm_chain/h{hidden}",
        "add_rms_norm_chain",
        "residual",
        _SEP_CHAIN,
        {"eps": eps},
        {
            "x1": _rows(rows, hidden, g),
            "residual": _rows(rows, hidden, g),
            "x2": _rows(rows, hidden, g),
            "weight1": _weight(hidden, g),
            "weight2": _weight(hidden, g),
        },
        True,
    )
    if m.get("intermediate_size"):
        d, g = m["intermediate_size"], gen()
        add(
            f"model/silu_and_mul/d{d}",
            "silu_and_mul",
            "swiglu",
            _SEP_SWIGLU,
            {},
            {"x": _swiglu_near_ties(16, d, g)},
            True,
        )
    if m.get("moe_intermediate_size"):
        d, g = m["moe_intermediate_size"], gen()
        add(
            f"model/expert_silu_and_mul/d{d}",
            "expert_silu_and_mul",
            "expert_swiglu",
            _SEP_SWIGLU,
            {},
            {"x": _swiglu_near_ties(32, d, g)},
            True,
        )
    rope_tokens, max_position = 32, m["max_position_embeddings"]
    params = {"head_dim": hd, "theta": m["rope_theta"], "max_position": max_position}
    g = gen()
    pos = _positions(rope_tokens, g, max_position)
    add(
        f"model/rope/hd{hd}",
        "rope",
        "rope",
        _SEP_ROPE,
        params,
        {
            "positions": pos,
            "q": _rope_near_ties(rope_tokens, 4, hd, pos, m["rope_theta"], g, max_position),
            "k": _rope_near_ties(rope_tokens, 2, hd, pos, m["rope_theta"], g, max_position),
        },
        True,
    )
    if m.get("qk_norm"):
        g = gen()
        pos = _positions(rope_tokens, g, max_position)
        add(
            f"model/qk_norm_rope/hd{hd}",
            "qk_norm_rope",
            "qk_norm",
            _SEP_QK,
            {**params, "eps": eps},
            {
                "positions": pos,
                "q": _rows(rope_tokens, 4 * hd, g),
                "k": _rows(rope_tokens, 2 * hd, g),
                "q_weight": _weight(hd, g),
                "k_weight": _weight(hd, g),
            },
            True,
        )


def model_constants(model: str | Path) -> dict:
    """The constants of a model's config.json that shape its cases, read with transformers' AutoConfig from local
    files only. ``model``: a model directory (what ``from_pretrained`` loads), its config.json, or ``"shipped"``
    for roundalign's tiny-qwen3 (``roundalign.models.path()``)."""
    from transformers import AutoConfig

    if str(model) == "shipped":
        import roundalign.models

        path, name = roundalign.models.path(), "tiny-qwen3"
    else:
        path = Path(model)
        path = path.parent if path.is_file() and path.name == "config.json" else path
        name = path.resolve().name
    if not (path / "config.json").is_file():
        raise MissingFile(
            f"--model {model}: no config.json in {path}; give a local model directory (the one "
            "from_pretrained loads) or 'shipped' for roundalign's tiny-qwen3"
        )
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # unknown model_type, bad JSON, transformers' validators (their own error classes)
        raise UserError(f"--model {model}: transformers cannot read {path / 'config.json'}: {exc}") from exc
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    theta = theta if theta is not None else getattr(config, "rope_theta", None)
    found = {
        "hidden_size": getattr(config, "hidden_size", None),
        "rms_norm_eps": getattr(config, "rms_norm_eps", None),
        "rope_theta": theta,
        "max_position_embeddings": getattr(config, "max_position_embeddings", None),
        "num_attention_heads": getattr(config, "num_attention_heads", None),
    }
    missing = [k for k, v in found.items() if v is None]
    if missing:
        raise UserError(
            f"--model {model}: its config ({config.model_type}) has no {', '.join(missing)}; the "
            "battery needs them (a decoder LM with RMSNorm and RoPE: Llama, Qwen2, Qwen3, Qwen3-MoE)"
        )
    head_dim = getattr(config, "head_dim", None) or found["hidden_size"] // found["num_attention_heads"]
    if head_dim % 2:
        raise UserError(f"--model {model}: head_dim {head_dim} is odd; RoPE rotates pairs")
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
    moe = (
        (getattr(config, "moe_intermediate_size", None) or getattr(config, "intermediate_size", None))
        if experts
        else None
    )
    return {
        "name": name,
        "path": str(path.resolve()),
        "model_type": config.model_type,
        "head_dim": int(head_dim),
        "rope_theta": float(theta),
        "rope_type": str(rope.get("rope_type", "default")) if isinstance(rope, dict) else "default",
        "rms_norm_eps": float(found["rms_norm_eps"]),
        "hidden_size": int(found["hidden_size"]),
        "intermediate_size": int(getattr(config, "intermediate_size", 0) or 0) or None,
        "moe_intermediate_size": int(moe) if moe else None,
        "max_position_embeddings": int(found["max_position_embeddings"]),
        "qk_norm": config.model_type in QK_NORM_MODELS,
    }


def battery_id(battery: dict) -> str:
    """SHA-256 over every case's name, op, constants and input bytes: changes if anything in the battery does.
    Version 2 also hashes the model's constants (not its path, which is machine-specific) and the case flags."""
    version = battery["version"]
    h = hashlib.sha256(f"{battery['format']}/{version}".encode())
    if version >= 2:
        model = battery.get("model")
        h.update(repr(None if model is None else sorted((k, v) for k, v in model.items() if k != "path")).encode())
    for case in battery["cases"]:
        h.update(f"{case['name']}|{case['op']}|{sorted(case['params'].items())}".encode())
        if version >= 2:
            h.update(f"|model={bool(case.get('model'))}".encode())
        for key in sorted(case["inputs"]):
            t = case["inputs"][key]
            h.update(f"{key}{tuple(t.shape)}{t.dtype}".encode())
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def save_battery(path: str | Path, seed: int = 0, model: dict | None = None) -> dict:
    battery = make_battery(seed, model)
    durable.write_with(path, lambda tmp: torch.save(battery, tmp))
    return battery


def check_battery(battery: dict, where: str) -> None:
    """Raise ValueError unless ``battery`` is this version's battery, unmodified."""
    if not isinstance(battery, dict) or battery.get("format") != FORMAT:
        raise UserError(
            f"{where} does not hold a roundalign fingerprint battery; make one with "
            "`roundalign fingerprint make --out battery.pt`"
        )
    if battery.get("version") not in VERSIONS:
        raise UserError(
            f"{where} holds battery version {battery.get('version')}, this roundalign reads versions "
            f"{', '.join(map(str, VERSIONS))}: make a new battery (`roundalign fingerprint make`) and "
            "run it again"
        )
    if battery_id(battery) != battery.get("id"):
        raise UserError(
            f"{where}: the battery's tensors or constants do not match its id (modified or "
            "truncated); make a new battery with `roundalign fingerprint make` and run it again"
        )


def describe(battery: dict) -> list[dict]:
    """One row per case for tables: name, region, input shapes, what it separates."""
    rows = []
    for case in battery["cases"]:
        shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in case["inputs"].items())
        rows.append(
            {
                "case": case["name"],
                "region": case["region"],
                "inputs": shapes,
                "params": case["params"],
                "model": bool(case.get("model")),
                "separates": case["separates"],
            }
        )
    return rows
