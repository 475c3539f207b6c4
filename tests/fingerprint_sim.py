"""Simulated engines for the fingerprint tests, as adapters of the runner script (the user's collection code path).

- ``ProfileAdapter``: roundalign.ops under a named profile's rules, the way an engine with that profile rounds.
  Within one case's graph a compiled engine's residual is carried unrounded (``round_at_attention``,
  ``never_round``); the runner rounds it only where it leaves the graph, as an engine does at a piece edge.
- ``ShapeDependentAdapter``: a profile whose RMSNorm rule depends on the hidden size, as a kernel chosen by shape
  would: the reader must give the model's shapes their own line and the profile must follow them.

vLLM's ``forward_native`` code is not simulated here: the runner's own ``--engine native`` adapter
(``runner.NativeAdapter``) is what the tests run, so the user's dry-run code path is the tested one.
- ``WrongAdapter``: a profile whose SwiGLU and RoPE round somewhere no rule does (truncation instead of
  round-to-nearest-even; cos/sin in fp16), to check that the reader says "no rule" instead of picking the closest.
"""

from __future__ import annotations

import torch

from roundalign.fingerprint import battery as B
from roundalign.fingerprint.runner import Adapter
from roundalign.ops import residual_add, rms_norm, rope, swiglu
from roundalign.profiles import ResidualRule, get_profile

BF16 = torch.bfloat16


class ProfileAdapter(Adapter):
    engine = "sim-profile"

    def __init__(self, profile, mode: str = "eager"):
        super().__init__(mode, device="cpu")
        self.profile = get_profile(profile)

    def graph(self, fn):
        return fn  # the ops already round where the profile says; nothing for a compiler to change

    def rms_norm(self, weight, eps):
        return lambda x: rms_norm(x, weight, eps, self.profile.rms_norm)

    def qk_norm(self, weight, eps):
        return lambda x: rms_norm(x, weight, eps, self.profile.qk_norm, out_dtype=BF16)

    def add_rms_norm(self, weight, eps):
        rule = self.profile.residual

        def add(x, residual):
            res, normed_input = residual_add(x, residual, rule)
            out = rms_norm(normed_input, weight, eps, self.profile.rms_norm, out_dtype=BF16)
            carried = normed_input if rule in (ResidualRule.ROUND_AT_ATTENTION, ResidualRule.NEVER_ROUND) else res
            return out, carried

        return add

    def _swiglu(self, rule):
        def act(x):
            d = x.shape[-1] // 2
            return swiglu(x[..., :d], x[..., d:], rule)

        return act

    def silu_and_mul(self):
        return self._swiglu(self.profile.swiglu)

    def expert_silu_and_mul(self):
        return self._swiglu(self.profile.expert_swiglu)

    def _cos_sin(self, positions, head_dim, theta, max_position, dtype):
        return B.cos_sin(positions, head_dim, theta, max_position, dtype)

    def rope(self, head_dim, theta, max_position):
        rule = self.profile.rope_for(head_dim)

        def rotate(positions, q, k):
            dtype = BF16 if str(rule.cos_sin) == "bf16" else torch.float32
            cos, sin = self._cos_sin(positions, head_dim, theta, max_position, dtype)
            return tuple(
                rope(t.view(t.shape[0], -1, head_dim), cos, sin, rule.rounding, out_dtype=BF16).reshape(t.shape[0], -1)
                for t in (q, k)
            )

        return rotate

    def info(self):
        return {"engine_version": f"profile {self.profile.name}"}


class WrongAdapter(ProfileAdapter):
    """The ``hf`` profile, except that SwiGLU truncates its product to bf16 and RoPE reads an fp16 cos/sin cache."""

    engine = "sim-wrong"

    def __init__(self, mode: str = "eager"):
        super().__init__("hf", mode)

    def _swiglu(self, rule):
        def act(x):
            d = x.shape[-1] // 2
            y = (torch.nn.functional.silu(x[..., :d].float()) * x[..., d:].float()).contiguous()
            return (y.view(torch.int32) & -65536).view(torch.float32).to(BF16)  # round toward zero: exact cast

        return act

    def _cos_sin(self, positions, head_dim, theta, max_position, dtype):
        cos, sin = B.cos_sin(positions, head_dim, theta, max_position, torch.float32)
        return cos.to(torch.float16), sin.to(torch.float16)


class ShapeDependentAdapter(ProfileAdapter):
    """``profile``, except that RMSNorm (plain and after the residual add) rounds before the weight on rows of
    ``hidden`` elements: a rule that depends on the shape, as a kernel picked by size would."""

    engine = "sim-shape"

    def __init__(self, profile, hidden: int, mode: str = "eager"):
        super().__init__(profile, mode)
        self.hidden = hidden

    def _norm_rule(self, weight):
        return "round_before_weight" if weight.shape[0] == self.hidden else self.profile.rms_norm

    def rms_norm(self, weight, eps):
        return lambda x: rms_norm(x, weight, eps, self._norm_rule(weight))

    def add_rms_norm(self, weight, eps):
        rule = self.profile.residual

        def add(x, residual):
            res, normed_input = residual_add(x, residual, rule)
            out = rms_norm(normed_input, weight, eps, self._norm_rule(weight), out_dtype=BF16)
            carried = normed_input if rule in (ResidualRule.ROUND_AT_ATTENTION, ResidualRule.NEVER_ROUND) else res
            return out, carried

        return add
