"""The vLLM side of ``roundalign dump``: sample with a real vLLM, then score the same sequences again in prefill.

Runs inside the engine's Python. Two passes on one ``LLM``:

1. ``generate`` with ``SamplingParams(logprobs=0)``: the sampled token's log-prob at every step, as the sampler
   returns it to an RL framework (``logprobs_mode="raw_logprobs"``: before temperature and top-p, the quantity a
   trainer's ``log_softmax`` computes).
2. Each prompt + completion sent back as a prompt with ``prompt_logprobs=0`` and ``max_tokens=1``: the log-prob of
   every completion token from one prefill forward.

Read against vLLM 0.32 (``vllm/entrypoints/llm.py`` ``LLM``, ``vllm/sampling_params.py``).
"""

from __future__ import annotations

import os
import time

from roundalign.engines import failure
from roundalign.engines.vllm.build import ENVIRONMENT, engine_info
from roundalign.rollouts.record import Rollout


def _params(**kw):
    from vllm import SamplingParams

    return SamplingParams(**kw)


def run(cfg, log=print) -> tuple[list[Rollout], list[list[float]], dict]:
    """Sample ``cfg.num_samples`` completions and score them in prefill. Returns (rollouts, prefill, info)."""
    for key, value in ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    t0 = time.perf_counter()
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    online = None
    if cfg.quantization:
        from roundalign.quant import Scheme

        online = Scheme.parse(cfg.quantization).online  # vLLM quantizes the bf16 weights itself at load
    llm = LLM(
        model=cfg.model,
        **({"quantization": online} if online else {}),
        dtype="bfloat16",
        logprobs_mode="raw_logprobs",
        max_model_len=cfg.max_model_len,
        enforce_eager=cfg.enforce_eager,
        seed=cfg.seed,
        gpu_memory_utilization=cfg.memory_fraction,
    )
    failure.capture()  # after the engine applied its logging configuration, which replaces the loggers' handlers
    started = time.perf_counter()
    log(f"vllm engine started in {started - t0:.1f} s")
    prompts = cfg.prompt_ids(llm.get_tokenizer())
    sampling = _params(
        n=1,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_tokens=cfg.max_tokens,
        seed=cfg.seed,
        logprobs=0,
        ignore_eos=cfg.ignore_eos,
    )
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
    rollouts = []
    for out in outs:
        c = out.outputs[0]
        ids = list(c.token_ids)
        lps = [float(step[tok].logprob) for step, tok in zip(c.logprobs, ids, strict=True)]
        rollouts.append(Rollout(list(out.prompt_token_ids), ids, lps, c.finish_reason))
    sampled = time.perf_counter()
    tokens = sum(len(r.token_ids) for r in rollouts)
    log(f"sampled {len(rollouts)} completions, {tokens} tokens, in {sampled - started:.1f} s")
    # Prefill: prompt_logprobs[j] is the log-prob of position j's token given positions < j (None at j = 0).
    score = _params(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    seqs = [r.prompt_token_ids + r.token_ids for r in rollouts]
    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], score, use_tqdm=False)
    prefill = []
    for r, out in zip(rollouts, outs, strict=True):
        n = len(r.prompt_token_ids)
        steps = out.prompt_logprobs[n:]
        prefill.append([float(step[tok].logprob) for step, tok in zip(steps, r.token_ids, strict=True)])
    done = time.perf_counter()
    log(f"scored them in prefill in {done - sampled:.1f} s")
    info = engine_info(llm, cfg.enforce_eager)
    info["timings_s"] = {
        "engine_start": round(started - t0, 2),
        "sample": round(sampled - started, 2),
        "prefill": round(done - sampled, 2),
    }
    return rollouts, prefill, info
