"""roundalign.engine: a reference rollout engine on the CPU, with its own served bf16 (or fp16) weights and its own
numerics.

    from roundalign.engine import Engine, SamplingParams
    eng = Engine(model_or_path, profile="vllm", backend="kernels")   # or backend="inductor"
    outs = eng.generate(prompts, SamplingParams(temperature=1.0, max_tokens=32, seed=0))
    lps = eng.score([o.prompt_token_ids for o in outs], [o.token_ids for o in outs], mode="prefill")

Two numerics backends:

- ``kernels``: every element-wise region computed by the profile's formula (``roundalign.ops``), standing in for
  engines built from fused kernels (SGLang and FlashInfer, vLLM with custom ops);
- ``inductor``: vLLM's ``forward_native`` model code compiled by torch.compile piecewise (split at attention), so
  the compiler decides where to round, as in vLLM's default mode.

It is a reference for tests, demos and experiments. At scale, sample with vLLM or SGLang and compare their
log-probs with ``roundalign probe --engine-logprobs dump.jsonl``. See docs/engine.md.
"""

from roundalign.engine.engine import BACKENDS, Engine, backends_for, check_backend
from roundalign.engine.loader import SUPPORTED_FAMILIES
from roundalign.engine.sampling import SamplingParams

__all__ = ["BACKENDS", "SUPPORTED_FAMILIES", "Engine", "SamplingParams", "backends_for", "check_backend"]
