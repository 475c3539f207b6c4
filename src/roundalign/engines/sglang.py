"""Sample with a real SGLang, score the same sequences again in prefill: the SGLang side of ``roundalign dump``.

NOT RUN by roundalign's authors: SGLang has no CPU build that runs here. Written from SGLang's source (read at
``python/sglang/srt/entrypoints/engine.py`` ``Engine.generate``; ``managers/scheduler_output_processor_mixin.py``,
where a regular request's ``input_token_logprobs`` get ``None`` at position 0; ``layers/sampler.py``, whose returned
log-probs are taken after temperature and top-p). A wrong assumption fails loudly: every returned token id is
checked against the sequence it should score.

1. ``Engine.generate(input_ids=..., return_logprob=True)``: ``meta_info["output_token_logprobs"]`` holds one
   ``(logprob, token_id, text)`` per sampled token.
2. The prompt + completion sent back with ``max_new_tokens=1``, ``return_logprob=True`` and
   ``logprob_start_len=0``: ``meta_info["input_token_logprobs"][j]`` is the log-prob of token ``j`` given the
   tokens before it (``None`` at ``j = 0``).

SGLang returns *processed* log-probs (after temperature and top-p), so the dump samples at temperature 1 with
top-p 1, where processed equals raw (``roundalign dump`` refuses other settings for SGLang).
"""

from __future__ import annotations

import time

from roundalign.engines.host import cpu_model
from roundalign.rollouts.record import Rollout


def _checked(steps, expected: list[int], what: str) -> list[float]:
    got = [int(t) for _, t, *_ in steps]
    if got != list(expected):
        raise RuntimeError(
            f"SGLang's {what} returned token ids {got[:8]}... for {list(expected)[:8]}...: its logprob layout is "
            "not the one this dump was written for (see roundalign/engines/sglang.py)"
        )
    return [float(lp) for lp, *_ in steps]


def run(cfg, log=print) -> tuple[list[Rollout], list[list[float]], dict]:
    t0 = time.perf_counter()
    import sglang as sgl
    import torch

    kwargs = {"model_path": cfg.model, "dtype": "bfloat16", "random_seed": cfg.seed}
    if cfg.max_model_len:
        kwargs["context_length"] = cfg.max_model_len
    if cfg.memory_fraction:
        kwargs["mem_fraction_static"] = cfg.memory_fraction
    llm = sgl.Engine(**kwargs)
    try:
        started = time.perf_counter()
        log(f"sglang engine started in {started - t0:.1f} s")
        prompts = cfg.prompt_ids(llm.tokenizer_manager.tokenizer)
        params = {
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "top_k": -1,
            "min_p": 0.0,
            "max_new_tokens": cfg.max_tokens,
            "ignore_eos": cfg.ignore_eos,
        }
        outs = llm.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        rollouts = []
        for ids, out in zip(prompts, outs, strict=True):
            steps = out["meta_info"]["output_token_logprobs"]
            tokens = [int(t) for _, t, *_ in steps]
            finish = (out["meta_info"].get("finish_reason") or {}).get("type")
            rollouts.append(Rollout(list(ids), tokens, _checked(steps, tokens, "sampler"), finish))
        sampled = time.perf_counter()
        seqs = [r.prompt_token_ids + r.token_ids for r in rollouts]
        outs = llm.generate(
            input_ids=seqs,
            sampling_params={"temperature": 1.0, "max_new_tokens": 1},
            return_logprob=True,
            logprob_start_len=0,
        )
        prefill = []
        for r, out in zip(rollouts, outs, strict=True):
            steps = out["meta_info"]["input_token_logprobs"][len(r.prompt_token_ids) :]
            prefill.append(_checked(steps, r.token_ids, "prompt log-probs"))
        done = time.perf_counter()
    finally:
        llm.shutdown()
    info = {
        "engine": "sglang",
        "engine_version": sgl.__version__,
        "torch_version": torch.__version__,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cpu": cpu_model(),
        "enforce_eager": None,
        "logprobs_mode": "processed (temperature 1, top-p 1: equal to raw)",
        "not_run_by_roundalign": True,
        "timings_s": {
            "engine_start": round(started - t0, 2),
            "sample": round(sampled - started, 2),
            "prefill": round(done - sampled, 2),
        },
    }
    return rollouts, prefill, info
