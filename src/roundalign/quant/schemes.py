"""The rollout's quantization as data: ``Scheme``, the built-in schemes by name, and their compressed-tensors config.

A team that samples from a quantized copy of the policy names its scheme in the trainer's profile
(``Profile.quantization``), beside the rounding rules and kernels: ``apply``, ``probe``, ``dump`` and the
integrations then all carry it. A scheme says what the engine serves for every linear layer but the lm_head:

- the weight grid (``int8``, ``int4``, ``fp8``: E4M3), its granularity (per output ``channel``, or per ``group`` of
  ``group_size`` inputs) and whether it has zero points (``symmetric``);
- how the engine quantizes activations at run time (``activations``): not at all (weight-only, bf16 activations,
  dequantized weights), or dynamically per token (one scale per row, computed from the row's absolute maximum).

The built-ins are what vLLM's CPU build serves from a compressed-tensors checkpoint (docs/quantization.md):
``w8a8-int8`` (llm-compressor's W8A8 int8: per-channel weights, dynamic per-token activations), ``w4a16`` (GPTQ/AWQ-
style 4-bit groups of 128, symmetric), ``w4a16-g32`` (groups of 32), ``w4a16-zp`` and ``w4a16-g32-zp`` (with zero
points), and ``fp8`` (llm-compressor's FP8_DYNAMIC: E4M3 per-channel weights, dynamic per-token E4M3 activations;
vLLM's CPU build fails to load per-tensor FP8, so there is no per-tensor scheme); ``fp8-online`` is vLLM quantizing
the bf16 checkpoint itself at load (``quantization="fp8_per_channel"``), in its own arithmetic. ``none`` is the bf16
engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from roundalign.errors import UserError

# The linear layers a dense decoder serves quantized (compressed-tensors' targets ["Linear"], ignore ["lm_head"]).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WEIGHT_GRIDS = {"int8": (-128, 127), "int4": (-8, 7), "fp8": (-448.0, 448.0)}  # (lowest, highest) code


@dataclass(frozen=True)
class Scheme:
    """One quantization scheme. ``str(scheme)`` is its name, as profiles and reports write it."""

    name: str
    weights: str = "bf16"  # "bf16" (no quantization), or a key of WEIGHT_GRIDS
    strategy: str = "channel"  # "channel" or "group": one scale per output row, or per group of its inputs
    group_size: int | None = None  # inputs per scale under "group"
    symmetric: bool = True  # False: a zero point per scale (codes shifted by it)
    activations: str = "none"  # "none" (bf16 activations), "int8-token" or "fp8-token" (dynamic, one scale per row)
    # vLLM quantizes the bf16 checkpoint itself at load (its ``quantization=`` argument, e.g. "fp8_per_channel"),
    # in its own arithmetic (fp32 scales), instead of serving a quantized checkpoint: None for checkpoint schemes.
    online: str | None = None
    description: str = ""

    def __str__(self) -> str:
        return self.name

    @property
    def quantized(self) -> bool:
        return self.weights != "bf16"

    @property
    def weight_only(self) -> bool:
        return self.activations == "none"

    @property
    def grid(self) -> tuple:
        """(lowest, highest) weight code."""
        return WEIGHT_GRIDS[self.weights]

    @property
    def bits(self) -> int:
        return {"int8": 8, "int4": 4, "fp8": 8}[self.weights]

    @classmethod
    def parse(cls, value: str | Scheme, what: str = "quantization") -> Scheme:
        if isinstance(value, cls):
            return value
        scheme = SCHEMES.get(str(value))
        if scheme is None:
            raise UserError(f"unknown {what} scheme {value!r}; choose one of {', '.join(SCHEMES)}")
        return scheme

    def check_shape(self, name: str, out_features: int, in_features: int) -> None:
        """Refuse a weight the engine's kernel cannot serve in this scheme, naming the constraint."""
        if self.strategy == "group" and in_features % self.group_size:
            raise UserError(
                f"{name}: {in_features} inputs are not a multiple of {self}'s group size {self.group_size}; choose a "
                "scheme with a group size that divides every linear layer's input size (w4a16-g32), or none"
            )
        if self.weights == "int4" and (in_features % 32 or out_features % 32):
            raise UserError(
                f"{name}: vLLM's CPU 4-bit GEMM (cpu_gemm_wna16) needs input and output sizes that are multiples of "
                f"32; this layer is {out_features} x {in_features}. Serve it in w8a8-int8 or bf16"
            )

    def compressed_tensors_config(self) -> dict:
        """The ``quantization_config`` block of a compressed-tensors checkpoint in this scheme (the format vLLM's
        ``CompressedTensorsConfig`` reads): one config group over every ``Linear``, the lm_head left in bf16."""
        if not self.quantized:
            raise UserError("the bf16 scheme ('none') has no quantization config; a bf16 checkpoint is plain HF")
        if self.online:
            raise UserError(
                f"{self} is quantized by vLLM itself at load (quantization={self.online!r}) from the bf16 "
                f"checkpoint; there is no quantized checkpoint to write. Serve the bf16 model with that option "
                f"(roundalign dump --quantization {self} does)"
            )
        weights = {
            "num_bits": self.bits,
            "type": "float" if self.weights == "fp8" else "int",
            "symmetric": self.symmetric,
            "strategy": self.strategy,
            "group_size": self.group_size,
            "dynamic": False,
            "actorder": None,
            "observer": "minmax",
        }
        activations = None
        if self.activations in ("int8-token", "fp8-token"):
            activations = {
                "num_bits": 8, "type": "float" if self.activations == "fp8-token" else "int", "symmetric": True,
                "strategy": "token", "group_size": None, "dynamic": True, "actorder": None, "observer": None,
            }  # fmt: skip
        formats = {"int8": "int-quantized", "int4": "pack-quantized", "fp8": "float-quantized"}
        return {
            "quant_method": "compressed-tensors",
            "format": formats[self.weights],
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": weights,
                    "input_activations": activations,
                    "output_activations": None,
                    "format": formats[self.weights],
                },
            },  # fmt: skip
            "ignore": ["lm_head"],
            "kv_cache_scheme": None,
        }


NONE = Scheme("none", description="bf16 weights and activations: the engine serves the bf16 copy")

SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in [
        NONE,
        Scheme(
            "w8a8-int8",
            weights="int8",
            strategy="channel",
            activations="int8-token",
            description="int8 weights, one scale per output channel; int8 activations, one dynamic scale per token",
        ),
        Scheme(
            "fp8",
            weights="fp8",
            strategy="channel",
            activations="fp8-token",
            description="FP8 E4M3 weights, one scale per output channel; FP8 activations, one dynamic scale per token "
            "(llm-compressor's FP8_DYNAMIC)",
        ),
        Scheme(
            "fp8-online",
            weights="fp8",
            strategy="channel",
            activations="fp8-token",
            online="fp8_per_channel",
            description="FP8 as vLLM quantizes a bf16 checkpoint at load (quantization='fp8_per_channel'): per-channel "
            "E4M3 weights with fp32 scales, dynamic per-token activations",
        ),
        Scheme("w4a16", weights="int4", strategy="group", group_size=128,
               description="4-bit weights in groups of 128 inputs, symmetric (GPTQ/AWQ-style); bf16 activations"),
        Scheme("w4a16-g32", weights="int4", strategy="group", group_size=32,
               description="4-bit weights in groups of 32 inputs, symmetric; bf16 activations"),
        Scheme("w4a16-zp", weights="int4", strategy="group", group_size=128, symmetric=False,
               description="4-bit weights in groups of 128 inputs, with a zero point per group; bf16 activations"),
        Scheme("w4a16-g32-zp", weights="int4", strategy="group", group_size=32, symmetric=False,
               description="4-bit weights in groups of 32 inputs, with a zero point per group; bf16 activations"),
    ]
}  # fmt: skip


def from_compressed_tensors(config: dict) -> Scheme:
    """The built-in scheme a checkpoint's ``quantization_config`` describes (``UserError`` if none does)."""
    groups = list((config.get("config_groups") or {}).values())
    if config.get("quant_method") != "compressed-tensors" or len(groups) != 1:
        raise UserError(
            "roundalign reads compressed-tensors checkpoints with one config group (quant_method "
            f"'compressed-tensors'); this one has quant_method {config.get('quant_method')!r} and {len(groups)} "
            "group(s)"
        )
    w, a = groups[0].get("weights") or {}, groups[0].get("input_activations")
    for scheme in SCHEMES.values():
        if not scheme.quantized or scheme.online:
            continue
        ours = scheme.compressed_tensors_config()["config_groups"]["group_0"]
        keys = ("num_bits", "type", "symmetric", "strategy", "group_size")
        same_w = all(w.get(k) == ours["weights"][k] for k in keys)
        ours_a = ours["input_activations"]
        same_a = (a is None) == (ours_a is None) and (
            a is None or all(a.get(k) == ours_a[k] for k in (*keys, "dynamic"))
        )
        if same_w and same_a:
            return scheme
    raise UserError(
        f"this checkpoint's quantization (weights {w}, activations {a}) is none of the schemes roundalign computes "
        f"({', '.join(s for s in SCHEMES if s != 'none')}); docs/quantization.md lists what each one is"
    )


__all__ = ["NONE", "PROJECTIONS", "SCHEMES", "Scheme", "from_compressed_tensors"]
