"""vLLM's compiled CPU forward in the trainer (``Profile.forward = "vllm-cpu-compiled"``).

In its default mode vLLM 0.32's CPU build compiles the model's whole forward with stock Inductor
(``CompilationMode.DYNAMO_TRACE_ONCE``, backend ``"inductor"``: no vLLM passes, no piecewise split), with the
Inductor options its CPU platform sets (vllm/platforms/cpu.py), the token dimension dynamic, custom ops off: vLLM's
``forward_native`` RMSNorm, RoPE and SiluAndMul are traced into Inductor's fused C++ kernels, attention stays an
opaque op, and each GEMM is the layer's ``cpu_linear`` as vLLM's dispatch set it (oneDNN's ``onednn_mm`` or the AMX
weight-packed GEMM as opaque ops, torch's ``extern mm`` where vLLM falls back to it).

What those fused kernels compute is not a rounding location. They drop the bf16 casts between fused ops (the
``vllm-0.32-cpu`` rules say where), and they also sum each RMSNorm's squares in Inductor's own order: in vector
lanes, 16 or 8 of them depending on whether that kernel also stores the fp32 residual, which Inductor's
store-or-recompute heuristic decides per layer. A rounding rule cannot say that, and vLLM's attention and GEMM
alone leave the trainer short of the compiled engine (docs/kernels.md has how far).

So this module runs vLLM's own forward code, in vLLM's layer structure (``Qwen2Model.forward`` with Qwen2's or
Qwen3's decoder layers, ``LlamaModel.forward``), on the trainer model's weights, through the same compiler with the
same options: Inductor then generates the kernels the engine runs, on whatever CPU this is. Each GEMM is prepared by
vLLM's own dispatch and called as its graph calls it (``vllm_cpu.graph_linear``). The element-wise code is imported
from vLLM (``vllm.ir`` native ``rms_norm`` / ``fused_add_rms_norm``, ``RotaryEmbedding.forward_static`` on the cache
``get_rope`` builds, ``SiluAndMul.forward_native``); attention is vLLM's CPU attention (``vllm_cpu.attention``) as an
opaque ``torch.library`` op over the packed sequences; the lm_head stays outside the graph, as vLLM's
``compute_logits`` does.

**Backward.** A training-mode compile is not the inference graph (AOTAutograd's saved activations change which
buffers Inductor stores, and with them the lane widths), so the forward runs the compiled inference graph, and the
backward recomputes the model's own patched forward (the same rules and vLLM's kernels, eagerly, under the same
autocast) and takes its gradient at the same inputs: a standard gradient, as for the kernels, at the cost of one
more forward per step (what gradient checkpointing costs).
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F

from roundalign import compile_key, support
from roundalign.errors import UserError
from roundalign.kernels import batch as _batch
from roundalign.kernels import vllm_cpu
from roundalign.mixed_precision import engine_weight

# vllm/platforms/cpu.py (0.32), CpuPlatform.check_and_update_config: compilation_config.inductor_compile_config.
INDUCTOR_OPTIONS = {
    "dce": True,
    "size_asserts": False,
    "nan_asserts": False,
    "epilogue_fusion": True,
    "cpp.dynamic_threads": True,
}
FAMILIES = ("qwen2", "qwen3", "llama")  # vLLM's Qwen2Model / LlamaModel forward with their decoder layers


compile_key.key_compiles()  # graphs that call the op below: keyed on its sources


@torch.library.custom_op("roundalign::vllm_cpu_attention", mutates_args=())
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """vLLM's CPU attention over packed sequences, opaque to the compiler as vLLM's attention op is to its graph."""
    return vllm_cpu.attention(q, k, v, lengths.tolist(), scale)


@_attention.register_fake
def _(q, k, v, lengths, scale):
    return torch.empty_like(q)


@functools.cache
def _vllm_code():
    """vLLM's own element-wise code, as its compiled CPU mode traces it (custom ops off)."""
    vllm_cpu.load()
    from vllm import ir
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    return types.SimpleNamespace(
        rms_norm=ir.ops.rms_norm.impls["native"].impl_fn,
        fused_add_rms_norm=ir.ops.fused_add_rms_norm.impls["native"].impl_fn,
        rope=RotaryEmbedding.forward_static,
        silu_and_mul=SiluAndMul.forward_native,
        linear=vllm_cpu.graph_linear,
    )


def _rope(config, head_dim: int):
    """vLLM's rotary embedding for this config, built by its own ``get_rope`` (its bf16 ``cos_sin_cache``), checked
    to compute with the ``forward_static`` the graph calls."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    params = dict(getattr(config, "rope_parameters", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 1000000.0))
    params.setdefault("rope_type", "default")
    with set_current_vllm_config(VllmConfig()):  # vLLM's modules are built under a config; its defaults do here
        rope = get_rope(
            head_dim,
            max_position=config.max_position_embeddings,
            is_neox_style=True,
            rope_parameters=params,
            dtype=torch.bfloat16,
        )
    if type(rope).forward_native is not RotaryEmbedding.forward_native:
        raise UserError(
            f"forward='vllm-cpu-compiled' runs vLLM's standard rotary embedding; this config's rope "
            f"({params.get('rope_type')}) is vLLM's {type(rope).__name__}, which computes differently. Use the eager "
            "mode (enforce_eager, the '-eager-...-kernels' profile)"
        )
    return rope


def _forward(shape, code, ids, positions, lengths, cache, embed, layers, norm):
    """vLLM 0.32's ``Qwen2Model.forward`` (Qwen2, Qwen3) / ``LlamaModel.forward``, with their decoder layers, on
    packed tokens; returns the final hidden. The decoder layers differ only in Qwen3's q/k norms (``None`` where the
    family has none) and in which GEMMs have a bias; each GEMM is the one vLLM's dispatch chose (``graph_linear``)."""
    eps, heads, kv_heads, head_dim, rotary_dim = shape
    hidden = F.embedding(ids, embed)
    residual = None
    for in_ln, post_ln, q_norm, k_norm, qkv, o_proj, gate_up, down in layers:
        if residual is None:
            residual = hidden
            hidden = code.rms_norm(hidden, in_ln, eps, None)
        else:
            hidden, residual = code.fused_add_rms_norm(hidden, residual, in_ln, eps, None)
        q, k, v = code.linear(qkv, hidden).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        if q_norm is not None:  # Qwen3Attention: RMSNorm per head before the rotary embedding
            q_by_head = code.rms_norm(q.view(*q.shape[:-1], heads, head_dim), q_norm, eps, None)
            q = q_by_head.view(q.shape)
            k_by_head = code.rms_norm(k.view(*k.shape[:-1], kv_heads, head_dim), k_norm, eps, None)
            k = k_by_head.view(k.shape)
        q, k = code.rope(positions, q, k, head_dim, rotary_dim, cache, True)
        attn = _attention(
            q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim), v.view(-1, kv_heads, head_dim), lengths,
            head_dim**-0.5,
        )  # fmt: skip
        hidden = code.linear(o_proj, attn.view(-1, heads * head_dim))
        hidden, residual = code.fused_add_rms_norm(hidden, residual, post_ln, eps, None)
        hidden = code.linear(down, code.silu_and_mul(code.linear(gate_up, hidden)))
    hidden, _ = code.fused_add_rms_norm(hidden, residual, norm, eps, None)
    return hidden


# The GEMMs of a decoder layer as vLLM fuses them: (module attribute, the HF projections it concatenates). The keys
# are those the eager kernels prepare under (kernels.engine_gemm), so the backward's eager recompute reuses them.
_GEMMS = (
    ("self_attn", ("q_proj", "k_proj", "v_proj")),
    ("self_attn", ("o_proj",)),
    ("mlp", ("gate_proj", "up_proj")),
    ("mlp", ("down_proj",)),
)


class EngineGraph:
    """The compiled forward of one model, and the engine-shaped weights it reads."""

    def __init__(self, model):
        config = model.config
        self.base = model.model
        self.head_dim = support.head_dim(config)
        rope = _rope(config, self.head_dim)
        self.cache = rope.cos_sin_cache.to(torch.bfloat16)
        self.shape = (float(config.rms_norm_eps), config.num_attention_heads, config.num_key_value_heads,
                      self.head_dim, rope.rotary_dim)  # fmt: skip
        self.compiled = torch.compile(
            functools.partial(_forward, self.shape, _vllm_code()), backend="inductor", options=dict(INDUCTOR_OPTIONS)
        )

    def weights(self):
        """vLLM's weights: 16-bit, each GEMM prepared as vLLM's dispatch prepares it (oneDNN's handle, the AMX packed
        weight, or the fused weight for torch's GEMM) on q/k/v and gate/up concatenated. The prepared GEMMs are kept
        while the weights hold the same values (``engine_gemm``: a fused optimizer updates parameters in place without
        bumping their version, so the check is on the values); the small norm and embedding tensors are cast anew."""
        from roundalign.kernels.engine_gemm import fused_gemm

        low, layers = torch.bfloat16, []
        with torch.no_grad():
            for layer in self.base.layers:
                a = layer.self_attn
                q_norm = getattr(a, "q_norm", None)
                k_norm = getattr(a, "k_norm", None)
                gemms = [fused_gemm(getattr(layer, owner), names, low).graph for owner, names in _GEMMS]
                layers.append((
                    engine_weight(layer.input_layernorm.weight, low),
                    engine_weight(layer.post_attention_layernorm.weight, low),
                    None if q_norm is None else engine_weight(q_norm.weight, low),
                    None if k_norm is None else engine_weight(k_norm.weight, low),
                    *gemms,
                ))  # fmt: skip
            embed = engine_weight(self.base.embed_tokens.weight, low).contiguous()
            return embed, layers, engine_weight(self.base.norm.weight, low).contiguous()

    def __call__(self, ids: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
        """The final hidden states (tokens, hidden) of sequences packed back to back, each from position 0."""
        positions = torch.cat([torch.arange(n) for n in lengths])
        lens = torch.tensor(lengths, dtype=torch.int32)
        for t in (ids, positions, lens):
            torch._dynamo.mark_dynamic(t, 0)  # one graph for every token count, as vLLM compiles it
        embed, layers, norm = self.weights()
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            return self.compiled(ids, positions, lens, self.cache, embed, layers, norm)


class _CompiledForward(torch.autograd.Function):
    """Forward: ``run()`` (the compiled inference graph). Backward: the gradient of ``standard()`` (the model's own
    patched forward) at the same inputs, recomputed under the forward's autocast, w.r.t. ``params``."""

    @staticmethod
    def forward(ctx, run, standard, *params):
        ctx.standard = standard
        ctx.autocast = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
        ctx.save_for_backward(*params)
        return run()

    @staticmethod
    def backward(ctx, grad):
        params = ctx.saved_tensors
        enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast("cpu", dtype=dtype, enabled=enabled):
            out = ctx.standard()
        grads = torch.autograd.grad(out, params, grad, allow_unused=True)
        return (None, None, *grads)


def check(model) -> None:
    """Refuse, at ``apply``, what this forward does not reproduce, naming the fix."""
    config = model.config
    if config.model_type not in FAMILIES:
        raise UserError(
            f"forward='vllm-cpu-compiled' runs vLLM's compiled forward for {', '.join(FAMILIES)} models; this is a "
            f"{config.model_type} model. Use the eager-mode profile (vLLM with enforce_eager) or forward='hf'"
        )
    if getattr(config, "use_sliding_window", False):
        raise UserError("forward='vllm-cpu-compiled' covers full attention; this config uses a sliding window")
    d = support.head_dim(config)
    vllm_cpu.load()  # vLLM importable, and the release these calls are for, before its modules are asked anything
    _rope(config, d)
    hidden = config.hidden_size
    shapes = (
        ((config.num_attention_heads + 2 * config.num_key_value_heads) * d, hidden),  # q/k/v
        (hidden, config.num_attention_heads * d),  # o_proj
        (2 * config.intermediate_size, hidden),  # gate/up
        (hidden, config.intermediate_size),  # down_proj
    )
    for shape in shapes:  # vLLM's choice of GEMM here, refused where the graph cannot call it
        vllm_cpu.linear(torch.zeros(shape, dtype=torch.bfloat16), None)


def install(model) -> None:
    """Replace the backbone's forward (``model.model.forward``) by the compiled one; ``uninstall`` undoes it."""
    base = model.model
    base._roundalign_graph = EngineGraph(model)
    base.forward = types.MethodType(_graph_forward, base)


def uninstall(model) -> None:
    base = getattr(model, "model", None)
    if base is not None and "_roundalign_graph" in vars(base):
        del base._roundalign_graph
        del base.forward  # the class's forward again


def _graph_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                   inputs_embeds=None, use_cache=None, **kwargs):  # fmt: skip
    """``Qwen3Model.forward`` for whole sequences: the compiled engine graph (module docstring)."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    if input_ids is None or inputs_embeds is not None:
        raise UserError("forward='vllm-cpu-compiled' computes from input_ids (the engine's input); got inputs_embeds")
    if past_key_values is not None and past_key_values.get_seq_length() > 0:
        raise UserError(
            "forward='vllm-cpu-compiled' computes whole sequences (training and scoring), not steps over HF's KV "
            "cache: generate with the engine, or with a profile without engine kernels"
        )
    if kwargs.get("output_hidden_states") or kwargs.get("output_attentions"):
        raise UserError(
            "forward='vllm-cpu-compiled' runs the model as one compiled graph, which has no per-layer outputs; use "
            "forward='hf' (the same profile with +forward=hf) for per-layer hidden states"
        )
    b, n = input_ids.shape
    seqs = _batch.sequences(attention_mask, position_ids, b, n)

    def run():
        return seqs.unpack(self._roundalign_graph(seqs.pack(input_ids), seqs.lengths), b)

    params = [p for p in self.parameters() if p.requires_grad]
    if not (torch.is_grad_enabled() and params):
        return BaseModelOutputWithPast(last_hidden_state=run())

    def standard():
        out = type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 use_cache=False, **kwargs)  # fmt: skip
        return out.last_hidden_state

    return BaseModelOutputWithPast(last_hidden_state=_CompiledForward.apply(run, standard, *params))
