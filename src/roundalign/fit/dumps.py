"""Engine log-prob dumps from the reference engine, for trying ``roundalign fit`` without vLLM or SGLang.

    python -m roundalign.fit.dumps --profile sglang --out dump.jsonl              # ~2,000 tokens, prefill
    python -m roundalign.fit.dumps --profile vllm --mode decode --backend inductor --out dump.jsonl

The reference engine (``roundalign.engine``) samples completions from the shipped model (or ``--model``) and scores
them under ``--profile``, exactly as a real engine's dump would hold them:

- ``prefill`` (default): each prompt + completion in one forward, the log-prob of every completion token. This is
  what vLLM's ``prompt_logprobs`` / SGLang's ``return_logprob`` with ``logprob_start_len`` return when the sampled
  sequence is sent back as a prompt (docs/fit.md); its shapes are a trainer's, so it decides the most regions.
- ``decode``: the log-probs the engine reports while it samples (batched decode steps over a KV cache). Decode
  attention rounds differently from a one-sequence prefill, so fewer tokens are bitwise reproducible.

Completions are sampled once, by the ``hf`` profile, and only *scored* under ``--profile``: so that dumps for
different profiles hold the same tokens, and a fit is judged on the log-probs alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from roundalign.engine import BACKENDS
from roundalign.errors import UserError
from roundalign.rollouts import Rollout, write_engine_logprobs

MODES = ("prefill", "decode")


def reference_dump(
    profile,
    *,
    model=None,
    mode: str = "prefill",
    backend: str = "kernels",
    tokens: int = 2000,
    max_tokens: int = 125,
    seed: int = 0,
) -> list[Rollout]:
    """Completions totalling at least ``tokens`` tokens, scored by the reference engine under ``profile``."""
    from roundalign import models
    from roundalign.engine import Engine, SamplingParams
    from roundalign.prompts import default_prompts

    if mode not in MODES:
        raise UserError(f"unknown dump mode {mode!r}; choose one of {', '.join(MODES)}")
    if tokens <= 0 or max_tokens <= 0:
        raise UserError(f"tokens and max_tokens must be positive, got {tokens} and {max_tokens}")
    model = model or models.path()
    n = -(-tokens // max_tokens)  # every completion runs to max_tokens (ignore_eos): n of them suffice
    # A completion that reaches the model's context ends there ("length"), shorter than max_tokens.
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True)
    done = Engine(model, "hf").generate(default_prompts(n, seed), params)
    scorer = Engine(model, profile, backend=backend)
    logprobs = scorer.score([c.prompt_token_ids for c in done], [c.token_ids for c in done], mode=mode)
    return [
        Rollout(list(c.prompt_token_ids), list(c.token_ids), lp.tolist()) for c, lp in zip(done, logprobs, strict=True)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m roundalign.fit.dumps", description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True, help="the engine's profile: a built-in name or a .json file")
    parser.add_argument("--mode", choices=MODES, default="prefill")
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="kernels",
        help="kernels: per-op formulas; inductor: vLLM's forward_native code compiled (vllm only)",
    )
    parser.add_argument("--model", metavar="PATH", help="HF model directory (default: the shipped tiny-qwen3)")
    parser.add_argument("--tokens", type=int, default=2000, help="completion tokens in all (default 2000)")
    parser.add_argument("--max-tokens", type=int, default=125, help="tokens per completion (default 125)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, metavar="FILE")
    args = parser.parse_args(argv)
    try:
        dump = reference_dump(
            args.profile,
            model=args.model,
            mode=args.mode,
            backend=args.backend,
            tokens=args.tokens,
            max_tokens=args.max_tokens,
            seed=args.seed,
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    write_engine_logprobs(Path(args.out), dump)
    print(
        f"{args.out}: {len(dump)} completions, {sum(len(r.token_ids) for r in dump)} tokens, profile "
        f"{args.profile}, {args.mode}, backend {args.backend}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
