"""Element-wise ops whose rounding points follow a rule: RMSNorm, residual add + RMSNorm, RoPE and SwiGLU.

Every op is a formula with explicit casts (``r(t) = t.to(bf16)``, or ``t.to(float16)`` in an fp16 model), run as a
``torch.library`` custom op so that torch.compile cannot move its rounding points, with a backward that saves only
the 16-bit inputs. See
``roundalign/ops/_custom.py`` for how the gradient is defined.
"""

from roundalign.numerics.formulas import rotate_half
from roundalign.ops.rms_norm import add_rms_norm, residual_add, rms_norm
from roundalign.ops.rope import rope
from roundalign.ops.swiglu import swiglu

__all__ = ["add_rms_norm", "residual_add", "rms_norm", "rope", "rotate_half", "swiglu"]
