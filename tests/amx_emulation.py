"""vLLM with an emulated AMX weight-packed GEMM, and the exact trainer beside it (tests/test_amx_emulation.py).

On an Intel AMX CPU vLLM 0.32's GEMM dispatch gives small bf16 weights its weight-packed GEMM
(``weight_packed_linear``, from sgl-kernel), whose rows depend on the call's row count: a call of up to 4 rows runs
an AVX-512 kernel that starts its fp32 accumulator from the bias and sums K in pairs, a larger one AMX tiles with the
bias added after (csrc/cpu/sgl-kernels/gemm.cpp). No AMX machine is at hand, so this script makes vLLM's dispatch
pick a stand-in with that structure, exaggerated: up to 4 rows, each row's fp32 dot products with the bias first;
5 rows and more, each row's two halves of K summed apart, rounded to bf16, then added, bias last. Each path
computes a row alike wherever it sits in the call, as the real kernel's paths do. The stand-in is an opaque op, as
the real one is to a compiled graph.

Then a real vLLM (in this process, ``--enforce-eager`` or its compiled mode) samples, and the trainer with the
build's exact profile, in the same process (so the same stand-in), scores the same tokens. ``ROWS`` requests decode
together: 8 keeps every decode step above 4 rows, 2 puts every step on the small-row path.

    python tests/amx_emulation.py MODEL_DIR eager|compiled ROWS OUT.pt
"""

from __future__ import annotations

import os
import sys

import torch

SMALL_ROWS = 4  # up to this many rows the real kernel takes its AVX-512 path (gemm.cpp: M > 4 uses brgemm)


@torch.library.custom_op("roundalign_test::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The emulated weight-packed GEMM (module docstring): ``x (M, K) @ weight (N, K)^T + bias``, bf16 out."""
    w = weight.float()
    b = torch.zeros(w.shape[0]) if bias is None else bias.float()
    rows = []
    for row in x.float().split(1):  # one row at a time: a row is computed alike wherever it sits in the call
        if x.shape[0] <= SMALL_ROWS:
            rows.append(torch.addmm(b[None], row, w.t()))
        else:
            k = w.shape[1] // 2
            halves = (row[:, :k] @ w[:, :k].t(), row[:, k:] @ w[:, k:].t())
            rows.append(sum(h.to(torch.bfloat16).float() for h in halves) + b)
    return torch.cat(rows).to(x.dtype)


@packed_linear.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


def install() -> None:
    """vLLM's dispatch gives every bf16 linear the stand-in, as its AMX branch does (the packed weight is what the
    layer's ``cpu_linear`` closes over, the bias in fp32), so that vLLM's model and the trainer's kernels call it."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm

    def weight_packed_linear_cpu(x, packed_weight, n, bias):
        return packed_linear(x.reshape(-1, x.shape[-1]), packed_weight, bias).view(*x.shape[:-1], n)

    def dispatch(layer, remove_weight):
        if layer.weight.is_meta or layer.weight.ndim != 2 or layer.weight.dtype != torch.bfloat16:
            return original(layer, remove_weight)
        packed_weight, N = layer.weight.detach().clone(), layer.weight.shape[0]  # noqa: N806 (vLLM's names)
        if getattr(layer, "bias", None) is not None:
            layer.bias.data = layer.bias.to(torch.float32)
        layer.cpu_linear = lambda x, weight, bias: ops.weight_packed_linear_cpu(x, packed_weight, N, bias)

    ops.weight_packed_linear_cpu = weight_packed_linear_cpu
    utils.dispatch_cpu_unquantized_gemm = dispatch


def main(model_dir: str, mode: str, rows: str, out: str) -> None:
    from roundalign.engines.vllm.build import ENVIRONMENT

    for key, value in ENVIRONMENT.items():  # before vLLM is imported, as the engine sets them
        os.environ.setdefault(key, value)
    install()
    import roundalign
    from kernels_trainer import load_model, picked  # this script's folder is on sys.path, as it runs
    from roundalign.engine.sampling import SamplingParams
    from roundalign.engines.vllm.inprocess import VllmEngine
    from roundalign.engines.vllm.profile import trainer_profile
    from roundalign.kernels import vllm_cpu

    eager = mode == "eager"
    engine = VllmEngine(model_dir, enforce_eager=eager, seed=0, dtype=torch.bfloat16)
    prompts = [[1 + (7 * i + j) % 200 for j in range(5 + 3 * i)] for i in range(int(rows))]
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=0, ignore_eos=True)
    rollouts = engine.generate(prompts, params)
    prefill = engine.score([r.prompt_token_ids for r in rollouts], [r.token_ids for r in rollouts])
    model = load_model(model_dir).eval()
    profile = trainer_profile(enforce_eager=eager)
    roundalign.apply(model, profile)
    mine = []
    with torch.no_grad():
        for r in rollouts:
            logits = model(input_ids=torch.tensor([r.prompt_token_ids + r.token_ids])).logits[0]
            mine.append(picked(logits[len(r.prompt_token_ids) - 1 : -1], r.token_ids))
    kind = vllm_cpu.linear(torch.zeros(64, 64, dtype=torch.bfloat16), None).graph.kind
    torch.save({"profile": profile, "gemm": kind, "trainer": mine, "prefill": prefill,
                "sampler": [torch.tensor(r.logprobs) for r in rollouts]}, out)  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:5])
