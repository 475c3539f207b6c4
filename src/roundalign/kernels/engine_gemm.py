"""The engine's GEMMs in the trainer's forward, as one fused call per fused weight, with a standard linear's gradients.

``project`` computes a module's named projections (q/k/v, gate/up, down, o) as the profile's GEMM kernel does
(``Profile.gemm``): ``torch`` (each ``nn.Linear`` as it is), ``vllm-cpu`` (vLLM's CPU GEMM dispatch on the weights
vLLM fuses, prepared once and kept while the weights hold the same values, as vLLM prepares its weights once per
load) or ``reference`` (one GEMM call per row, as the reference engine's decode). ``EngineLMHead`` is the lm_head
as one of those GEMMs (vLLM pads its rows to a multiple of 64). The kernels have no backward: ``_EngineLinear``
gives torch's linear gradients at the same inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from roundalign.errors import UserError
from roundalign.kernels.autocast import no_autocast
from roundalign.mixed_precision import engine_weight, low_dtype
from roundalign.profiles import GemmKernel


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
        with no_autocast(x):
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
    instead of faulting in fresh pages (which the kernel zeroes on first touch), and memory holds one prepared copy,
    not two."""
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
    which is cheaper than ``torch.equal`` on bf16 values (a comparison that runs on every forward)."""
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


def _linear_class(module) -> type:
    """``module``'s class, or the class FSDP2 wrapped: ``fully_shard`` swaps a module's class to a subclass of
    ``(FSDPModule, cls)`` named ``FSDP<cls>``, and a sharded lm_head (verl shards it as its own unit) is still a
    plain linear whose weight FSDP gathers before the forward."""
    cls = type(module)
    bases = cls.__bases__
    if len(bases) == 2 and bases[0].__name__ == "FSDPModule" and cls.__name__ == f"FSDP{bases[1].__name__}":
        return bases[1]
    return cls


def _plain_linears(module, names) -> list:
    mods = [getattr(module, n) for n in names]
    odd = [f"{n} ({type(m).__name__})" for n, m in zip(names, mods, strict=True) if _linear_class(m) not in _PLAIN]
    if odd:
        raise UserError(
            f"gemm='vllm-cpu' runs vLLM's GEMM on plain nn.Linear weights; {', '.join(odd)} is not one (an adapter or "
            "a quantized layer?). Merge adapters first (peft's merge_and_unload), or use gemm='torch'"
        )
    return mods


def fused_parts(module, names: tuple[str, ...], x: torch.Tensor, low: torch.dtype | None = None):
    """What one fused engine GEMM of ``module``'s projections ``names`` reads: ``(linears, 16-bit dtype, their
    weights, their biases)`` in the engine's dtype (``low``, else ``x``'s 16-bit dtype); vLLM fuses layers only when
    all or none have a bias."""
    mods = _plain_linears(module, names)
    low = low or low_dtype(x)
    weights = [engine_weight(m.weight, low) for m in mods]
    biases = [engine_weight(m.bias, low) for m in mods if m.bias is not None]
    if biases and len(biases) != len(mods):
        raise UserError(f"{', '.join(names)}: some have a bias and some not; vLLM fuses them only when all or none do")
    return mods, low, weights, biases


def project(module, names: tuple[str, ...], x: torch.Tensor, gemm: GemmKernel, pad_to: int = 1) -> list:
    """``[module.<name>(x) for name in names]``, computed as one GEMM of the engine's when ``gemm`` is one.

    ``pad_to``: zero rows appended to the fused weight up to a multiple of it, and dropped from the output (vLLM's
    padded lm_head)."""
    if gemm is GemmKernel.TORCH:
        return [getattr(module, n)(x) for n in names]
    if gemm is GemmKernel.REFERENCE:
        return [_rowwise(m, x) for m in _plain_linears(module, names)]
    mods, low, weights, biases = fused_parts(module, names, x)
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


def fused_gemm(module, names: tuple[str, ...], low: torch.dtype):
    """vLLM's prepared GEMM (``vllm_cpu.PreparedGemm``) of ``module``'s projections ``names`` in ``low``: the one
    ``project`` computes them with, prepared once per weight change and shared with it (the compiled forward's)."""
    _, _, weights, biases = fused_parts(module, names, None, low)
    return _gemm_for(module, ",".join(names), weights, biases)[1]


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
