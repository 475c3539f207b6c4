"""The aligned modules shared by every model family, as mixins placed in front of the HF classes.

A patched module keeps its HF class, parameters and state_dict keys; only its ``__class__`` changes to
``Aligned<HFClass>`` (a subclass defined in the family's file), whose ``forward`` runs ``roundalign.ops`` with the
rule stored on the instance. ``revert`` puts the HF class back.

The residual stream is the one structural change. Under every rule but HF's, the norm after a residual add reads
the fp32 sum ``S = a + h``, and the residual carried on is either ``R = r(S)`` or ``S`` itself (see ``ResidualRule``).
Across a layer boundary that needs both, so an aligned decoder layer returns the pair ``(R, S)`` instead of ``R``:

- HF's model loop passes the pair to the next layer (and the last one to the final norm) untouched;
- ``output_hidden_states`` records ``output[0] = R``, the same bf16 tensor stock HF records;
- gradient checkpointing (non-reentrant, HF's default) checkpoints the pair like any other input;
- generation and the KV cache only see q/k/v inside attention, which are unchanged.

Under ``normalize_rounded_sum`` a layer returns ``R`` alone, exactly as stock HF does.

Two things about how a trainer runs the model change nothing in the rounding points, by design:

- **FSDP2 mixed precision** (``MixedPrecisionPolicy(param_dtype=bf16)``, verl's and accelerate's default
  ``cast_forward_inputs=True``) casts every floating tensor a wrapped module receives to bf16, which would round
  ``S`` and fp32 cos/sin at each layer boundary. The fp32 tensors aligned modules hand each other therefore travel
  in a ``Carry``, a holder FSDP's input cast does not open (``roundalign.mixed_precision``).
- **Autocast with fp32 parameters** (HF Trainer / TRL ``bf16=True``): linears, matmuls and SDPA already run in bf16;
  the aligned modules make the rest match a bf16 engine serving ``r(W)``: the embedding output is rounded where it
  enters the first layer, and norm weights are rounded before use (``low_dtype``, ``engine_weight``). Stock HF under
  autocast keeps an fp32 residual stream instead; docs/mixed-precision.md lists every tensor.
"""

from __future__ import annotations

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from roundalign import kernels, ops
from roundalign.mixed_precision import Carry, engine_weight, low_dtype
from roundalign.profiles import AttentionKernel, GemmKernel, ResidualRule, RopeRounding, SwiGLURule


def _carried(hidden_states):
    """Split what a layer or the final norm receives into (residual R, what the norm reads)."""
    if isinstance(hidden_states, tuple):
        rounded, fp32_sum = hidden_states
        return rounded, fp32_sum.tensors[0]
    return hidden_states, hidden_states


def _pair(rounded, x):
    """What a norm inside a layer is handed: ``(R, S)`` where it reads the fp32 sum, else the tensor itself."""
    return x if x is rounded else (rounded, Carry(x))


def _layer_input(hidden_states):
    """``_carried`` for a decoder layer, where the residual stream starts.

    A plain tensor there is the embedding output (or R under normalize_rounded_sum). Under autocast with fp32
    parameters the embedding is fp32, while an engine's is the bf16 row ``r(E)``: round it here.
    """
    rounded, x = _carried(hidden_states)
    low = low_dtype(rounded)
    if rounded.dtype != low:
        rounded = x = rounded.to(low)
    return rounded, x


class _Aligned:
    """What every aligned mixin shares: whether its ops run their Inductor-fused variants (``apply(...,
    compile_ops=True)``; bitwise equal to the eager ones, tests/test_ops_compiled.py), and the GEMM kernel of its
    linear layers (``roundalign.kernels``)."""

    _roundalign_compile_ops = False
    _roundalign_gemm = GemmKernel.TORCH
    _roundalign_quant = None  # the served quantization scheme (roundalign.quant), or None: bf16


class AlignedRMSNorm(_Aligned):
    """RMSNorm with ``_roundalign_rule``; reads the fp32 sum when handed an ``(R, S)`` pair (and differentiates at
    ``R``)."""

    _roundalign_rule: str

    def forward(self, hidden_states):
        rounded, x = _carried(hidden_states)
        low = low_dtype(self.weight, x)  # the weight's (model's) 16-bit dtype, or autocast's
        return ops.rms_norm(
            x,
            engine_weight(self.weight, low),
            self.variance_epsilon,
            self._roundalign_rule,
            low,
            compiled=self._roundalign_compile_ops,
            rounded=rounded if rounded.dtype == low else None,  # S's gradient at R (roundalign.ops.rms_norm)
        )

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, rule={self._roundalign_rule}"


class AlignedMLP(_Aligned):
    """Dense SwiGLU MLP: ``down(swiglu(gate(x), up(x)))`` with ``_roundalign_rule``; gate/up one GEMM under an
    engine's GEMM kernel, as engines fuse them."""

    _roundalign_rule: SwiGLURule

    def forward(self, x):
        gate, up = kernels.project(self, ("gate_proj", "up_proj"), x, self._roundalign_gemm)
        hidden = ops.swiglu(gate, up, self._roundalign_rule, compiled=self._roundalign_compile_ops)
        return kernels.project(self, ("down_proj",), hidden, self._roundalign_gemm)[0]

    def extra_repr(self) -> str:
        quant = f", quantization={self._roundalign_quant}" if self._roundalign_quant is not None else ""
        return f"swiglu={self._roundalign_rule}, gemm={self._roundalign_gemm}{quant}"


class AlignedAttention(_Aligned):
    """HF attention with RoPE (and Qwen3's q/k norm) through ``roundalign.ops``, and the profile's kernels: HF's
    projections and attention function, or an engine's (``roundalign.kernels``: q/k/v as one GEMM)."""

    _roundalign_rope: RopeRounding
    _roundalign_attention = AttentionKernel.HF
    _hf_eager_attention = None  # the family module's eager_attention_forward, set by define_family

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
        if "past_key_values" in kwargs:  # HF 5.x still accepts the old name through deprecate_kwarg
            cache = kwargs.pop("past_key_values")
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query, key, value = kernels.project(self, ("q_proj", "k_proj", "v_proj"), hidden_states, self._roundalign_gemm)
        query, key = query.view(hidden_shape), key.view(hidden_shape)  # (B, T, H, D)
        value = value.view(hidden_shape).transpose(1, 2)
        if hasattr(self, "q_norm"):  # Qwen3: per-head norm before RoPE; fp32 out under fused_into_rope
            query, key = self.q_norm(query), self.k_norm(key)

        cos, sin = position_embeddings  # (B, T, D), dtype per the profile's cos/sin rule
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        low = value.dtype
        fused = self._roundalign_compile_ops
        query = ops.rope(query.transpose(1, 2), cos, sin, self._roundalign_rope, low, fused)  # (B, H, T, D)
        key = ops.rope(key.transpose(1, 2), cos, sin, self._roundalign_rope, low, fused)

        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)

        if self._roundalign_attention is AttentionKernel.HF:
            interface = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, self._hf_eager_attention
            )
        else:
            interface = kernels.attention
        if hasattr(self, "sliding_window"):  # Qwen2/Qwen3 pass it; Llama's attention has none
            kwargs["sliding_window"] = self.sliding_window
        attn_output, attn_weights = interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return kernels.project(self, ("o_proj",), attn_output, self._roundalign_gemm)[0], attn_weights

    def extra_repr(self) -> str:
        return f"rope={self._roundalign_rope}, attention={self._roundalign_attention}, gemm={self._roundalign_gemm}"


class AlignedDecoderLayer(_Aligned):
    """Pre-norm decoder layer whose residual adds follow ``_roundalign_residual`` (see the module docstring)."""

    _roundalign_residual: ResidualRule
    _roundalign_profile: str

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        position_ids=None,
        cache=None,
        use_cache=False,
        position_embeddings=None,
        **kwargs,
    ):
        if "past_key_values" in kwargs:
            cache = kwargs.pop("past_key_values")
        _check_checkpointing(self)
        rule = self._roundalign_residual
        rounded, x = _layer_input(hidden_states)  # (R, what the norm reads: R or S)
        residual = x if rule is ResidualRule.NEVER_ROUND else rounded
        x = self.input_layernorm(_pair(rounded, x))
        x, _ = self.self_attn(
            hidden_states=x,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        rounded, x = ops.residual_add(x, residual, rule, self._roundalign_compile_ops)  # R, and what the norm reads
        # Carried into the MLP's add: R, except where a compiled engine keeps the post-attention sum in fp32.
        residual = x if rule in (ResidualRule.ROUND_AT_ATTENTION, ResidualRule.NEVER_ROUND) else rounded
        x = self.post_attention_layernorm(_pair(rounded, x))
        x = self.mlp(x)
        rounded, x = ops.residual_add(x, residual, rule, self._roundalign_compile_ops)
        if rule is ResidualRule.NORMALIZE_ROUNDED_SUM:
            return rounded
        return rounded, Carry(x)  # (R, S): the next norm reads S; the next layer carries R, or S under never_round

    def extra_repr(self) -> str:
        return f"profile={self._roundalign_profile}, residual={self._roundalign_residual}"


def _check_checkpointing(layer) -> None:
    func = getattr(layer, "_gradient_checkpointing_func", None)
    if not (layer.gradient_checkpointing and layer.training and func is not None):
        return
    if getattr(func, "keywords", {}).get("use_reentrant", False):
        raise RuntimeError(
            "roundalign: reentrant gradient checkpointing cannot carry the (R, S) residual pair between layers "
            "(gradients would not reach S). Enable it with "
            "model.activation_checkpointing_enable(activation_checkpointing_kwargs={'use_reentrant': False}), "
            "HF's default."
        )


class AlignedExperts(_Aligned):
    """MoE experts (HF ``*Experts`` with 3D gate_up_proj/down_proj) with ``_roundalign_rule`` for their SwiGLU."""

    _roundalign_rule: SwiGLURule

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        # Used by HF's grouped_mm / batched_mm expert implementations, and by the eager loop below.
        gate, up = gate_up_out.chunk(2, dim=-1)
        return ops.swiglu(gate, up, self._roundalign_rule, compiled=self._roundalign_compile_ops)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        experts = _EngineWeights.of(self, low_dtype(hidden_states))
        impl = getattr(self.config, "_experts_implementation", None) or "eager"
        if impl != "eager":
            return ALL_EXPERTS_FUNCTIONS.get_interface(impl, None)(experts, hidden_states, top_k_index, top_k_weights)
        # HF's eager loop (qwen3_moe Qwen3MoeExperts.forward), with the SwiGLU through _apply_gate.
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_idx = expert_idx[0]
            if expert_idx == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            gate_up = torch.nn.functional.linear(hidden_states[token_idx], experts.gate_up_proj[expert_idx])
            out = torch.nn.functional.linear(self._apply_gate(gate_up), experts.down_proj[expert_idx])
            out = out * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, swiglu={self._roundalign_rule}"


class _EngineWeights:
    """The experts module as HF's expert functions read it, with its weights rounded to ``r(W)``.

    Under autocast with fp32 parameters, HF's grouped_mm path casts the bf16 tokens *up* to the fp32 expert weights
    (``torch._grouped_mm`` is not autocast-enabled), so stock experts compute in fp32; a bf16 engine's do not.
    Handing HF's function this view, whose 3D weights are the engine's bf16 ones, keeps the expert GEMMs in bf16.
    """

    def __init__(self, experts, low: torch.dtype):
        self._experts = experts
        for name, p in experts.named_parameters(recurse=False):
            setattr(self, name, engine_weight(p, low))

    @classmethod
    def of(cls, experts, low: torch.dtype):
        if all(p.dtype == low for p in experts.parameters(recurse=False)):
            return experts  # a bf16 model, or FSDP mixed precision: nothing to round
        return cls(experts, low)

    def __getattr__(self, name):  # config, num_experts, _apply_gate, ... from the module itself
        return getattr(self._experts, name)
