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

The GPU formats (``nvfp4``, ``nvfp4-te``, ``mxfp4``, ``mxfp4-vllm``, ``mxfp8``, ``fp8-block``) are served by GPU
engines only; here the reference engine and the trainer compute them by emulation from their definitions
(``roundalign.quant.emulated``), both operands quantized, from the bf16 weights. Nothing of them is measured
against a GPU engine yet (docs/quantization.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from roundalign.errors import UserError

# The linear layers a dense decoder serves quantized (compressed-tensors' targets ["Linear"], ignore ["lm_head"]).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WEIGHT_GRIDS = {
    "int8": (-128, 127),
    "int4": (-8, 7),
    "fp8": (-448.0, 448.0),
    # the GPU formats' element grids: E2M1 (FP4) and E4M3, each value times its block's scale
    "nvfp4": (-6.0, 6.0),
    "mxfp4": (-6.0, 6.0),
    "mxfp8": (-448.0, 448.0),
    "fp8-block": (-448.0, 448.0),
}  # (lowest, highest) code
BITS = {"int8": 8, "int4": 4, "fp8": 8, "nvfp4": 4, "mxfp4": 4, "mxfp8": 8, "fp8-block": 8}


@dataclass(frozen=True)
class Scheme:
    """One quantization scheme. ``str(scheme)`` is its name, as profiles and reports write it."""

    name: str
    weights: str = "bf16"  # "bf16" (no quantization), or a key of WEIGHT_GRIDS
    strategy: str = "channel"  # "channel", "group" (per group of a row's inputs) or "block" (a GPU format's blocks)
    group_size: int | None = None  # inputs per scale under "group"
    symmetric: bool = True  # False: a zero point per scale (codes shifted by it)
    activations: str = "none"  # "none" (bf16 activations), "int8-token" or "fp8-token" (dynamic, one scale per row)
    # vLLM quantizes the bf16 checkpoint itself at load (its ``quantization=`` argument, e.g. "fp8_per_channel"),
    # in its own arithmetic (fp32 scales), instead of serving a quantized checkpoint: None for checkpoint schemes.
    online: str | None = None
    # A GPU format (NVFP4, MXFP4, MXFP8, blockwise FP8) that the reference engine and the trainer emulate from its
    # definition (roundalign.quant.emulated); ``convention``: whose rounding or scale convention, where sources
    # differ (NVFP4: "vllm" or "te"; MXFP4: "ocp" or "vllm").
    emulated: bool = False
    convention: str = ""
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
    def from_bf16(self) -> bool:
        """Whether the engine is given the bf16 copy and quantizes it itself (an online scheme, an emulated GPU
        format) rather than a quantized checkpoint: Fair Cast then exports the bf16 copy."""
        return self.online is not None or self.emulated

    @property
    def grid(self) -> tuple:
        """(lowest, highest) weight code."""
        return WEIGHT_GRIDS[self.weights]

    @property
    def bits(self) -> int:
        return BITS[self.weights]

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
        if self.emulated:
            rows, cols = {"nvfp4": (1, 16), "mxfp4": (1, 32), "mxfp8": (1, 32), "fp8-block": (128, 128)}[self.weights]
            if in_features % cols or out_features % rows:
                raise UserError(
                    f"{name}: {self} scales blocks of {rows} x {cols} weights; this layer is {out_features} x "
                    f"{in_features}, not a multiple of that. Choose a format whose blocks divide every linear layer "
                    "(nvfp4 blocks 16 inputs, mxfp4 and mxfp8 32), or none"
                )
            return
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

    def check_vllm_cpu(self) -> None:
        """Refuse a GPU format where vLLM's CPU build would serve it (it serves none of them), naming the fix."""
        if self.emulated:
            raise UserError(
                f"{self} is a GPU format; vLLM's CPU build serves none of NVFP4, MXFP4, MXFP8 or blockwise FP8. "
                "roundalign emulates it in its reference engine and trainer (drop --engine vllm); with vLLM here, "
                "serve w8a8-int8, w4a16 or fp8"
            )

    def compressed_tensors_config(self) -> dict:
        """The ``quantization_config`` block of a compressed-tensors checkpoint in this scheme (the format vLLM's
        ``CompressedTensorsConfig`` reads): one config group over every ``Linear``, the lm_head left in bf16."""
        if not self.quantized:
            raise UserError("the bf16 scheme ('none') has no quantization config; a bf16 checkpoint is plain HF")
        if self.emulated:
            raise UserError(
                f"{self} is a GPU format that roundalign emulates in its reference engine and trainer; vLLM's CPU "
                "build serves none of the GPU formats, so roundalign writes no checkpoint in it. Use a scheme vLLM's "
                "CPU build serves (w8a8-int8, w4a16, fp8), or the reference engine"
            )
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
        # The GPU formats, emulated (roundalign.quant.emulated: what each computes, and from which source).
        Scheme("nvfp4", weights="nvfp4", strategy="block", group_size=16, activations="nvfp4", emulated=True,
               convention="vllm",
               description="NVFP4 W4A4 (E2M1 values, an E4M3 scale per 16, an fp32 global scale), vLLM's reference "
               "quantizer and emulated linear; activations' global scale from each token's amax"),
        Scheme("nvfp4-te", weights="nvfp4", strategy="block", group_size=16, activations="nvfp4", emulated=True,
               convention="te",
               description="NVFP4 W4A4 in TransformerEngine's convention (the global scale stored as amax / "
               "(448 * 6), dividing)"),
        Scheme("mxfp4", weights="mxfp4", strategy="block", group_size=32, activations="mxfp4", emulated=True,
               convention="ocp",
               description="MXFP4 W4A4 (E2M1 values, a power-of-two E8M0 scale per 32), the OCP reference's "
               "rounding"),
        Scheme("mxfp4-vllm", weights="mxfp4", strategy="block", group_size=32, activations="mxfp4", emulated=True,
               convention="vllm",
               description="MXFP4 W4A4 with vLLM's shared exponent (amax rounded up a binade from 1.75) and "
               "ties-to-even elements"),
        Scheme("mxfp8", weights="mxfp8", strategy="block", group_size=32, activations="mxfp8", emulated=True,
               description="MXFP8 W8A8 (E4M3 values, a power-of-two E8M0 scale per 32)"),
        Scheme("fp8-block", weights="fp8-block", strategy="block", group_size=128, activations="fp8-1x128",
               emulated=True,
               description="blockwise FP8 (DeepSeek-style, verl's FP8 rollouts): E4M3 weights with an fp32 scale per "
               "128 x 128 block, activations with a dynamic fp32 scale per 1 x 128"),
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
        if not scheme.quantized or scheme.from_bf16:
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
    known = ", ".join(s for s, v in SCHEMES.items() if v.quantized and not v.from_bf16)
    raise UserError(
        f"this checkpoint's quantization (weights {w}, activations {a}) is none of the schemes roundalign reads "
        f"from a checkpoint ({known}); docs/quantization.md lists what each one is"
    )


__all__ = ["NONE", "PROJECTIONS", "SCHEMES", "Scheme", "from_compressed_tensors"]
