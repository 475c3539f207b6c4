"""The in-place reload of a quantized vLLM, for tests/test_quant_vllm.py. Runs in the engine's Python.

    python tests/quant_reload.py MODEL_DIR SCHEME WORK_DIR [SYNC]

Starts vLLM on MODEL_DIR's weights served in SCHEME, reloads it in place with perturbed weights
(``engines.vllm.reload``), then with the original ones again, and writes to WORK_DIR/reload.json the prefill
log-probs of two sequences after each step, beside those of a fresh engine started on the perturbed checkpoint.
With SYNC (``stochastic`` or ``error-feedback``) the perturbed weights are an fp32 master exported onto the grid
by that mode (``roundalign.sync.Exporter``): the reload is given the checkpoint's tensors, whose codes differ from
the round-to-nearest ones (``codes_differ``), and the fresh engine loads the checkpoint written from them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def main(model_dir: str, scheme_name: str, work: str, sync: str = "") -> None:
    for key, value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}.items():
        os.environ.setdefault(key, value)
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from roundalign.engines.vllm.reload import reload
    from roundalign.quant import SCHEMES, checkpoint

    scheme, work = SCHEMES[scheme_name], Path(work)
    source = load_file(str(Path(model_dir) / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    moved = {k: (v.float() * (1 + 0.05 * torch.randn(v.shape, generator=g))).bfloat16() for k, v in source.items()}
    if scheme.online:  # vLLM quantizes the bf16 checkpoints itself
        import shutil

        from safetensors.torch import save_file

        for name, weights in (("first", source), ("moved", moved)):
            shutil.copytree(model_dir, work / name)
            save_file({k: v.contiguous() for k, v in weights.items()}, str(work / name / "model.safetensors"))
    elif sync:
        from roundalign.sync import Exporter

        master = {k: v.float() * (1 + 1e-3 * torch.randn(v.shape, generator=g)) for k, v in source.items()}
        moved = Exporter(sync, seed=3, scheme=scheme).export(master)  # the checkpoint's tensors, codes chosen
        nearest = checkpoint.served_state_dict(master, scheme)
        checkpoint.write(model_dir, work / "first", scheme)
        checkpoint.write(model_dir, work / "moved", scheme, state_dict=moved)
    else:
        checkpoint.write(model_dir, work / "first", scheme)
        checkpoint.write(model_dir, work / "moved", scheme, state_dict=moved)
    request = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    prompts = [TokensPrompt(prompt_token_ids=list(range(3, 60))), TokensPrompt(prompt_token_ids=list(range(70, 90)))]

    def logprobs(llm):
        outs = llm.generate(prompts, request, use_tqdm=False)
        return [[next(iter(step.values())).logprob for step in out.prompt_logprobs[1:]] for out in outs]

    def start(path):
        online = {"quantization": scheme.online} if scheme.online else {}
        return LLM(
            model=str(path), dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.3, max_model_len=256,
            **online,
        )  # fmt: skip

    llm = start(work / "first")
    result = {"first": logprobs(llm)}
    reload(llm, moved, scheme)
    result["reloaded"] = logprobs(llm)
    # the audit reads every served weight back: all as exported, and one code off is found, in its fused layer
    from roundalign.engines.vllm.audit import served_mismatches

    result["audit"] = served_mismatches(llm, moved, scheme)
    off = dict(moved)
    key = "model.layers.1.self_attn.k_proj.weight" + ("_packed" if scheme.weights == "int4" and sync else "")
    if scheme.weights == "int4" and sync:
        off[key] = off[key].clone()
        off[key][3, 2] ^= 1  # the lowest bit of one packed 4-bit code
    elif sync:
        off[key] = off[key].clone()
        off[key].view(torch.uint8)[3, 2] ^= 1  # the lowest bit of one code (int8, E4M3)
    else:  # bf16 weights the engine quantizes: a change of several grid steps (a bit of it could round away)
        off[key] = off[key].clone()
        off[key][3, 2] += 0.05
    result["audit_off"] = served_mismatches(llm, off, scheme)[0]
    reload(llm, source, scheme)
    result["back"] = logprobs(llm)
    del llm
    result["fresh"] = logprobs(start(work / "moved"))
    if sync:
        result["codes_differ"] = any(not torch.equal(moved[k], nearest[k]) for k in moved)
    (work / "reload.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:5])
