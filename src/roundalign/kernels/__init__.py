"""The engine's attention and GEMM kernels in the trainer's forward, with standard gradients.

Rounding-location alignment leaves the kernels: an engine's attention and GEMMs reduce in their own orders, and
once the element-wise code rounds where the engine's does, they are what still separates a trainer's log-probs
from the sampler's. A profile therefore also names the kernels (``Profile.attention``, ``Profile.gemm``), and
``roundalign.apply`` runs the named ones here:

- ``attention``: ``hf`` (the model's own), ``vllm-cpu`` (vLLM's CPU attention ops, ``vllm_cpu``) or ``reference``
  (the reference engine's decode attention, row by row). The engine kernels compute each sequence of the batch
  alone, unpadded and from position 0, as the engine computed it (``batch.sequences`` finds them in a padded or
  packed batch from the attention mask and ``position_ids``).
- ``forward``: ``hf`` (the model's forward, patched region by region) or ``vllm-cpu-compiled`` (vLLM's own forward
  code compiled by Inductor as vLLM's CPU build compiles it: ``graph``), which vLLM's default compiled mode needs.
- ``gemm``: ``torch`` (each ``nn.Linear`` as it is), ``vllm-cpu`` (vLLM's CPU GEMM dispatch on the weights vLLM
  fuses: q/k/v and gate/up as one GEMM each, the lm_head padded to 64 rows) or ``reference`` (one GEMM call per
  row, as the reference engine's decode).

The modules: ``availability`` (``check``: whether this model can run the profile's kernels here, at ``apply``
time), ``engine_attention`` (``attention``, the HF attention function over the engine kernels), ``engine_gemm``
(``project`` and ``EngineLMHead``: the engine's GEMMs and their prepared-weight cache), ``quantized`` (the
projections of a quantized engine: ``Profile.quantization``, aligned or exact, straight-through gradient) and
``vllm_quant`` (vLLM's quantized CPU layers on stand-in modules), ``autocast`` (what both run
under), ``batch`` (the sequences of a padded or packed batch), ``vllm_cpu`` (vLLM's CPU ops) and ``graph`` (vLLM's
compiled forward). This package re-exports what the rest of roundalign calls.

**Backward.** The engine kernels have none. The gradient is that of standard attention and of a standard linear
at the same inputs: attention saves only q, k and v and recomputes HF's SDPA attention in the backward (so memory
is what FlashAttention-style training uses, and the gradient is stock HF's own); a linear's input gradient is
``g @ W`` and its weight gradient ``g^T x`` in the model dtype, as torch's linear backward computes them (for a fused
q/k/v the three input gradients are summed inside one GEMM rather than added in bf16 afterwards). So the forward is
the engine's bit for bit, and the update direction is the usual one: what an exact on-policy RL trainer needs.
Gradient checkpointing recomputes the engine forward, which is deterministic.
"""

from roundalign.kernels import engine_gemm, quantized
from roundalign.kernels.availability import check
from roundalign.kernels.engine_attention import attention
from roundalign.kernels.engine_gemm import EngineLMHead


def project(module, names: tuple[str, ...], x, gemm, pad_to: int = 1) -> list:
    """A module's projections as the profile computes them: quantized (``quantized.project``) where ``apply`` gave
    the module a quantization scheme (``_roundalign_quant``), else bf16 (``engine_gemm.project``)."""
    scheme = getattr(module, "_roundalign_quant", None)
    if scheme is not None and scheme.quantized:
        return quantized.project(module, names, x, gemm, scheme)
    return engine_gemm.project(module, names, x, gemm, pad_to)


__all__ = ["EngineLMHead", "attention", "check", "project"]
