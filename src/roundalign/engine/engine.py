"""``Engine``: a CPU reference rollout engine with its own served 16-bit weights and its own numerics.

``generate`` runs batched generation the way vLLM schedules it: one prefill of every prompt (flattened, no
padding), then one decode step per token with a KV cache, each sequence leaving the batch when it stops. ``score``
recomputes the log-probs of given completions two ways: ``prefill`` (each sequence alone, one forward, the shapes a
trainer uses) and ``decode`` (a replay of what ``generate`` computed, bitwise). ``hidden_states`` returns the
residual stream after every decoder layer. ``load_weights`` replaces the served copy in place. The served dtype is
bf16 by default, or fp16 (``dtype=torch.float16``): every rounding point then rounds to fp16.

The engine is a reference for tests, demos and experiments on the CPU. At scale, sample with vLLM or SGLang and
compare their log-probs with ``roundalign probe --engine-logprobs dump.jsonl`` (docs/engine.md).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from roundalign.engine import compile as _compile
from roundalign.engine.attention import AttentionSpec, KVCache, PrefillShapes, Step, forward_context
from roundalign.engine.gemm import logits
from roundalign.engine.loader import check_dtype, head_dim, load
from roundalign.engine.model import KernelsModel
from roundalign.engine.native import NativeModel
from roundalign.engine.sampling import SamplingParams, process, request_generators, sample, token_logprobs
from roundalign.errors import UserError
from roundalign.profiles import AttentionKernel, GemmKernel, get_profile
from roundalign.rollouts import Rollout

BACKENDS = ("kernels", "inductor")
# The inductor backend runs vLLM's model code compiled piecewise, so it rounds where the compiler does: the rules of
# the ``vllm`` profile (two of them measured, docs/qk-norm.md). It implements that profile and no other; the
# kernels backend implements every profile by its formulas.
INDUCTOR_PROFILE = "vllm"


def backends_for(profile) -> tuple[str, ...]:
    """The backends that implement ``profile`` (by its rules, not its name)."""
    return BACKENDS if get_profile(profile).same_rules(INDUCTOR_PROFILE) else ("kernels",)


def check_backend(backend: str, profile) -> None:
    """Refuse an unknown backend, or one that does not implement ``profile`` (it would mislabel its numerics)."""
    if backend not in BACKENDS:
        raise UserError(f"unknown engine backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    profile = get_profile(profile)
    if profile.attention is AttentionKernel.VLLM_CPU or profile.gemm is GemmKernel.VLLM_CPU:
        raise UserError(
            f"profile {profile.name!r} runs vLLM's kernels in the trainer; the reference engine computes with its "
            f"own (attention and gemm 'reference', or HF's). Give the engine the rounding rules alone: "
            f"{profile.rounding_only().name!r}"
        )
    if backend not in backends_for(profile):
        raise UserError(
            f"the {backend} backend runs vLLM's compiled code, which rounds where the {INDUCTOR_PROFILE!r} profile "
            f"says; it cannot serve profile {profile.name!r}, whose rules differ. Use the kernels backend for it"
        )


_PIECEWISE = []


def _piecewise():
    if not _PIECEWISE:
        _PIECEWISE.append(_compile.piecewise_backend([torch.ops.roundalign.unified_attention]))
    return _PIECEWISE[0]


class _PerSequenceNativeModel(NativeModel):
    """vLLM's model code with every projection as ``roundalign::linear``: one GEMM call per sequence, opaque to the
    compiler like the extern GEMM it replaces (roundalign.engine.gemm)."""

    def linear(self, h: torch.Tensor, lin) -> torch.Tensor:
        return torch.ops.roundalign.linear(h, lin.weight, lin.bias)


SCORE_MODES = ("prefill", "decode")


class Engine:
    """``Engine(model_or_path, profile="vllm", backend="kernels", *, tokenizer=None, dtype=torch.bfloat16)``.

    ``model_or_path``: an HF Qwen3 / Qwen2 / Llama ``*ForCausalLM`` (its weights are copied to ``dtype``; later
    changes to it do not reach the engine) or a directory written by ``save_pretrained`` (its tokenizer is loaded
    if present). ``profile``: a profile name or ``Profile``; the ``kernels`` backend computes each region by its
    formula. ``backend``: ``"kernels"`` (per-op formulas, eager) or ``"inductor"`` (vLLM's forward_native code
    compiled piecewise; its rounding points are the compiler's and do not depend on the profile). ``dtype``: the
    served dtype, ``torch.bfloat16`` or ``torch.float16`` (Precision-RL's fp16 on both sides): the weights, every
    rounding point, the KV cache's values and a c16 cos/sin cache are in it.
    """

    def __init__(
        self,
        model_or_path,
        profile="vllm",
        backend: str = "kernels",
        *,
        tokenizer=None,
        dtype: torch.dtype = torch.bfloat16,
    ):
        self.profile = get_profile(profile)
        check_backend(backend, self.profile)
        self.backend = backend
        self.dtype = check_dtype(dtype)
        if self.profile.quantization.quantized and self.dtype != torch.bfloat16:
            raise UserError(f"quantization {self.profile.quantization} is served with bf16 activations; drop the dtype")
        self.config, self.weights, self.tokenizer, self.eos_token_ids = load(model_or_path, tokenizer, dtype)
        self.max_model_len = int(self.config.max_position_embeddings)
        self.vocab_size = int(self.config.vocab_size)
        self._spec = AttentionSpec(
            self.config.num_attention_heads,
            self.config.num_key_value_heads,
            head_dim(self.config),
            rowwise=self.profile.attention is AttentionKernel.REFERENCE,
        )
        self.compile_stats = {"graphs": 0, "pieces": 0, "seconds": 0.0}  # what this engine's calls compiled
        if backend == "kernels":
            self._model = KernelsModel(self.weights, self.config, self.profile, dtype)
        else:
            self._model = _PerSequenceNativeModel(self.weights, self.config, dtype)
            # One backend object for every engine: dynamo guards on the backend, so engines of one model shape
            # share the compiled graph instead of compiling their own.
            self._compiled = torch.compile(self._model, backend=_piecewise(), fullgraph=True, dynamic=None)

    def __repr__(self) -> str:
        dtype = "" if self.dtype == torch.bfloat16 else f", dtype={self.dtype}"
        return (
            f"Engine({self.config.model_type}, profile={self.profile.name!r}, backend={self.backend!r}, "
            f"layers={self.config.num_hidden_layers}{dtype})"
        )

    # ----------------------------------------------------------------------------------------------------------
    # forward

    def _forward(self, input_ids: torch.Tensor, step: Step, capture: bool = False):
        """Final-norm hidden states (rows, hidden) of one step, and ``R`` after every layer when ``capture``."""
        if self.backend == "kernels":
            return self._model.forward(input_ids, step, capture)
        n = input_ids.shape[0]
        positions = step.positions()
        if n == 1:  # dynamo specializes a size-1 dim: pad to two rows rather than compile a second graph
            input_ids, positions = torch.cat((input_ids, input_ids)), torch.cat((positions, positions))
        _compile.mark_tokens_dynamic(input_ids, positions)
        before = dict(_compile.COMPILE_STATS)
        t0 = time.perf_counter()
        # Every model shape (and the hidden-state capture) is one more entry on NativeModel.forward's code object;
        # past dynamo's default limit of 8 a fullgraph compile fails, so a process may hold more engines than that.
        with forward_context(step), torch._dynamo.config.patch(recompile_limit=64):
            out = self._compiled(input_ids, positions, capture)
        if _compile.COMPILE_STATS["graphs"] != before["graphs"]:  # this call compiled: count its wall time
            self.compile_stats["graphs"] += _compile.COMPILE_STATS["graphs"] - before["graphs"]
            self.compile_stats["pieces"] += _compile.COMPILE_STATS["pieces"] - before["pieces"]
            self.compile_stats["seconds"] += time.perf_counter() - t0
        hidden, captured = out if capture else (out, ())
        return hidden[:n], [h[:n] for h in captured]

    def _logits(self, hidden: torch.Tensor, step: Step, groups) -> torch.Tensor:
        if self.backend == "kernels":
            return self._model.logits(hidden, step, groups)
        # Outside the compiled region, as vLLM's LogitsProcessor; one call per sequence, as every GEMM here.
        return logits(hidden, self.weights.lm_head.weight, groups)

    def _rollout(self, prompts: list[list[int]], budgets: list[int], choose: Callable, shapes=None) -> None:
        """One batched prefill, then decode steps. ``choose(active, logits)`` gets the fp32 logits of the active
        sequences' next tokens and returns (next token, finished) per active sequence."""
        cache = KVCache(
            self.config.num_hidden_layers,
            [len(p) + b for p, b in zip(prompts, budgets, strict=True)],
            self._spec,
            self.dtype,
        )
        lengths = [len(p) for p in prompts]
        step = Step.prefill(lengths, cache, self._spec, shapes)
        with torch.no_grad():
            hidden, _ = self._forward(torch.tensor([t for p in prompts for t in p]), step)
            logits = self._logits(hidden[step.last_rows()], step, step.last_groups())
            active = list(range(len(prompts)))
            while True:
                picks = choose(active, logits.float())
                feed = [(seq, tok) for seq, (tok, done) in zip(active, picks, strict=True) if not done]
                if not feed:
                    return
                active = [seq for seq, _ in feed]
                step = Step.decode(active, [lengths[s] for s in active], cache, self._spec, shapes)
                for s in active:
                    lengths[s] += 1
                hidden, _ = self._forward(torch.tensor([tok for _, tok in feed]), step)
                logits = self._logits(hidden, step, list(step.groups()))

    # ----------------------------------------------------------------------------------------------------------
    # public API

    def generate(self, prompts, params: SamplingParams | None = None) -> list[Rollout]:
        """Sample one completion per prompt (token-id lists, or strings when the engine has a tokenizer).

        Each ``Rollout``'s ``token_ids`` include a stop token (with its log-prob), as vLLM does for EOS;
        ``finish_reason`` is ``"stop"`` (a stop or EOS token) or ``"length"`` (max_tokens or the context); ``text``
        is the decoded completion when the engine has a tokenizer."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        ids = self._prompt_ids(prompts)
        stop = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(self.eos_token_ids))
        budgets = [min(params.max_tokens, self.max_model_len - len(p)) for p in ids]  # context limit -> "length"
        generators = request_generators(params.seed, len(ids))
        tokens_of: list[list[int]] = [[] for _ in ids]
        logprobs_of: list[list[float]] = [[] for _ in ids]
        stopped = [False] * len(ids)

        def choose(active, logits):
            processed = process(logits, params)
            tokens = sample(processed, params, [generators[s] for s in active])
            lps = token_logprobs(logits, processed, tokens, params.logprobs_mode)
            picks = []
            for seq, tok, lp in zip(active, tokens.tolist(), lps.tolist(), strict=True):
                tokens_of[seq].append(tok)
                logprobs_of[seq].append(lp)
                stopped[seq] = tok in stop
                picks.append((tok, tok in stop or len(tokens_of[seq]) == budgets[seq]))
            return picks

        self._rollout(ids, budgets, choose)
        return [
            Rollout(
                list(p),
                toks,
                lps,
                "stop" if done else "length",
                None if self.tokenizer is None else self.tokenizer.decode(toks, skip_special_tokens=True),
            )
            for p, toks, lps, done in zip(ids, tokens_of, logprobs_of, stopped, strict=True)
        ]

    def score(
        self, prompt_ids, completion_ids, mode: str = "prefill", prefill_shaped=(), temperature: float = 1.0
    ) -> list[torch.Tensor]:
        """Raw (full-vocabulary) fp32 log-probs of each completion token, one 1-D tensor each, at ``temperature``
        (``log_softmax(logits.float() / temperature)``, as a trainer computes them; 1.0 divides by nothing).

        ``mode="prefill"``: each sequence alone, one forward over prompt + completion (positions 0..n-1), the rows
        ``n_prompt - 1 .. n - 2`` of its log-softmax: the shapes a trainer uses. ``mode="decode"``: a replay of
        ``generate`` (one batched prefill, then decode steps feeding the given tokens, sequences leaving the batch
        when their completion ends), bitwise equal to ``generate``'s raw log-probs for the same batch.
        ``prefill_shaped`` (decode only, kernels backend): ``"attention"`` and/or ``"matmul"`` are computed with
        the one-sequence prefill's shapes in every step (docs/engine.md, decode-shape attribution).
        """
        if mode not in SCORE_MODES:
            raise UserError(f"unknown score mode {mode!r}; choose one of {', '.join(SCORE_MODES)}")
        prompts, completions = self._prompt_ids(prompt_ids), [self._token_list(c, "completion") for c in completion_ids]
        if len(prompts) != len(completions):
            raise UserError(f"{len(prompts)} prompts but {len(completions)} completions; pass one completion each")
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            self._check_ids(c, f"completion {i}", allow_empty=False)
            if len(p) + len(c) > self.max_model_len:
                raise UserError(
                    f"prompt {i} + completion is {len(p) + len(c)} tokens, more than max_model_len {self.max_model_len}"
                )
        shaped = self._check_shaped(prefill_shaped, mode)
        t = temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise UserError(f"temperature must be a finite number > 0, got {t!r}")
        if mode == "prefill":
            return [
                self._prefill_logprobs(p + c, temperature=t)[len(p) - 1 : -1].gather(1, torch.tensor(c)[:, None])[:, 0]
                for p, c in zip(prompts, completions, strict=True)
            ]
        out: list[list[float]] = [[] for _ in prompts]

        def choose(active, logits):
            tokens = [completions[seq][len(out[seq])] for seq in active]
            scaled = logits if t == 1 else logits / t  # as generate's processed log-probs at top-p 1
            lps = token_logprobs(scaled, scaled, torch.tensor(tokens), "raw")  # as generate computes them
            picks = []
            for seq, tok, lp in zip(active, tokens, lps.tolist(), strict=True):
                out[seq].append(lp)
                picks.append((tok, len(out[seq]) == len(completions[seq])))
            return picks

        shapes = PrefillShapes(shaped, [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)])
        self._rollout(prompts, [len(c) for c in completions], choose, shapes if shaped else None)
        return [torch.tensor(lps, dtype=torch.float32) for lps in out]  # fp32 -> float -> fp32 is exact

    def _prefill_logprobs(self, ids: list[int], capture: bool = False, temperature: float = 1.0):
        cache = KVCache(self.config.num_hidden_layers, [len(ids)], self._spec, self.dtype)
        step = Step.prefill([len(ids)], cache, self._spec)
        with torch.no_grad():
            hidden, captured = self._forward(torch.tensor(ids), step, capture)
            logits = self._logits(hidden, step, list(step.groups())).float()
            lps = (logits if temperature == 1 else logits / temperature).log_softmax(dim=-1)
        return (lps, captured) if capture else lps

    def hidden_states(self, token_ids) -> list[torch.Tensor]:
        """Prefill of one sequence: the residual ``R = r(S)`` after every decoder layer, ``(tokens, hidden)`` in the
        engine's dtype each, ``num_hidden_layers`` of them. The last one is before the final norm (HF's last hidden
        state is after it); the others equal HF's ``output_hidden_states[1:-1]``."""
        ids = self._token_list(token_ids, "token_ids")
        self._check_ids(ids, "token_ids", allow_empty=False)
        if len(ids) > self.max_model_len:
            raise UserError(f"{len(ids)} tokens, more than max_model_len {self.max_model_len}")
        return self._prefill_logprobs(ids, capture=True)[1]

    def load_weights(self, state_dict: dict, sync: str = "rne", seed: int = 0) -> None:
        """Replace the served copy from HF-named tensors (fp32 master, bf16 or fp16), rounding to the engine's dtype
        by the sync mode ``sync`` (``"rne"``, or ``"stochastic"`` / ``"error-feedback"`` on fp32 masters, with state
        kept by the engine per (sync, seed): docs/sync.md); a weight that overflows the dtype (fp16: beyond 65504) is a
        ValueError. In place: a compiled graph keeps running without a recompile.

        A quantized engine (a profile with a checkpoint scheme) also takes the tensors of its quantized checkpoint
        (``roundalign.sync.Exporter(..., scheme=)``'s export, ``quant.checkpoint.served_state_dict``): it then serves
        exactly those codes, as vLLM serves the checkpoint, instead of quantizing the weights again."""
        scheme = self.profile.quantization
        if not (scheme.quantized and not scheme.from_bf16 and isinstance(state_dict, dict)):
            self.weights.load(state_dict, sync, seed)
            return
        from roundalign.quant import checkpoint

        if not checkpoint.is_checkpoint(state_dict):
            self.weights.load(state_dict, sync, seed)
            return
        from roundalign.quant.grid import serve

        if sync != "rne":
            raise UserError(
                f"load_weights got a quantized checkpoint's tensors with sync={sync!r}: they are exported already "
                "(the codes are chosen); pass sync='rne', or pass the fp32 master to have the engine export it"
            )
        linears, rest = checkpoint.split(state_dict, scheme)
        weights = {f"{name}.weight": q.dequantize(self.weights.dtype) for name, q in linears.items()}
        self.weights.load({**rest, **weights})
        expected = self.weights.expected()
        for name, q in linears.items():
            serve(expected[f"{name}.weight"], q)  # after the copy: its version is the one served

    # ----------------------------------------------------------------------------------------------------------
    # input checks

    def _token_list(self, ids, what: str) -> list[int]:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        if not isinstance(ids, (list, tuple)):
            raise TypeError(f"{what} must be a list of token ids, got {type(ids).__name__}")
        return list(ids)

    def _check_ids(self, ids: list[int], what: str, allow_empty: bool = True) -> None:
        if not ids and not allow_empty:
            raise UserError(f"{what} is empty; pass at least one token id")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise UserError(
                f"{what} has token id(s) {bad[:5]} outside the vocabulary [0, {self.vocab_size}); "
                "check the tokenizer matches the model"
            )

    def _prompt_ids(self, prompts) -> list[list[int]]:
        if isinstance(prompts, (str, torch.Tensor)) or not isinstance(prompts, (list, tuple)) or not prompts:
            raise TypeError("prompts must be a non-empty list of prompts (token-id lists, or strings with a tokenizer)")
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise UserError(
                        "string prompts need a tokenizer: load the engine from a directory with "
                        "tokenizer files, pass tokenizer=, or pass token ids"
                    )
                p = self.tokenizer.encode(p)  # special tokens as the tokenizer adds them, like vLLM
            p = self._token_list(p, f"prompt {i}")
            self._check_ids(p, f"prompt {i}", allow_empty=False)
            if len(p) > self.max_model_len - 1:
                raise UserError(
                    f"prompt {i} has {len(p)} tokens; max_model_len {self.max_model_len} leaves room "
                    f"for at most {self.max_model_len - 1} (prompts are never truncated)"
                )
            out.append(p)
        return out

    def _check_shaped(self, prefill_shaped, mode: str) -> frozenset:
        parts = (prefill_shaped,) if isinstance(prefill_shaped, str) else tuple(prefill_shaped or ())
        unknown = [p for p in parts if p not in PrefillShapes.PARTS]
        if unknown:
            raise UserError(f"unknown prefill_shaped part(s) {unknown}; choose from {PrefillShapes.PARTS}")
        if parts and mode != "decode":
            raise UserError("prefill_shaped applies to mode='decode' only (a prefill already has those shapes)")
        if parts and self.backend != "kernels":
            raise UserError(
                "prefill_shaped needs the kernels backend; the inductor backend's compiled graph cannot "
                "run a part with other shapes"
            )
        return frozenset(parts)
