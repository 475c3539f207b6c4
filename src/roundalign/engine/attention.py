"""The engine's attention: KV cache, per-step metadata, and the attention op both backends call.

A step is one forward over flattened tokens (vLLM's layout): a prefill step holds every prompt of a batch back to
back, a decode step one new token per running sequence. ``Step`` says which rows belong to which sequence and at
which positions; the model code never sees padding. Attention then is

- prefill: per sequence, ``F.scaled_dot_product_attention`` called exactly as HF's sdpa path calls it for one
  unpadded sequence (``causal_attention``), so a one-sequence prefill matches the trainer bit for bit;
- decode: per sequence, its one query row against its own cached keys (``decode_attention``); under the profile's
  ``reference`` attention kernel (``AttentionSpec.rowwise``) prefill rows are computed the same way, one by one,
  so that decode equals prefill bit for bit.

Nothing here lets two sequences share a kernel call. A kernel's result for one row can depend on the shape of the
call it sits in (the number of rows or keys sets a GEMM library's blocking, its choice of kernel and its split of a
reduction over threads), so a sequence computed inside a batch could differ in the last bit from the same sequence
alone. Here each sequence's attention, and its keys and values in the cache, have exactly the shapes, strides and
alignment they have when the sequence runs alone, whatever else is in the batch: decode is batch-invariant by
construction, not because some CPU's kernels happen to be (docs/engine.md, "Batch invariance"). The GEMMs follow the
same rule (``roundalign.engine.gemm``).

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
from itertools import accumulate

import torch
import torch.nn.functional as F

from roundalign import compile_key


@dataclass(frozen=True)
class AttentionSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # Prefill rows too are computed one query row at a time, as a decode step computes its row (the profile's
    # attention kernel ``reference``): decode then equals prefill bit for bit, and so does a trainer that computes
    # the same rows (roundalign.kernels).
    rowwise: bool = False

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5  # HF's self.scaling and vLLM's Attention scale


def own_rows(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a copy when its data does not start on a 64-byte boundary: a kernel may take another path for an
    unaligned operand, and a sequence's rows sit at an offset in a batch that they do not have alone."""
    return x if x.data_ptr() % 64 == 0 else x.clone()


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """Causal GQA attention of one sequence on ``(tokens, heads * head_dim)`` tensors, as HF's sdpa path does it."""
    n, h, kvh, d = q.shape[0], spec.num_heads, spec.num_kv_heads, spec.head_dim
    # HF hands SDPA (1, heads, tokens, head_dim) transposes of contiguous (1, tokens, heads, head_dim) tensors.
    qh = q.reshape(1, n, h, d).transpose(1, 2)
    kh = k.reshape(1, n, kvh, d).transpose(1, 2)
    vh = v.reshape(1, n, kvh, d).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        qh, kh, vh, dropout_p=0.0, scale=spec.scale, is_causal=True, enable_gqa=h != kvh
    )
    return out.transpose(1, 2).contiguous().reshape(n, h * d)


class KVCache:
    """Keys and values per sequence and layer, each its own ``(kv_heads, capacity, head_dim)`` tensor, zero until
    written.

    A sequence's tensors depend on nothing but its own capacity (its prompt + token budget), so its attention reads
    operands of the same shape, strides and alignment in any batch as alone. The values are in the model dtype
    ``dtype`` (RoPE's output, v_proj's output; bf16 or fp16) held in fp32, exactly: the decode attention reads them
    as fp32 matmul operands in place, with no per-step cast (at twice the 16-bit memory; a CPU reference's caches
    are small).
    """

    def __init__(
        self, num_layers: int, capacities: list[int], spec: AttentionSpec, dtype: torch.dtype = torch.bfloat16
    ):
        kvh, d = spec.num_kv_heads, spec.head_dim
        self.k = [[torch.zeros(kvh, cap, d) for _ in range(num_layers)] for cap in capacities]
        self.v = [[torch.zeros(kvh, cap, d) for _ in range(num_layers)] for cap in capacities]
        self.dtype = dtype

    def write(self, layer: int, step: Step, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's keys and values (``(rows, kv_heads * head_dim)``) at their sequences' positions."""
        for seq, start, offset, n in step.groups():
            for cache, x in ((self.k[seq][layer], k), (self.v[seq][layer], v)):
                cache[:, offset : offset + n] = x[start : start + n].view(n, cache.shape[0], -1).transpose(0, 1)

    def rows(self, layer: int, seq: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` positions of a sequence in the model dtype, ``(length, kv_heads * head_dim)``
        (exact)."""
        return tuple(
            c[seq][layer][:, :length].transpose(0, 1).reshape(length, -1).to(self.dtype) for c in (self.k, self.v)
        )


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

    def gemm_rows(self, rows: int) -> list[tuple[int, int]]:
        """(first row, rows) of each GEMM call over a ``rows``-row tensor of this step: one per sequence, and one
        per padding row past ``num_rows`` (added by a compiled backend), so no call holds two sequences' rows."""
        return [*zip(self.starts, self.counts, strict=True), *((r, 1) for r in range(self.num_rows, rows))]


def decode_attention(q: torch.Tensor, k32: torch.Tensor, v32: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """One query row ``(1, heads * head_dim)`` against a sequence's cached keys and values (``(kv_heads, length,
    head_dim)``, fp32 holding 16-bit values). fp32 throughout, rounded once to the model dtype (``q``'s: bf16 or
    fp16) at the output; both sums over keys are matmuls (``softmax(scores) @ v`` as ``(e @ v) / (e @ 1)``).

    The keys and values are copied to fresh contiguous tensors first, so that the matmuls' operands depend on the
    length alone, not on the capacity of the cache they were read from: the same row computed from another cache
    (a prefill, a trainer's rows) gets the same bits."""
    k32, v32 = k32.contiguous(), v32.contiguous()
    kvh, d = spec.num_kv_heads, spec.head_dim
    # GQA: query heads j * group ... (j + 1) * group - 1 read kv head j, as HF's repeat_kv pairs them.
    q32 = q.view(kvh, spec.num_heads // kvh, d).float()  # (kv_heads, group, D)
    scores = q32 @ k32.transpose(-1, -2) * spec.scale  # (kv_heads, group, length)
    e = (scores - scores.amax(dim=-1, keepdim=True)).exp()
    out = (e @ v32) / (e @ e.new_ones(e.shape[-1], 1))
    return out.reshape(1, spec.num_heads * d).to(q.dtype)


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
    elif step.is_prefill and not step.spec.rowwise:
        for _, start, _, n in step.groups():
            rows = slice(start, start + n)
            out[rows] = causal_attention(*(own_rows(t[rows]) for t in (q, k, v)), step.spec)
    else:  # decode, or a row-wise prefill: every row against its sequence's cached keys up to its own position
        cache = step.cache
        for seq, start, offset, n in step.groups():
            k32, v32 = cache.k[seq][layer], cache.v[seq][layer]
            for j in range(n):  # .float() in decode_attention copies the query row
                length = offset + j + 1
                row = start + j
                out[row : row + 1] = decode_attention(q[row : row + 1], k32[:, :length], v32[:, :length], step.spec)
    return out


# --------------------------------------------------------------------------------------------------------------
# the opaque op of the inductor backend, and its forward context

_CONTEXT: list[Step] = []


@contextmanager
def forward_context(step: Step):
    """Make ``step`` what the engine's opaque ops (``roundalign::unified_attention``, ``roundalign::linear``) read
    during one forward."""
    _CONTEXT.append(step)
    try:
        yield
    finally:
        _CONTEXT.pop()


def current_step() -> Step:
    if not _CONTEXT:
        raise RuntimeError("the engine's opaque ops run inside an engine forward only (no forward context)")
    return _CONTEXT[-1]


compile_key.key_compiles()  # graphs that call the op below: keyed on its sources


@torch.library.custom_op("roundalign::unified_attention", mutates_args=())
def unified_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """``attention`` for the current forward context; opaque to the compiler, like vLLM's ``unified_attention``."""
    return attention(layer, q, k, v, current_step())


@unified_attention.register_fake
def _(q, k, v, layer):
    return q.new_empty(q.shape)
