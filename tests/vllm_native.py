"""A vLLM-structured Qwen3 for the compiled-engine measurements, and the rounding-rule references it is compared with.

vLLM's default V1 path (torch.compile + Inductor, custom ops off) traces each layer's ``forward_native`` into Inductor
graphs split at the attention op (docs/engine-rounding.md s4.1, s5). The restated vLLM code (RMSNorm,
SiluAndMul, RotaryEmbedding and its cos/sin cache, the decoder structure; sources and commits in its docstring) and
the piecewise backend live in the engine, ``roundalign.engine.native`` and ``roundalign.engine.compile``; this module
runs that model on an HF model's weights one prompt at a time (``VllmQwen3``), with a stateless attention op that can
record its inputs, and compiles it whole or piecewise (``compile_model``).

Deliberate differences from vLLM, none of which touches an element-wise rounding point: q/k/v and gate/up are
separate linears unless ``merged`` (vLLM merges them into one GEMM), so that every matmul is HF's own call; attention
is ``F.scaled_dot_product_attention`` (causal, GQA) called exactly as HF's sdpa path calls it, inside an opaque
``torch.library`` op that stands in for vLLM's ``unified_attention`` splitting op; rotary_dim == head_dim.

The references: ``formula_forward`` composes ``roundalign.ops`` into a model with any residual carry and q/k-norm
rule, and ``measure_qwen3`` compares the compiled model's logits with it, with ``roundalign.apply`` and stock HF.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from roundalign.engine.attention import AttentionSpec, causal_attention
from roundalign.engine.compile import piecewise_backend
from roundalign.engine.loader import ServedWeights, rope_inv_freq
from roundalign.engine.native import NativeModel, cos_sin_cache

# --------------------------------------------------------------------------------------------------------------
# attention: an opaque op, like vLLM's unified_attention, at which the piecewise backend splits


RECORD_ATTENTION: list | None = None  # set to a list to record every (q, k, v) the attention op receives


def _this_module():
    """tests/ is on sys.path too (conftest), so this file may also be imported as plain ``vllm_native``: a second
    module object, whose op registration replaces the first one's. Both copies read and set RECORD_ATTENTION on
    ``tests.vllm_native``, so that recording works whichever copy registered the op last."""
    return sys.modules.get("tests.vllm_native") or sys.modules[__name__]


@torch.library.custom_op("vllm_native::attention", mutates_args=())
def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, scale: float
) -> torch.Tensor:
    """Causal GQA attention of one sequence on ``(tokens, heads * head_dim)`` tensors, as HF's sdpa path does it.

    Stateless (no KV cache, one sequence per call), unlike the engine's ``roundalign::unified_attention``, and it
    can record what it receives; the computation is the engine's ``causal_attention``."""
    record = _this_module().RECORD_ATTENTION
    if record is not None:
        record.append((q.clone(), k.clone(), v.clone()))
    if scale != head_dim**-0.5:
        raise ValueError(f"scale {scale} is not head_dim**-0.5")
    return causal_attention(q, k, v, AttentionSpec(num_heads, num_kv_heads, head_dim))


@attention.register_fake
def _(q, k, v, num_heads, num_kv_heads, head_dim, scale):
    return q.new_empty(q.shape[0], num_heads * head_dim)


# --------------------------------------------------------------------------------------------------------------
# vLLM-structured Qwen3 over an HF Qwen3ForCausalLM's weights: the engine's inductor-backend model


class VllmQwen3(NativeModel):
    """The engine's vLLM-structured model (``roundalign.engine.native.NativeModel``) on a bf16 copy of an HF
    ``Qwen3ForCausalLM``'s weights, with the stateless attention op above, so that a prompt is one forward.

    ``forward(input_ids, positions)`` returns the final-norm hidden states (tokens, hidden); ``logits`` applies the
    lm_head eagerly, outside the compiled region, as vLLM's LogitsProcessor does. ``merged``: one q/k/v GEMM and
    one gate/up GEMM on concatenated weights, as vLLM's QKVParallelLinear / MergedColumnParallelLinear.
    """

    def __init__(self, hf_model, merged: bool = False):
        weights = ServedWeights(hf_model.config)
        weights.load(dict(hf_model.state_dict()))  # bf16 already: an exact copy
        super().__init__(weights, hf_model.config)
        self.merged = merged
        if merged:
            for layer in weights.model.layers:
                a, mlp = layer.self_attn, layer.mlp
                a.register_buffer(
                    "_qkv", torch.cat((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)), persistent=False
                )
                mlp.register_buffer("_gate_up", torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight)), persistent=False)

    def attention(self, layer, q, k, v):
        return torch.ops.vllm_native.attention(
            q, k, v, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5
        )

    def qkv(self, attn, h):
        if not self.merged:
            return super().qkv(attn, h)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return F.linear(h, attn._qkv).split([q_size, kv_size, kv_size], dim=-1)

    def gate_up(self, mlp, h):
        return F.linear(h, mlp._gate_up) if self.merged else super().gate_up(mlp, h)


# --------------------------------------------------------------------------------------------------------------
# compiling: one whole graph, or piecewise (the engine's backend: split at attention, each piece its own Inductor
# graph, as vLLM does)


def compile_model(model: VllmQwen3, mode: str, dynamic: bool = True, log: list | None = None):
    """``mode`` 'whole' (one Inductor graph, attention an extern call inside it) or 'piecewise'.

    ``dynamic`` marks the token dimension dynamic, as vLLM compiles one graph for all batch sizes.
    Returns ``run(input_ids, positions) -> hidden``.
    """
    torch._dynamo.reset()
    backend = "inductor" if mode == "whole" else piecewise_backend([torch.ops.vllm_native.attention], log)
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=None if dynamic else False)

    def run(input_ids, positions):
        if dynamic:
            torch._dynamo.mark_dynamic(input_ids, 0)
            torch._dynamo.mark_dynamic(positions, 0)
        with torch.no_grad():
            return compiled(input_ids, positions)

    return run


# --------------------------------------------------------------------------------------------------------------
# the tiny Qwen3


def tiny_qwen3(seed: int = 0, **overrides):
    """A random bf16 ``Qwen3ForCausalLM`` (sdpa attention) with activations at realistic scale.

    Linear weights ~ N(0, 1/fan_in), so every projection keeps unit-scale activations; norm weights log-normal
    around 1 (the init's all-ones would make rounding before and after the weight the same); embeddings ~ N(0, 1).
    """
    import transformers

    kw = dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=512,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kw)).to(torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    return realistic_init(model, seed)


def realistic_init(model, seed: int):
    """Overwrite every parameter at realistic scale (see ``tiny_qwen3``); biases ~ N(0, 0.1^2). Returns the model,
    frozen, in eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.exp(0.4 * torch.randn(p.shape, generator=g)))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    model.requires_grad_(False)
    return model.eval()


def hf_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """HF logits for one unpadded sequence, as (tokens, vocab)."""
    with torch.no_grad():
        return model(input_ids[None]).logits[0]


# --------------------------------------------------------------------------------------------------------------
# the rounding formulas, composed into a model: what the compiled engine computes, written with roundalign.ops

RESIDUAL_CARRY = ("every_add", "at_attention", "never")
# The roundalign ResidualRule for each carry (all three normalize the fp32 sum).
CARRY_RULE = {"every_add": "normalize_fp32_sum", "at_attention": "round_at_attention", "never": "never_round"}


def apply_name(carry: str, qk_rule: str) -> str:
    return f"apply vllm, residual={CARRY_RULE[carry]}, qk_norm={qk_rule}"


def formula_forward(
    hf_model,
    input_ids: torch.Tensor,
    *,
    qk_norm: str,
    residual_carry: str = "every_add",
    rms_norm: str = "round_after_weight",
    rope_rounding: str = "once",
    swiglu: str = "once",
):
    """Logits (tokens, vocab) of ``hf_model``'s weights with the given rounding rules, all ops from roundalign.ops.

    Every norm reads the fp32 sum ``S`` (fused add + RMSNorm). ``residual_carry`` says where the carried residual
    is rounded to bf16:

    - ``every_add``: after every residual add, ``R = r(S)`` (roundalign's ``normalize_fp32_sum``).
    - ``at_attention``: only where it crosses an attention op, i.e. between two pieces of a piecewise compile;
      the sum after attention stays fp32 into the MLP's add.
    - ``never``: the residual stream stays fp32 from the embedding to the final norm.
    """
    from roundalign import ops

    if residual_carry not in RESIDUAL_CARRY:
        raise ValueError(residual_carry)
    cfg, m = hf_model.config, hf_model.model
    eps, d = cfg.rms_norm_eps, cfg.head_dim
    bf16 = m.embed_tokens.weight.dtype
    cache = cos_sin_cache(rope_inv_freq(cfg)[0], cfg.max_position_embeddings, bf16)
    n = input_ids.shape[0]
    cos, sin = cache.index_select(0, torch.arange(n)).chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), -1)[:, None], torch.cat((sin, sin), -1)[:, None]

    def carry(s, crossing_attention):
        rounded = residual_carry == "every_add" or (residual_carry == "at_attention" and crossing_attention)
        return s.to(bf16) if rounded else s

    with torch.no_grad():
        res = F.embedding(input_ids, m.embed_tokens.weight)
        x = res  # what the next norm reads
        for layer in m.layers:
            a = layer.self_attn
            h = ops.rms_norm(x, layer.input_layernorm.weight, eps, rms_norm, out_dtype=bf16)
            q = ops.rms_norm(F.linear(h, a.q_proj.weight).view(n, -1, d), a.q_norm.weight, eps, qk_norm, bf16)
            k = ops.rms_norm(F.linear(h, a.k_proj.weight).view(n, -1, d), a.k_norm.weight, eps, qk_norm, bf16)
            q = ops.rope(q, cos, sin, rope_rounding, bf16).view(n, -1)
            k = ops.rope(k, cos, sin, rope_rounding, bf16).view(n, -1)
            o = torch.ops.vllm_native.attention(
                q, k, F.linear(h, a.v_proj.weight), cfg.num_attention_heads, cfg.num_key_value_heads, d, d**-0.5
            )
            s = F.linear(o, a.o_proj.weight).float() + res.float()
            res = carry(s, crossing_attention=False)
            h = ops.rms_norm(s, layer.post_attention_layernorm.weight, eps, rms_norm, out_dtype=bf16)
            mlp = layer.mlp
            act = ops.swiglu(F.linear(h, mlp.gate_proj.weight), F.linear(h, mlp.up_proj.weight), swiglu)
            s = F.linear(act, mlp.down_proj.weight).float() + res.float()
            res = carry(s, crossing_attention=True)
            x = s
        h = ops.rms_norm(x, m.norm.weight, eps, rms_norm, out_dtype=bf16)
        return F.linear(h, hf_model.lm_head.weight)


# --------------------------------------------------------------------------------------------------------------
# the measurement shared by tests/test_vllm_compiled.py and scripts/measure_qk_norm.py

QK_RULES = ("round_after_weight", "fused_into_rope", "round_before_weight")
MODES = ("whole", "piecewise")


def prompts(vocab: int, n_prompts: int, tokens: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (tokens,), generator=g) for _ in range(n_prompts)]


def first_layer_qk(hf_model, input_ids: torch.Tensor, rule: str):
    """The first attention's (q, k) under q/k-norm ``rule`` and the engine's other rules (norm rounds after the
    weight, RoPE rounds once with the bf16 cache), from the embedding: what the engine hands its first attention."""
    from roundalign import ops

    cfg, m = hf_model.config, hf_model.model
    layer, d, eps, n = m.layers[0], cfg.head_dim, cfg.rms_norm_eps, input_ids.shape[0]
    bf16 = m.embed_tokens.weight.dtype
    cache = cos_sin_cache(rope_inv_freq(cfg)[0], cfg.max_position_embeddings, bf16)
    cos, sin = cache[:n].chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), -1)[:, None], torch.cat((sin, sin), -1)[:, None]
    a = layer.self_attn
    with torch.no_grad():
        h = ops.rms_norm(
            F.embedding(input_ids, m.embed_tokens.weight), layer.input_layernorm.weight, eps, "round_after_weight"
        )
        out = []
        for proj, norm in ((a.q_proj, a.q_norm), (a.k_proj, a.k_norm)):
            x = ops.rms_norm(F.linear(h, proj.weight).view(n, -1, d), norm.weight, eps, rule, bf16)
            out.append(ops.rope(x, cos, sin, "once", bf16).reshape(n, -1))
    return tuple(out)


def _agreement(got: list[torch.Tensor], ref: list[torch.Tensor]) -> dict:
    eq = [g == r for g, r in zip(got, ref, strict=True)]
    equal = sum(int(e.sum()) for e in eq)
    total = sum(e.numel() for e in eq)
    return {
        "equal": equal,
        "total": total,
        "fraction": equal / total,
        "prompts_equal": sum(bool(e.all()) for e in eq),
        "prompts": len(eq),
    }


def measure_qwen3(
    hf_model,
    prompt_ids: list[torch.Tensor],
    *,
    dynamic: bool = True,
    merged: bool = False,
    modes=MODES,
    code: bool = False,
) -> dict:
    """Logits of the vLLM-structured engine (eager and compiled per ``modes``) against every reference.

    Returns ``{"agreement": {mode: {reference: {...}}}, "first_attention_qk": {mode: {rule: (mismatched, total)}},
    "eager_vs_per_op_formula": {...}, "formula_equals_apply": {"carry, rule": bool}, "seconds": {...},
    "code": {mode: str}}``. Every prompt is one sequence (its own causal attention); all share one compile.
    """
    import time

    import roundalign

    engine = VllmQwen3(hf_model, merged=merged)
    n_layers = hf_model.config.num_hidden_layers
    out: dict = {"seconds": {}, "first_attention_qk": {}, "code": {}}
    logits: dict[str, list] = {}
    with torch.no_grad():
        logits["eager"] = [engine.logits(engine(ids, torch.arange(len(ids)))) for ids in prompt_ids]
    for mode in modes:
        t0 = time.time()
        run = compile_model(engine, mode, dynamic=dynamic)
        _this_module().RECORD_ATTENTION = seen = []
        try:
            hidden = []
            for i, ids in enumerate(prompt_ids):
                if code and i == 0:
                    from torch._inductor.utils import run_and_get_code

                    h, src = run_and_get_code(run, ids, torch.arange(len(ids)))
                    out["code"][mode] = "\n".join(src)
                else:
                    h = run(ids, torch.arange(len(ids)))
                hidden.append(h)
                if i == 0:
                    out["seconds"][mode] = time.time() - t0
        finally:
            _this_module().RECORD_ATTENTION = None
        logits[mode] = [engine.logits(h) for h in hidden]
        firsts = seen[::n_layers]
        out["first_attention_qk"][mode] = {}
        for rule in QK_RULES:
            bad = total = 0
            for ids, (q, k, _) in zip(prompt_ids, firsts, strict=True):
                rq, rk = first_layer_qk(hf_model, ids, rule)
                bad += int((q != rq).sum() + (k != rk).sum())
                total += q.numel() + k.numel()
            out["first_attention_qk"][mode][rule] = (bad, total)
    torch._dynamo.reset()

    refs = {"stock HF": [hf_logits(hf_model, ids) for ids in prompt_ids]}
    roundalign.apply(hf_model, "vllm")
    try:
        refs["apply vllm (as shipped)"] = [hf_logits(hf_model, ids) for ids in prompt_ids]
    finally:
        roundalign.revert(hf_model)
    for carry in RESIDUAL_CARRY:
        for rule in QK_RULES:
            roundalign.apply(hf_model, "vllm", residual=CARRY_RULE[carry], qk_norm=rule)
            try:
                refs[apply_name(carry, rule)] = [hf_logits(hf_model, ids) for ids in prompt_ids]
            finally:
                roundalign.revert(hf_model)
    for carry in RESIDUAL_CARRY:
        for rule in QK_RULES:
            refs[f"formula residual={carry}, qk_norm={rule}"] = [
                formula_forward(hf_model, ids, qk_norm=rule, residual_carry=carry) for ids in prompt_ids
            ]
    # formula_forward is a second implementation of the same rules: it must equal roundalign.apply everywhere.
    out["formula_equals_apply"] = {
        f"{carry}, {rule}": all(
            torch.equal(a, b)
            for a, b in zip(
                refs[apply_name(carry, rule)], refs[f"formula residual={carry}, qk_norm={rule}"], strict=True
            )
        )
        for carry in RESIDUAL_CARRY
        for rule in QK_RULES
    }
    per_op = [
        formula_forward(
            hf_model,
            ids,
            qk_norm="round_before_weight",
            rms_norm="round_before_weight",
            rope_rounding="per_op",
            swiglu="round_silu",
        )
        for ids in prompt_ids
    ]
    out["eager_vs_per_op_formula"] = _agreement(logits["eager"], per_op)
    roundalign.apply(
        hf_model,
        "vllm",
        rms_norm="round_before_weight",
        qk_norm="round_before_weight",
        residual="normalize_fp32_sum",  # eager: vLLM's native add + norm rounds the residual after every add
        rope="bf16/per_op",
        swiglu="round_silu",
    )
    try:
        out["eager_vs_apply_per_op"] = _agreement(logits["eager"], [hf_logits(hf_model, ids) for ids in prompt_ids])
    finally:
        roundalign.revert(hf_model)
    out["agreement"] = {mode: {name: _agreement(logits[mode], ref) for name, ref in refs.items()} for mode in modes}
    return out
