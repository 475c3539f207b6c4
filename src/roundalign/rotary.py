"""RoPE angles computed the way engines compute them: fp32 inv_freq from the config, whatever the model's dtype.

Engines build ``inv_freq`` and the cos/sin cache in fp32 from the config (vLLM ``RotaryEmbedding._compute_inv_freq``,
SGLang ``rotary_embedding/base.py``) and cast the cache to bf16 only when their kernel wants bf16. HF keeps
``inv_freq`` as a module buffer instead. That buffer stays fp32 when a model is loaded with
``dtype=torch.bfloat16``, but becomes bf16 when the model is cast with ``.to(torch.bfloat16)``, as verl does after
loading, and then every rotary angle is off by up to 2^-9 relative: far from the engine's.

``AlignedRotary`` therefore recomputes ``inv_freq`` in fp32 on the CPU from the config at patch time and keeps it
out of the module's buffers, so neither ``.to(dtype)`` nor the loading path can change it. The angle and cos/sin
expressions are HF's (``position * inv_freq`` in fp32, ``cos(theta) * attention_scaling``), which are also the
engines' (a single fp32 multiply per element either way).
"""

from __future__ import annotations

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from roundalign.mixed_precision import Carry, low_dtype
from roundalign.profiles import CosSinDtype, RopeRule
from roundalign.support import check_trainer_model, rope_type


def engine_inv_freq(config, default_fn) -> tuple[torch.Tensor, float]:
    """(inv_freq in fp32 on the CPU, attention_scaling) from the config, as an engine computes them at load."""
    check_trainer_model(config)
    kind = rope_type(config)
    fn = default_fn if kind == "default" else ROPE_INIT_FUNCTIONS[kind]
    with torch.device("cpu"):
        inv_freq, scaling = fn(config, device=torch.device("cpu"))
    if inv_freq.dtype != torch.float32:
        raise RuntimeError(f"rope init for {kind!r} returned {inv_freq.dtype}; expected fp32")
    return inv_freq, float(scaling)


class AlignedRotary:
    """Mixin for HF ``*RotaryEmbedding``: returns (cos, sin) from the fp32 engine inv_freq, in the profile's dtype."""

    _roundalign_rope: RopeRule
    _roundalign_inv_freq: torch.Tensor | None  # None: the module's own inv_freq (rope_angles=module)
    _roundalign_scaling: float | None

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        inv_freq, scaling = self._roundalign_inv_freq, self._roundalign_scaling
        if inv_freq is None:  # rope_angles=module: HF's buffer, in the dtype the model holds it, upcast as HF does
            inv_freq, scaling = self.inv_freq.float(), self.attention_scaling
        elif inv_freq.device != x.device:
            # Kept out of the buffers on purpose (see module docstring); follow the activations' device lazily.
            inv_freq = self._roundalign_inv_freq = inv_freq.to(x.device)
        freqs = position_ids[..., None].float() * inv_freq  # theta, fp32: (B, T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * scaling
        sin = emb.sin() * scaling
        # In a Carry, so that FSDP2's forward-input cast cannot round c32 on its way into the layers.
        if self._roundalign_rope.cos_sin is CosSinDtype.BF16:
            low = low_dtype(x)  # the model's 16-bit dtype, or autocast's for fp32 parameters
            return Carry(cos.to(low), sin.to(low))  # c16 = r(cos(theta)), the engine's bf16 cache
        return Carry(cos, sin)  # c32, the fp32 cache of FlashInfer / SGLang / TE

    def extra_repr(self) -> str:
        angles = "the module's buffer" if self._roundalign_inv_freq is None else "fp32 from config"
        return f"rope={self._roundalign_rope}, inv_freq={angles}"
