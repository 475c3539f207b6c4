"""The real vLLM as ``roundalign train``'s rollout engine (``--engine vllm``), in the trainer's own process.

``VllmEngine`` answers the calls the GRPO loop makes of the reference engine (``generate``, ``score``,
``load_weights``, ``tokenizer``) with a real ``vllm.LLM``: vLLM samples the rollouts and returns its log-probs
(``logprobs_mode="processed_logprobs"``: after temperature and top-p, as verl takes them), and after every step the
trainer's weights go into it by vLLM's own in-place reload (``reload_weights``, which re-runs each layer's
post-load processing, e.g. the CPU GEMM's weight packing), followed by a prefix-cache reset so that no KV block
computed with the old weights is reused.

One process, as TRL's colocated vLLM mode runs: ``roundalign train --engine vllm`` must run where vLLM is installed
(``make vllm`` builds .venv-vllm), which is also where the trainer can run vLLM's kernels. With ``--trainer-profile
engine`` (the default) the trainer takes the build's ``-kernels`` profile (``engines.vllm.profile``), so that its
log-probs are the sampler's bit for bit in ``--enforce-eager`` mode (docs/kernels.md).

Sampling is reproducible: each request gets its own seed, derived from the step's seed and its index as the
reference engine derives its generators (so a group's completions differ). Written against vLLM 0.32
(``vllm/entrypoints/llm.py``: ``LLM.generate``, ``collective_rpc``, ``reset_prefix_cache``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from roundalign.engine.loader import read_tokenizer
from roundalign.engine.sampling import SamplingParams, request_seeds
from roundalign.engines import failure
from roundalign.engines.vllm.build import ENVIRONMENT, engine_info, installed_version
from roundalign.errors import Failure, UserError
from roundalign.rollouts import Rollout

# The engine fails inside a training run: what was saved is intact (checkpoints are written whole).
RESUME = "; the run continues from its last checkpoint with roundalign train --resume DIR"


class VllmEngine:
    """``vllm.LLM`` behind the reference engine's interface, for the GRPO loop (rl/loop.py)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        enforce_eager: bool,
        seed: int,
        dtype: torch.dtype,
        quantization: str | None = None,
        served_dir: str | Path | None = None,
    ):
        if dtype != torch.bfloat16:
            raise UserError("--engine vllm serves bfloat16 (the CPU build's dtype here); drop --dtype")
        installed_version()
        from roundalign.quant import Scheme

        # A quantized engine serves the checkpoint written to served_dir (or quantizes the bf16 model itself, for
        # an online scheme); every load_weights quantizes the new weights and reloads them in place.
        self.scheme = Scheme.parse(quantization) if quantization else None
        if self.scheme is not None:
            self.scheme.check_vllm_cpu()
        serve, online = Path(model_dir), {}
        if self.scheme is not None and self.scheme.online:
            online = {"quantization": self.scheme.online}
        elif self.scheme is not None:
            from roundalign.quant import checkpoint

            if served_dir is None:
                raise UserError("a quantized VllmEngine needs served_dir, where its checkpoint is written")
            serve = checkpoint.write(model_dir, served_dir, self.scheme)
        # As a dump sets it, before vLLM is imported: the engine core in this process (here so that the trainer can
        # reload its weights in place), a 1 GiB CPU KV cache (set VLLM_CPU_KVCACHE_SPACE for more), bound threads.
        for key, value in ENVIRONMENT.items():
            os.environ.setdefault(key, value)
        # ENVIRONMENT turns vLLM's split-KV decode attention off (a value set by the user wins): split, it depends on
        # the thread count and the step's batch. Measured at 2 engine threads: split, the exact trainer missed 2 of 20
        # steps of `train --engine vllm` by a few tokens; unsplit, none (docs/kernels.md: the engine's thread count).
        from vllm import LLM

        self.model_dir = Path(model_dir)
        self.llm = LLM(
            model=str(serve),
            **online,
            dtype="bfloat16",
            logprobs_mode="processed_logprobs",
            enforce_eager=enforce_eager,
            seed=seed,
            gpu_memory_utilization=0.3,
        )
        failure.capture()  # after the engine applied its logging configuration, which replaces the loggers' handlers
        self.info = engine_info(self.llm, enforce_eager)
        self.tokenizer = read_tokenizer(self.model_dir)
        self.max_model_len = int(self.llm.llm_engine.vllm_config.model_config.max_model_len)

    def generate(self, prompts, params: SamplingParams) -> list[Rollout]:
        """One completion per prompt (strings or token-id lists), with the sampler's log-probs."""
        from vllm import SamplingParams as VllmParams
        from vllm.inputs import TokensPrompt

        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        # Per request, as the reference engine derives its generators, so a group's completions differ.
        seeds = [None] * len(ids) if params.seed is None else request_seeds(params.seed, len(ids))
        requests = [
            VllmParams(
                n=1,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,  # 0: every token, in vLLM's convention as in ours
                max_tokens=min(params.max_tokens, self.max_model_len - len(p)),
                seed=s,
                logprobs=0,
                ignore_eos=params.ignore_eos,
                stop_token_ids=list(params.stop_token_ids or []),
            )
            for p, s in zip(ids, seeds, strict=True)
        ]
        outs = []
        for lo, hi in self._whole_prefill_batches(ids, seeded=params.seed is not None):
            with failure.guard("generate", RESUME):
                prompts_ = [TokensPrompt(prompt_token_ids=p) for p in ids[lo:hi]]
                outs += self.llm.generate(prompts_, requests[lo:hi], use_tqdm=False)
        rollouts = []
        for p, out in zip(ids, outs, strict=True):
            c = out.outputs[0]
            toks = list(c.token_ids)
            lps = [float(step[t].logprob) for step, t in zip(c.logprobs, toks, strict=True)]
            finish = "stop" if c.finish_reason == "stop" else "length"
            text = self.tokenizer.decode(toks, skip_special_tokens=True) if self.tokenizer is not None else None
            rollouts.append(Rollout(p, toks, lps, finish, text))
        return rollouts

    def _whole_prefill_batches(self, ids: list[list[int]], seeded: bool) -> list[tuple[int, int]]:
        """Consecutive [lo, hi) slices of the prompts whose prefills vLLM schedules whole, in one step.

        vLLM 0.32 on the CPU cannot sample a seeded request whose prefill it splits over steps (chunked prefill: a
        batch's prompt tokens past ``max_num_batched_tokens``, or requests past ``max_num_seqs`` that start later):
        its runner rewinds the request's generator, which a CPU generator refuses ("CPU Generator does not use
        offset"). Each slice fits both limits, so no prefill is split; the log-probs of a row do not depend on the
        batch it decodes in (the exact trainer computes each row alone)."""
        sched = self.llm.llm_engine.vllm_config.scheduler_config
        budget, most = int(sched.max_num_batched_tokens), int(sched.max_num_seqs)
        slices, lo, tokens = [], 0, 0
        for i, p in enumerate(ids):
            if seeded and len(p) > budget:
                raise UserError(
                    f"prompt {i} has {len(p)} tokens, more than vLLM's max_num_batched_tokens ({budget}): vLLM's CPU "
                    "build cannot sample a seeded request whose prefill it splits; shorten the prompt"
                )
            if i > lo and (tokens + len(p) > budget or i - lo >= most):
                slices.append((lo, i))
                lo, tokens = i, 0
            tokens += len(p)
        return slices + ([(lo, len(ids))] if ids else [])

    def score(self, prompt_ids, completion_ids, mode: str = "prefill", temperature: float = 1.0) -> list:
        """vLLM's prefill log-probs of each completion (``prompt_logprobs`` of prompt + completion)."""
        from vllm import SamplingParams as VllmParams
        from vllm.inputs import TokensPrompt

        if mode != "prefill" or temperature != 1.0:
            raise UserError(
                "with --engine vllm, --prefill-check compares against vLLM's prompt log-probs, which are raw "
                "(temperature 1): run it at --temperature 1"
            )
        seqs = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
        request = VllmParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        with failure.guard("score", RESUME):
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], request, use_tqdm=False)
        scored = []
        for p, c, out in zip(prompt_ids, completion_ids, outs, strict=True):
            steps = out.prompt_logprobs[len(p) :]
            scored.append(torch.tensor([float(s[t].logprob) for s, t in zip(steps, c, strict=True)]))
        return scored

    def load_weights(self, served: dict) -> None:
        """Serve ``served`` (HF-named tensors in the served dtype) from the next generate on, in place; a quantized
        engine serves them quantized, or serves the codes given (its checkpoint's tensors; ``engines.vllm.reload``)."""
        if self.scheme is not None:
            from roundalign.engines.vllm.reload import reload

            with failure.guard("load_weights", RESUME):
                reload(self.llm, served, self.scheme)
            return
        from roundalign.engines.vllm.reload import reload_weights

        with failure.guard("load_weights", RESUME):
            reload_weights(self.llm, [(name, t.to(torch.bfloat16)) for name, t in served.items()])

    def audit(self, served: dict) -> int:
        """Check that the engine serves ``served`` (the last ``load_weights``) exactly, reading every weight back
        through its own modules (``engines.vllm.audit``); how many were checked. A mismatch is an error naming them."""
        from roundalign.engines.vllm.audit import served_mismatches
        from roundalign.quant.schemes import NONE

        bad, checked = served_mismatches(self.llm, served, self.scheme or NONE)
        if bad:
            shown = ", ".join(bad[:5]) + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else "")
            raise Failure(
                f"vLLM does not serve what was exported for {len(bad)} of {checked} weights after the sync: {shown}. "
                "The engine's in-place reload missed them; report this with the vLLM version and the scheme"
            )
        return checked


__all__ = ["VllmEngine"]
