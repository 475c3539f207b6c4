"""The engine's attention: KV cache, per-step metadata, and the attention op both backends call.

A step is one forward over flattened tokens (vLLM's layout): a prefill step holds every prompt of a batch back to
back, a decode step one new token per running sequence. ``Step`` says which rows belong to which sequence and at
which positions; the model code never sees padding. Attention then is

- prefill: per sequence, ``F.scaled_dot_product_attention`` called exactly as HF's sdpa path calls it for one
  unpadded sequence (``causal_attention``), so a one-sequence prefill matches the trainer bit for bit;
- decode: one batched attention over a padded per-slot KV cache, with a mask hiding each slot's unused tail, written
  so that a sequence's result does not depend on the other sequences of the batch (``_decode_attention``).

The ``inductor`` backend calls it through ``roundalign::unified_attention``, an opaque ``torch.library`` op that
stands in for vLLM's ``unified_attention``: the piecewise compiler splits the graph there, and the op reads its
metadata and KV cache from the forward context (``forward_context``), not from its arguments, as vLLM's does.

``PrefillShapes`` serves the decode-shape attribution (``Engine.score(..., prefill_shaped=...)``): it computes
attention, or every linear, over the sequence's full-length rows (zeros past the current token) and keeps the
current row, so that part of a decode step has exactly the shapes of the one-sequence prefill.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5  # HF's self.scaling and vLLM's Attention scale


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """Causal GQA attention of one sequence on ``(tokens, heads * head_dim)`` tensors, as HF's sdpa path does it."""
    n, h, kvh, d = q.shape[0], spec.num_heads, spec.num_kv_heads, spec.head_dim
    # HF hands SDPA (1, heads, tokens, head_dim) transposes of contiguous (1, tokens, heads, head_dim) tensors.
    qh = q.reshape(1, n, h, d).transpose(1, 2)
    kh = k.reshape(1, n, kvh, d).transpose(1, 2)
    vh = v.reshape(1, n, kvh, d).transpose(1, 2)
    out = F.scaled_dot_product_attention(qh, kh, vh, dropout_p=0.0, scale=spec.scale, is_causal=True,
                                         enable_gqa=h != kvh)
    return out.transpose(1, 2).contiguous().reshape(n, h * d)


class KVCache:
    """Per layer and sequence slot, keys and values as ``(kv_heads, capacity, head_dim)``, zero until written.

    The values are in the model dtype ``dtype`` (RoPE's output, v_proj's output; bf16 or fp16) held in fp32,
    exactly: the decode attention reads them as fp32 matmul operands in place, with no per-step copy or cast (at twice
    the 16-bit memory; a CPU reference's caches are small).
    """

    def __init__(self, num_layers: int, num_slots: int, capacity: int, spec: AttentionSpec,
                 dtype: torch.dtype = torch.bfloat16):
        shape = (num_layers, num_slots, spec.num_kv_heads, capacity, spec.head_dim)
        self.k = torch.zeros(shape)
        self.v = torch.zeros(shape)
        self.dtype = dtype

    def write(self, layer: int, step: Step, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's keys and values (``(rows, kv_heads * head_dim)``) at their sequences' positions."""
        kvh = self.k.shape[2]
        if step.is_prefill:
            for seq, start, offset, n in step.groups():
                self.k[layer, seq, :, offset : offset + n] = k[start : start + n].view(n, kvh, -1).transpose(0, 1)
                self.v[layer, seq, :, offset : offset + n] = v[start : start + n].view(n, kvh, -1).transpose(0, 1)
        else:
            b = len(step.seqs)
            self.k[layer, step._slots, :, step._positions] = k[:b].view(b, kvh, -1).float()
            self.v[layer, step._slots, :, step._positions] = v[:b].view(b, kvh, -1).float()

    def rows(self, layer: int, seq: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` positions of a slot in the model dtype, ``(length, kv_heads * head_dim)`` (exact)."""
        k, v = self.k[layer, seq, :, :length], self.v[layer, seq, :, :length]
        return tuple(t.transpose(0, 1).reshape(length, -1).to(self.dtype) for t in (k, v))


class PrefillShapes:
    """Per-sequence buffers of ``full_lengths[seq]`` rows, for computing a part as the one-sequence prefill would."""

    PARTS = ("attention", "matmul")

    def __init__(self, parts, full_lengths: list[int]):
        self.parts = frozenset(parts)
        self.full_lengths = full_lengths
        self._buffers: dict = {}

    def rows(self, seq: int, key, x: torch.Tensor, offset: int) -> torch.Tensor:
        """Write ``x`` at rows ``offset...`` of the sequence's buffer for ``key``; return the whole buffer."""
        buf = self._buffers.get((seq, key))
        if buf is None:
            buf = self._buffers[(seq, key)] = x.new_zeros(self.full_lengths[seq], x.shape[1])
        buf[offset : offset + x.shape[0]] = x
        return buf

    def linear(self, key, x: torch.Tensor, weight: torch.Tensor, bias, groups) -> torch.Tensor:
        """``F.linear`` of each sequence's full-length rows; keeps the rows of this step."""
        out = x.new_empty(x.shape[0], weight.shape[0])
        for seq, start, offset, n in groups:
            full = F.linear(self.rows(seq, key, x[start : start + n], offset), weight, bias)
            out[start : start + n] = full[offset : offset + n]
        return out


@dataclass
class Step:
    """One forward: sequence ``seqs[j]`` (its cache slot) owns rows ``starts[j] : starts[j] + counts[j]`` of the
    flattened batch, at positions ``offsets[j] ...``. Prefill: every prompt from position 0; decode: one row each."""

    seqs: list[int]
    starts: list[int]
    counts: list[int]
    offsets: list[int]
    is_prefill: bool
    cache: KVCache
    spec: AttentionSpec
    shapes: PrefillShapes | None = None
    num_rows: int = field(init=False)

    def __post_init__(self):
        self.num_rows = sum(self.counts)

    @classmethod
    def prefill(cls, lengths: list[int], cache: KVCache, spec: AttentionSpec, shapes=None) -> Step:
        starts = [0, *accumulate(lengths)][:-1]
        return cls(list(range(len(lengths))), starts, list(lengths), [0] * len(lengths), True, cache, spec, shapes)

    @classmethod
    def decode(cls, seqs: list[int], positions: list[int], cache: KVCache, spec: AttentionSpec, shapes=None) -> Step:
        n = len(seqs)
        return cls(list(seqs), list(range(n)), [1] * n, list(positions), False, cache, spec, shapes)

    def groups(self):
        """(seq, first row, first position, rows) per sequence."""
        return zip(self.seqs, self.starts, self.offsets, self.counts, strict=True)

    def positions(self) -> torch.Tensor:
        return torch.cat([torch.arange(o, o + n) for o, n in zip(self.offsets, self.counts, strict=True)])

    def last_rows(self) -> list[int]:
        return [s + n - 1 for s, n in zip(self.starts, self.counts, strict=True)]

    def last_groups(self):
        """``groups`` for a tensor holding only each sequence's last row (the rows the lm_head reads)."""
        return [(seq, j, o + n - 1, 1) for j, (seq, _, o, n) in enumerate(self.groups())]

    # decode metadata, built once per step and shared by every layer
    @cached_property
    def _slots(self) -> torch.Tensor:
        return torch.tensor(self.seqs)

    @cached_property
    def _positions(self) -> torch.Tensor:
        return torch.tensor(self.offsets)

    @cached_property
    def _contiguous(self) -> bool:
        return self.seqs == list(range(len(self.seqs)))  # a view of the cache, no gather

    @cached_property
    def _mask(self) -> torch.Tensor:
        """(B, 1, 1, L): 0 where a key is valid, -inf where it is padding (added to the attention scores)."""
        lengths = self._positions + 1
        valid = torch.arange(int(lengths.max()))[None] < lengths[:, None]
        return torch.zeros(valid.shape).masked_fill(~valid, float("-inf"))[:, None, None]

    @cached_property
    def _ones(self) -> torch.Tensor:
        return torch.ones(self._mask.shape[-1], 1)


def _decode_attention(layer: int, q: torch.Tensor, step: Step) -> torch.Tensor:
    """One query row per sequence against its cached keys, batched over sequences and written so that a sequence's
    result does not depend on the batch: a cache slot is padded to the longest sequence of the step, and every
    reduction over keys is a matmul, which adds the padded keys' exact zeros after the real terms (a row reduction
    such as ``sum`` or SDPA's fused softmax regroups its terms with the padded length; measured on this CPU). fp32
    throughout, rounded once to the model dtype (``q``'s: bf16 or fp16) at the output."""
    spec, cache, mask = step.spec, step.cache, step._mask
    b, length, d, kvh = len(step.seqs), mask.shape[-1], spec.head_dim, spec.num_kv_heads
    if step._contiguous:
        k32, v32 = cache.k[layer, :b, :, :length], cache.v[layer, :b, :, :length]  # (B, kv_heads, L, D) views
    else:
        k32, v32 = cache.k[layer][step._slots, :, :length], cache.v[layer][step._slots, :, :length]
    # GQA: query heads j * group ... (j + 1) * group - 1 read kv head j, as HF's repeat_kv pairs them.
    q32 = q[:b].view(b, kvh, spec.num_heads // kvh, d).float()  # (B, kv_heads, group, D)
    scores = q32 @ k32.transpose(-1, -2) * spec.scale + mask  # (B, kv_heads, group, L)
    e = (scores - scores.amax(dim=-1, keepdim=True)).exp()  # exactly 0 at masked keys
    out = (e @ v32) / (e @ step._ones)  # softmax(scores) @ v, both sums as matmuls
    return out.reshape(b, spec.num_heads * d).to(q.dtype)


def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
    """Attention of every row of ``step`` (q/k/v after RoPE, ``(rows, heads * head_dim)``); writes the KV cache.

    Rows past ``step.num_rows`` (padding added by a compiled backend) get zeros and touch no cache slot.
    """
    step.cache.write(layer, step, k, v)
    out = q.new_zeros(q.shape[0], step.spec.num_heads * step.spec.head_dim)
    if step.shapes is not None and "attention" in step.shapes.parts:
        for seq, start, offset, n in step.groups():
            qbuf = step.shapes.rows(seq, ("q", layer), q[start : start + n], offset)
            # The sequence's full length; cache rows past the current token are zeros.
            full = causal_attention(qbuf, *step.cache.rows(layer, seq, qbuf.shape[0]), step.spec)
            out[start : start + n] = full[offset : offset + n]
    elif step.is_prefill:
        for _, start, _, n in step.groups():
            rows = slice(start, start + n)
            out[rows] = causal_attention(q[rows], k[rows], v[rows], step.spec)
    else:
        out[: len(step.seqs)] = _decode_attention(layer, q, step)
    return out


# --------------------------------------------------------------------------------------------------------------
# the opaque op of the inductor backend, and its forward context

_CONTEXT: list[Step] = []


@contextmanager
def forward_context(step: Step):
    """Make ``step`` what ``roundalign::unified_attention`` reads during one forward."""
    _CONTEXT.append(step)
    try:
        yield
    finally:
        _CONTEXT.pop()


@torch.library.custom_op("roundalign::unified_attention", mutates_args=())
def unified_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """``attention`` for the current forward context; opaque to the compiler, like vLLM's ``unified_attention``."""
    if not _CONTEXT:
        raise RuntimeError("roundalign::unified_attention runs inside an engine forward only (no forward context)")
    return attention(layer, q, k, v, _CONTEXT[-1])


@unified_attention.register_fake
def _(q, k, v, layer):
    return q.new_empty(q.shape)
