"""The engine's attention and GEMM kernels in the trainer's forward, with standard gradients.

Rounding-location alignment leaves the kernels: an engine's attention and GEMMs reduce in their own orders, and
once the element-wise code rounds where the engine's does, they are what still separates a trainer's log-probs
from the sampler's. A profile therefore also names the kernels (``Profile.attention``, ``Profile.gemm``), and
``roundalign.apply`` runs the named ones here:

- ``attention``: ``hf`` (the model's own), ``vllm-cpu`` (vLLM's CPU attention ops, ``vllm_cpu``) or ``reference``
  (the reference engine's decode attention, row by row). The engine kernels compute each sequence of the batch
  alone, unpadded and from position 0, as the engine computed it (``batch.sequences`` finds them in a padded or
  packed batch from the attention mask and ``position_ids``).
- ``forward``: ``hf`` (the model's forward, patched region by region) or ``vllm-cpu-compiled`` (vLLM's own forward
  code compiled by Inductor as vLLM's CPU build compiles it: ``graph``), which vLLM's default compiled mode needs.
- ``gemm``: ``torch`` (each ``nn.Linear`` as it is), ``vllm-cpu`` (vLLM's CPU GEMM dispatch on the weights vLLM
  fuses: q/k/v and gate/up as one GEMM each, the lm_head padded to 64 rows) or ``reference`` (one GEMM call per
  row, as the reference engine's decode).

**Backward.** The engine kernels have none. The gradient is that of standard attention and of a standard linear
at the same inputs: attention saves only q, k and v and recomputes HF's SDPA attention in the backward (so memory
is what FlashAttention-style training uses, and the gradient is stock HF's own); a linear's input gradient is
``g @ W`` and its weight gradient ``g^T x`` in the model dtype, as torch's linear backward computes them (for a fused
q/k/v the three input gradients are summed inside one GEMM rather than added in bf16 afterwards). So the forward is
the engine's bit for bit, and the update direction is the usual one: what an exact on-policy RL trainer needs.
Gradient checkpointing recomputes the engine forward, which is deterministic.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from roundalign.errors import UserError
from roundalign.kernels import batch as _batch
from roundalign.mixed_precision import engine_weight, low_dtype
from roundalign.profiles import AttentionKernel, ForwardKernel, GemmKernel, Profile


def check(profile: Profile, model) -> None:
    """Raise a clear error, at ``apply`` time, where this model cannot run the profile's kernels here."""
    config = model.config
    if profile.forward is ForwardKernel.VLLM_CPU_COMPILED:
        if (profile.attention, profile.gemm) != (AttentionKernel.VLLM_CPU, GemmKernel.VLLM_CPU):
            raise UserError(
                f"forward='vllm-cpu-compiled' is vLLM's compiled forward, with vLLM's attention and GEMM inside it; "
                f"profile {profile.name!r} names attention={profile.attention!s}, gemm={profile.gemm!s}. Use "
                "attention='vllm-cpu' and gemm='vllm-cpu' (the vllm-0.32-cpu-kernels profile)"
            )
        from roundalign.kernels import graph

        graph.check(model)
    if profile.attention is AttentionKernel.VLLM_CPU or profile.gemm is GemmKernel.VLLM_CPU:
        from roundalign.kernels import vllm_cpu

        if profile.attention is AttentionKernel.VLLM_CPU:
            vllm_cpu.check_model(config)
        else:
            vllm_cpu.load()
        devices = {p.device.type for p in model.parameters()}
        if devices != {"cpu"}:
            raise UserError(
                f"the vllm-cpu kernels run on the CPU; this model's parameters are on {sorted(devices)}. Use the "
                "profile without '-kernels' on a GPU (vLLM's CUDA kernels are not wired in yet: docs/kernels.md)"
            )
    if profile.gemm is not GemmKernel.TORCH and getattr(config, "num_experts", None):
        raise UserError(
            f"gemm={profile.gemm!s} covers dense models: the experts' GEMMs (vLLM's CPU MoE kernel cpu_fused_moe, the "
            "reference engine's expert loop) are not reproduced, so a MoE model would not be exact. Use gemm='torch' "
            "for Qwen3-MoE"
        )


# --------------------------------------------------------------------------------------------------------------
# attention


def _no_autocast(t: torch.Tensor):
    """The engine kernels run on the 16-bit tensors they are given, with no autocast: under TRL's ``bf16=True`` (CPU
    autocast) the reference kernels' fp32 arithmetic (attention's softmax and products over the fp32 KV cache) would
    otherwise be cast down to bf16, which the engine never does."""
    return torch.autocast(t.device.type, enabled=False)


class _EngineAttention(torch.autograd.Function):
    """Forward: ``run(q, k, v)`` (an engine kernel). Backward: the gradient of ``standard(q, k, v, mask)``,
    recomputed.

    The mask (HF's, or None) is saved with q, k and v, not held by ``standard``: saved tensors are released when the
    backward has used them (unless it retains the graph), while a node's other attributes live as long as the graph,
    past the backward's end, where stock HF holds no mask."""

    @staticmethod
    def forward(ctx, q, k, v, mask, run, standard):
        ctx.standard, ctx.has_mask = standard, mask is not None
        ctx.save_for_backward(q, k, v, *((mask,) if ctx.has_mask else ()))
        with _no_autocast(q):
            return run(q, k, v)

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        mask = saved[3] if ctx.has_mask else None
        with torch.enable_grad():
            inputs = [
                t.detach().requires_grad_(need) for t, need in zip(saved[:3], ctx.needs_input_grad[:3], strict=True)
            ]
            out = ctx.standard(*inputs, mask)
            wanted = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        return (*(next(grads) if t.requires_grad else None for t in inputs), None, None, None)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths, scale: float) -> torch.Tensor:
    """The reference engine's decode attention, row by row: each query row against its sequence's keys up to its
    own position, in fp32, exactly as a decode step computes it (``roundalign.engine.attention.decode_attention``,
    the same function on the same shapes)."""
    from roundalign.engine.attention import AttentionSpec, decode_attention

    heads, head_dim, kv_heads = q.shape[1], q.shape[2], k.shape[1]
    spec = AttentionSpec(heads, kv_heads, head_dim, rowwise=True)
    if scale != spec.scale:
        raise UserError(f"the reference engine's attention scales by head_dim**-0.5; this model uses {scale}")
    out, start = [], 0
    for n in lengths:
        # The engine's KV cache holds the 16-bit keys and values as fp32, (kv_heads, positions, head_dim).
        k32, v32 = (t[start : start + n].float().transpose(0, 1) for t in (k, v))
        for j in range(n):
            out.append(decode_attention(q[start + j].reshape(1, -1), k32[:, : j + 1], v32[:, : j + 1], spec))
        start += n
    return torch.cat(out).view(-1, heads, head_dim)


def _packed_kernel(kernel: AttentionKernel):
    """The kernel's function of sequences packed back to back: ``(q, k, v, lengths, scale) -> out``."""
    if kernel is AttentionKernel.VLLM_CPU:
        from roundalign.kernels import vllm_cpu

        return vllm_cpu.attention
    return _reference


# The forward in progress: (mask, position_ids, shape, Sequences), the tensors held by weak reference. A strong one
# would keep HF's (batch, 1, tokens, tokens) mask alive after the forward, into the backward's peak, which stock
# HF does not hold then.
_SEQUENCES: list = []


def _ref(t):
    return None if t is None else weakref.ref(t)


def _same(ref, t) -> bool:
    """Whether ``ref`` (``_ref``'s) is to ``t`` itself; a freed tensor is no longer anything."""
    return t is None if ref is None else t is not None and ref() is t


def _sequences_of(attention_mask, position_ids, batch: int, width: int) -> _batch.Sequences:
    """``batch.sequences``, once per forward: every layer gets the same mask and position tensors."""
    if _SEQUENCES:
        mask, pos, shape, seqs = _SEQUENCES[0]
        if _same(mask, attention_mask) and _same(pos, position_ids) and shape == (batch, width):
            return seqs
    seqs = _batch.sequences(attention_mask, position_ids, batch, width)
    _SEQUENCES[:] = [(_ref(attention_mask), _ref(position_ids), (batch, width), seqs)]
    return seqs


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """An HF attention function (``AttentionInterface`` signature) that runs ``module._roundalign_attention``.

    query ``(batch, heads, tokens, head_dim)`` after RoPE, key/value ``(batch, kv_heads, tokens, head_dim)``;
    returns ``((batch, tokens, heads, head_dim), None)`` as HF's sdpa function does."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kernel = module._roundalign_attention
    if dropout:
        raise UserError(f"attention dropout {dropout}: the engine kernels compute no dropout (set attention_dropout=0)")
    b, _, n, _ = query.shape
    if key.shape[2] != n:
        raise UserError(
            f"{n} queries against {key.shape[2]} keys: the engine kernels compute whole sequences (training and "
            "scoring), not steps over HF's KV cache. Generate with the engine, or with the profile without kernels"
        )
    scale = module.scaling if scaling is None else scaling
    seqs = _sequences_of(attention_mask, kwargs.get("position_ids"), b, n)
    packed = _packed_kernel(kernel)

    def run(q, k, v):
        q, k, v = (seqs.pack(t.transpose(1, 2)) for t in (q, k, v))  # (tokens, heads, head_dim)
        return seqs.unpack(packed(q, k, v, seqs.lengths, scale), b)

    def standard(q, k, v, mask):
        return sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=scale, **kwargs)[0]

    return _EngineAttention.apply(query, key, value, attention_mask, run, standard), None


# --------------------------------------------------------------------------------------------------------------
# GEMM


class _EngineLinear(torch.autograd.Function):
    """Forward: ``run(x)`` over the concatenated weights. Backward: torch's linear gradients of the same.

    ``fused``: the concatenated weights where the caller holds them (the prepared GEMM's copy), so that the backward
    reads them instead of concatenating the weights again (a copy of every weight per step, the LM head's too);
    ``None`` where there is one weight (read as it is) or no such copy."""

    @staticmethod
    def forward(ctx, x, run, fused, n_weights, *params):
        weights, biases = params[:n_weights], params[n_weights:]
        ctx.n_weights, ctx.has_bias = n_weights, bool(biases)
        ctx.sizes = [w.shape[0] for w in weights]
        ctx.save_for_backward(x, *((fused,) if fused is not None else weights))
        with _no_autocast(x):
            return run(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad):
        x, *weights = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = (g @ (weights[0] if len(weights) == 1 else torch.cat(weights))).view(x.shape)
        if any(ctx.needs_input_grad[4 : 4 + ctx.n_weights]):
            gw = (g.t() @ x.reshape(-1, x.shape[-1])).split(ctx.sizes)
        if ctx.has_bias:
            gb = g.sum(0).split(ctx.sizes)
        return (gx, None, None, None, *(gw or [None] * ctx.n_weights), *(gb or []))


def _gemm_for(module, key: str, weights, biases):
    """vLLM's prepared GEMM for these weights, kept on ``module`` for as long as they hold the same values, as vLLM
    prepares its weights once per load.

    The check is on the values (each weight is compared with its rows of the fused weight the GEMM was prepared
    for: one pass over them, against the GEMM's many), not on the parameters' version counters or addresses: a fused
    optimizer (``AdamW(fused=True)``, HF Trainer's default ``adamw_torch_fused``) updates parameters in place without
    bumping their version, and under autocast the 16-bit weights are fresh casts every forward. The weights are
    fused (concatenated) only when they changed.

    A change (after every optimizer step) costs a copy and vLLM's packing of the weights. The old entry is dropped
    first and its fused copy refilled in place: the allocator then hands the new packed weights the old ones' memory
    instead of faulting in fresh pages (a third of the cost at Qwen3-0.6B's widths), and memory holds one prepared
    copy, not two."""
    from roundalign.kernels import vllm_cpu

    cache = module.__dict__.setdefault("_roundalign_gemm_cache", {})
    hit = cache.get(key)
    if hit is None or not (_holds(hit[0], weights) and (hit[1] is None) == (not biases)
                           and (not biases or _holds(hit[1], biases))):  # fmt: skip
        old = cache.pop(key, (None, None, None))
        del hit
        with torch.no_grad():
            fused = _concat(weights, old[0])
            bias = _concat(biases, old[1]) if biases else None
        del old  # vLLM's old prepared weights go here, before it prepares the new ones
        hit = cache[key] = (fused, bias, vllm_cpu.linear(fused, bias))
    return hit[0], hit[2]


def _concat(parts, into: torch.Tensor | None) -> torch.Tensor:
    """``torch.cat(parts)``, written into ``into`` where it has the result's shape and dtype (no fresh pages)."""
    parts = [p.detach() for p in parts]
    rows = sum(p.shape[0] for p in parts)
    if into is None or into.shape != (rows, *parts[0].shape[1:]) or into.dtype != parts[0].dtype:
        return torch.cat(parts)
    return torch.cat(parts, out=into)


def _holds(fused: torch.Tensor, parts) -> bool:
    """Whether ``fused`` is ``torch.cat(parts)`` bit for bit, compared part by part against its rows (no
    concatenation). Bits rather than ``torch.equal``'s values: the same verdict except that +0 and -0 differ (the
    GEMM is prepared again, as for any change) and a NaN equals itself (the same bits the GEMM was prepared on)."""
    if fused.shape[0] != sum(p.shape[0] for p in parts) or fused.shape[1:] != parts[0].shape[1:]:
        return False
    start = 0
    for part in parts:
        rows = fused[start : start + part.shape[0]]
        start += part.shape[0]
        if part.dtype != fused.dtype or not _same_bits(rows, part.detach()):
            return False
    return True


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` (one dtype and shape) hold the same bits: compared as the widest integers their bytes allow,
    which is several times faster than ``torch.equal`` on bf16 values (0.07 ms against 0.6 ms for a 1536 x 256
    weight on one core)."""
    if a.shape != b.shape:
        return False
    if not (a.is_contiguous() and b.is_contiguous()) or a.dtype.is_complex or a.dtype == torch.bool:
        return torch.equal(a, b)
    a, b = a.reshape(-1), b.reshape(-1)
    for wide in (torch.int64, torch.int32, torch.int16, torch.uint8):
        if wide.itemsize < a.element_size():
            break
        try:
            return torch.equal(a.view(wide), b.view(wide))
        except RuntimeError:  # size or storage offset not a multiple of the wider type's
            continue
    return torch.equal(a, b)


def _plain_linears(module, names) -> list:
    mods = [getattr(module, n) for n in names]
    odd = [f"{n} ({type(m).__name__})" for n, m in zip(names, mods, strict=True) if type(m) not in _PLAIN]
    if odd:
        raise UserError(
            f"gemm='vllm-cpu' runs vLLM's GEMM on plain nn.Linear weights; {', '.join(odd)} is not one (an adapter or "
            "a quantized layer?). Merge adapters first (peft's merge_and_unload), or use gemm='torch'"
        )
    return mods


def project(module, names: tuple[str, ...], x: torch.Tensor, gemm: GemmKernel, pad_to: int = 1) -> list:
    """``[module.<name>(x) for name in names]``, computed as one GEMM of the engine's when ``gemm`` is one.

    ``pad_to``: zero rows appended to the fused weight up to a multiple of it, and dropped from the output (vLLM's
    padded lm_head)."""
    if gemm is GemmKernel.TORCH:
        return [getattr(module, n)(x) for n in names]
    if gemm is GemmKernel.REFERENCE:
        return [_rowwise(m, x) for m in _plain_linears(module, names)]
    mods = _plain_linears(module, names)
    low = low_dtype(x)
    weights = [engine_weight(m.weight, low) for m in mods]
    biases = [engine_weight(m.bias, low) for m in mods if m.bias is not None]
    if biases and len(biases) != len(mods):
        raise UserError(f"{', '.join(names)}: some have a bias and some not; vLLM fuses them only when all or none do")
    pad = -sum(w.shape[0] for w in weights) % pad_to
    if pad:
        weights.append(weights[0].new_zeros(pad, weights[0].shape[1]))
        if biases:
            biases.append(biases[0].new_zeros(pad))
    fused, run = _gemm_for(module, ",".join(names), weights, biases)
    out = _EngineLinear.apply(x.to(low), run, fused, len(weights), *weights, *biases)
    if len(mods) == 1:
        return [out[..., : weights[0].shape[0]] if pad else out]
    # Each projection's columns as their own tensor, as separate linears give them: the ops downstream (the q/k
    # norms, SwiGLU) would otherwise copy the strided column slices themselves, in the forward and again from the
    # slices they saved in the backward. A copy changes no value.
    return [t.contiguous() for t in out.split([w.shape[0] for w in weights], dim=-1)[: len(mods)]]


def _rowwise(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)`` with one GEMM call per row, as the reference engine computes a decode step's row (each row
    64-byte aligned, as the engine's own rows are); torch's linear gradients."""
    from roundalign.engine.attention import own_rows

    low = low_dtype(x)
    weight = engine_weight(linear.weight, low)
    bias = [] if linear.bias is None else [engine_weight(linear.bias, low)]

    def run(rows: torch.Tensor) -> torch.Tensor:
        return torch.cat([F.linear(own_rows(rows[i : i + 1]), weight, *bias) for i in range(rows.shape[0])])

    return _EngineLinear.apply(x.to(low), run, None, 1, weight, *bias)


class EngineLMHead(torch.nn.Linear):
    """The lm_head as the engine computes it: ``apply`` swaps the class of ``model.lm_head`` to this one (and sets
    ``_roundalign_gemm``); ``revert`` puts ``nn.Linear`` back."""

    _roundalign_hf_class = torch.nn.Linear
    _roundalign_gemm = GemmKernel.TORCH

    def forward(self, hidden_states):
        from roundalign.kernels import vllm_cpu

        pad = vllm_cpu.LM_HEAD_PADDING if self._roundalign_gemm is GemmKernel.VLLM_CPU else 1
        return project(_Named(self), ("lm_head",), hidden_states, self._roundalign_gemm, pad)[0]


class _Named:
    """A lone linear addressed by name, as ``project`` addresses a module's projections; the GEMM cache stays on
    the linear itself."""

    def __init__(self, linear: torch.nn.Linear):
        self.lm_head = linear
        self.__dict__["_roundalign_gemm_cache"] = linear.__dict__.setdefault("_roundalign_gemm_cache", {})


_PLAIN = (torch.nn.Linear, EngineLMHead)
