"""The recovery table for ``roundalign fit``: each built-in profile's dump from the reference engine, fitted.

    .venv/bin/python scripts/fit_recovery.py                    # prefill and decode dumps, ~2,000 tokens each
    .venv/bin/python scripts/fit_recovery.py --tokens 500 --modes prefill

For every built-in profile and dump mode, the reference engine (kernels backend; and vLLM's compiled
``forward_native`` code, the inductor backend, for ``vllm`` decode) scores the same completions and writes them as a
dump; ``fit`` then searches the whole rule space with its default pruning. Prints a markdown table: the true profile,
the built-in profiles bitwise identical to the fit on that dump, whether the true profile is among them, each region's
status, the best candidate's bitwise-equal fraction, the margin over the runner-up, and the time. docs/fit.md holds
the table from this machine.
"""

from __future__ import annotations

import argparse
import time

from roundalign.fit import fit
from roundalign.fit.dumps import reference_dump
from roundalign.probe.trainer import Rollout, load_trainer_model
from roundalign.profiles import list_profiles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--modes", default="prefill,decode")
    parser.add_argument("--profiles", default=",".join(list_profiles()))
    args = parser.parse_args()
    from roundalign import models

    model = load_trainer_model(models.path())
    cases = [(p, m, "kernels") for m in args.modes.split(",") for p in args.profiles.split(",")]
    if "decode" in args.modes.split(",") and "vllm" in args.profiles.split(","):
        cases.append(("vllm", "decode", "inductor"))
    print(
        "| true profile | dump | fitted (bitwise identical on the dump) | true recovered | regions: determined / "
        "identical / unclear | best bitwise-equal | margin over runner-up | fit time |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for profile, mode, backend in cases:
        dump = reference_dump(profile, mode=mode, backend=backend, tokens=args.tokens)
        rollouts = [Rollout(r.prompt_token_ids, r.token_ids, r.logprobs) for r in dump]
        t0 = time.perf_counter()
        result = fit(model, rollouts)
        seconds = time.perf_counter() - t0
        truth = result.space.key_of(profile)
        recovered = truth in result.equivalents
        status = {
            s: [r for r, d in result.regions.items() if d["status"] == s]
            for s in ("determined", "identical", "unclear")
        }
        wrong = [r for r in status["determined"] if result.regions[r]["rule"] != truth.rule(r)]
        m = result.margin
        margin = f"{m['bitwise_equal_frac_gap'] * 100:+.1f} pts, z {m['z']:.1f}" if m.get("runner_up") else "none"
        regions = " / ".join(", ".join(status[s]) or "-" for s in status)
        named = ", ".join(result.named_matches) or f"custom ({result.best.candidate.label()})"
        flag = (
            "yes"
            if recovered
            else (
                "no, determined regions wrong: " + ", ".join(wrong)
                if wrong
                else "no (the differing regions are reported unclear)"
            )
        )
        print(
            f"| {profile} | {mode}{'' if backend == 'kernels' else ' (' + backend + ')'} "
            f"{result.stats['tokens']} tok | {named} | {flag} | {regions} | "
            f"{result.best.metrics['mismatch/bitwise_equal_frac']:.3f} | {margin} | {seconds:.1f} s |",
            flush=True,
        )


if __name__ == "__main__":
    main()
