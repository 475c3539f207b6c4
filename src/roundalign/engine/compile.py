"""torch.compile the way vLLM does by default: one dynamo graph, split at every attention op, each piece compiled
by Inductor on its own (vLLM's ``split_graph`` + ``PiecewiseCompileInterpreter``, vllm/compilation/backends.py).

Every piece between two splitting ops gets its own ``compile_fx`` call, so Inductor must materialize each piece's
outputs (in bf16), while anything that stays inside a piece is the compiler's to fuse, recompute or keep in fp32.
The splitting ops themselves run as they are (opaque custom ops). Identical pieces (the middle decoder layers) have
identical graphs, so Inductor's FX graph cache compiles them once.

``COMPILE_STATS`` counts what the backend compiled in this process (dynamo graphs, pieces, seconds), for the engine
to report and for tests to check that a step does not recompile.
"""

from __future__ import annotations

import time

import torch
from torch.fx.passes.split_module import split_module

COMPILE_STATS = {"graphs": 0, "pieces": 0, "seconds": 0.0}


class _CompilePieces(torch.fx.Interpreter):
    """Runs the split graph on dynamo's fake inputs and compiles each non-splitting piece with Inductor."""

    def __init__(self, module, splitting_pieces, log):
        super().__init__(module)
        self.splitting_pieces = splitting_pieces
        self.log = log

    def call_module(self, target, args, kwargs):
        out = super().call_module(target, args, kwargs)
        if target not in self.splitting_pieces:
            from torch._inductor.compile_fx import compile_fx

            sub = self.fetch_attr(target)
            self.module.__dict__[target] = compile_fx(sub, list(args))
            self.log.append(target)
            COMPILE_STATS["pieces"] += 1
        return out


def piecewise_backend(splitting_ops, log: list | None = None):
    """A torch.compile backend that splits the dynamo graph at every call of one of ``splitting_ops``
    (custom ops, e.g. ``torch.ops.roundalign.unified_attention``) and compiles each other piece with Inductor.
    ``log`` collects the names of the compiled pieces."""
    log = [] if log is None else log
    targets = set()
    for op in splitting_ops:
        targets.add(op)
        targets.add(getattr(op, "default", op))  # the OpOverloadPacket and its default overload

    def backend(gm: torch.fx.GraphModule, example_inputs):
        from torch._guards import detect_fake_mode

        t0 = time.perf_counter()
        piece, assign, splitting_pieces = 0, {}, set()
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            if node.op == "call_function" and node.target in targets:
                piece += 1
                assign[node] = piece
                splitting_pieces.add(f"submod_{piece}")
                piece += 1
            else:
                assign[node] = piece
        split = split_module(gm, None, lambda n: assign[n], keep_original_order=True)
        fake_mode = detect_fake_mode(example_inputs)
        fake_args = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
        with fake_mode:
            _CompilePieces(split, splitting_pieces, log).run(*fake_args)
        COMPILE_STATS["graphs"] += 1
        COMPILE_STATS["seconds"] += time.perf_counter() - t0
        return split

    return backend


def mark_tokens_dynamic(*tensors: torch.Tensor) -> None:
    """Mark dim 0 (the flattened tokens) dynamic, as vLLM compiles one graph for every number of tokens.

    Dynamo specializes sizes 0 and 1, so a caller must not pass a single token: the engine pads a one-token step
    to two rows (the extra row is ignored by attention and dropped before the lm_head).
    """
    for t in tensors:
        torch._dynamo.mark_dynamic(t, 0)
