"""The GPU formats (``roundalign.quant.formats``) against their sources: the engines' own quantizers where they run
on a CPU (vLLM 0.32's NVFP4 reference and MXFP8 quantizer, verl's blockwise FP8 export), and scalar references
written here from the definitions for the rest (E2M1 rounding both ways, TransformerEngine's NVFP4 convention, MXFP4
by the OCP reference code's rules and by vLLM's). Bitwise throughout. Nothing here is measured against a GPU.
"""

from __future__ import annotations

import math
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from roundalign.quant import formats
from tests import quant_formulas as ref
from tests.quant_formats_producers import inputs

HERE = Path(__file__).parent
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # index parity = mantissa parity: even indices are "even"


def e2m1_ref(v: float, ties: str) -> float:
    """The E2M1 value nearest ``v`` (saturating at 6); a tie goes to the even value or away from zero."""
    a = min(abs(v), 6.0)
    best = min(range(8), key=lambda i: (abs(E2M1[i] - a), (i % 2) if ties == "even" else -i))
    return math.copysign(E2M1[best], v)


def fp32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def test_e2m1_rounds_to_nearest_with_either_tie_rule():
    values = [i / 64 for i in range(-512, 513)] + [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 100.0, -5.0]
    x = torch.tensor(values)
    assert torch.equal(formats.e2m1(x), torch.tensor([e2m1_ref(v, "even") for v in values]))
    assert torch.equal(formats.e2m1_away(x), torch.tensor([e2m1_ref(v, "away") for v in values]))


@pytest.fixture(scope="module")
def vllm_outputs(engine_python, tmp_path_factory):
    out = tmp_path_factory.mktemp("formats") / "vllm.safetensors"
    proc = subprocess.run([engine_python, str(HERE / "quant_formats_producers.py"), "vllm", str(out)],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(str(out))


def test_nvfp4_is_vllms_reference_quantizer(vllm_outputs):
    x = inputs()["x"]
    gs = (448.0 * 6.0) / x.abs().amax().float()
    q = formats.nvfp4(x, gs, "vllm")
    assert torch.equal(q.codes, vllm_outputs["nvfp4_codes"]) and torch.equal(q.scales, vllm_outputs["nvfp4_scales"])
    assert torch.equal(
        formats.nvfp4(x.bfloat16(), gs, "vllm").dequantize(torch.bfloat16), vllm_outputs["nvfp4_qdq_bf16"]
    )
    assert torch.equal(formats.nvfp4_global_scale(x.abs().amax(), "vllm"), gs)


def test_mxfp8_is_vllms_quantizer(vllm_outputs):
    q = formats.mxfp8(inputs()["x"])
    assert torch.equal(q.codes, vllm_outputs["mxfp8_codes"])
    assert torch.equal(torch.log2(q.scales) + 127, vllm_outputs["mxfp8_scales"].float())  # E8M0's biased exponent


def test_blockwise_fp8_is_verls_export(verl_python, tmp_path):
    out = tmp_path / "verl.safetensors"
    proc = subprocess.run([verl_python, str(HERE / "quant_formats_producers.py"), "verl", str(out)],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = load_file(str(out))
    for key in ("w", "w_tiles"):
        q = formats.fp8_blockwise(inputs()[key])
        assert torch.equal(q.codes, theirs[f"{key}_fp8_codes"]), key
        assert torch.equal(q.scales, theirs[f"{key}_fp8_descale"].squeeze(-1)), key
    assert torch.equal(formats.fp8_blockwise(inputs()["w"]).scales[0, 0], torch.tensor(1.0))  # the zero tile: 1


def test_nvfp4_te_convention_from_its_definition():
    """TransformerEngine's NVFP4: ``g = amax / (448 * 6)`` stored, ``s = e4m3((block_amax / 6) / g)``, ``q =
    e2m1(x / (s * g))`` ties to even, value ``q * s * g``; each operation one fp32 rounding."""
    x = inputs()["x"][:4]
    amax = float(x.abs().amax())
    g = ref.f32(amax / 2688.0)
    q = formats.nvfp4(x, convention="te")
    assert float(q.global_scale) == g
    for r in range(x.shape[0]):
        for blk in range(x.shape[1] // 16):
            vals = [float(v) for v in x[r, 16 * blk : 16 * blk + 16]]
            bmax = max(abs(v) for v in vals)
            s = ref.e4m3(min(ref.f32(ref.f32(bmax / 6.0) / g), 448.0))
            assert float(q.scales[r, blk]) == s
            denom = ref.f32(s * g)
            for j, v in enumerate(vals):
                code = 0.0 if s == 0 else e2m1_ref(max(min(ref.f32(v / denom), 6.0), -6.0), "even")
                assert float(q.codes[r, 16 * blk + j]) == code
    assert torch.equal(q.dequantize(), q.codes * (q.scales * q.global_scale).repeat_interleave(16, 1))


@pytest.mark.parametrize("rounding", ["ocp", "ocp-even", "vllm"])
def test_mxfp4_from_each_definition(rounding):
    """The shared exponent from ``amax``'s bits (``floor(log2 amax)`` is its unbiased exponent; vLLM first adds
    ``0x200000`` to them), clamped to +-127; elements ``x / 2^e`` to E2M1, ties away from zero (the OCP reference
    code's default) or to even."""
    x = inputs()["x"][:6]
    x[2, :32] = torch.tensor([1.75 * 2.0**k for k in range(-4, 28)])  # significands at vLLM's rounding point
    q = formats.mxfp4(x, rounding)
    for r in range(x.shape[0]):
        for blk in range(x.shape[1] // 32):
            vals = [float(v) for v in x[r, 32 * blk : 32 * blk + 32]]
            bits = fp32_bits(max(abs(v) for v in vals))
            if rounding == "vllm":
                bits = (bits + 0x200000) & 0x7F800000
            biased = bits >> 23 & 0xFF
            exponent = max(min((biased - 127 if biased else -126) - 2, 127), -127)
            assert float(q.scales[r, blk]) == 2.0**exponent
            for j, v in enumerate(vals):
                code = e2m1_ref(v / 2.0**exponent, "away" if rounding == "ocp" else "even")
                assert float(q.codes[r, 32 * blk + j]) == code, (r, blk, j, v)
    assert torch.equal(q.dequantize(), q.codes * q.scales.repeat_interleave(32, 1))


def test_mxfp4_roundings_differ_where_the_sources_say():
    """A block whose largest value has a significand of 1.75 or more: vLLM scales it one binade further (its
    largest value lands on 4, not saturated at 6); the OCP rules saturate it at 6. Ties between E2M1 values go
    away from zero in the OCP reference code's default and to even elsewhere."""
    row = torch.zeros(1, 32)
    row[0, 0], row[0, 1] = 7.5, 2.5  # amax 7.5 = 1.875 * 2^2; 2.5 is a tie between 2 and 3 at exponent 0
    ocp, even, vllm = (formats.mxfp4(row, r) for r in ("ocp", "ocp-even", "vllm"))
    assert float(ocp.scales[0, 0]) == float(even.scales[0, 0]) == 1.0 and float(vllm.scales[0, 0]) == 2.0
    assert (float(ocp.codes[0, 0]), float(vllm.codes[0, 0])) == (6.0, 4.0)
    assert (float(ocp.codes[0, 1]), float(even.codes[0, 1])) == (3.0, 2.0)


def test_format_errors():
    with pytest.raises(ValueError, match="blocks"):
        formats.mxfp4(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="'vllm' or 'te'"):
        formats.nvfp4(torch.zeros(1, 16), convention="cuda")
    with pytest.raises(ValueError, match="'ocp', 'ocp-even' or 'vllm'"):
        formats.mxfp4(torch.zeros(1, 32), rounding="aiter")


def test_the_gpu_check_script_runs_cpu_against_cpu(tmp_path):
    """scripts/gpu_quant_check.py, ready for a GPU machine: its smoke run here compares the CPU with itself, so every
    check must come out equal (on a GPU, fp8_linear against hardware FP8 is expected not to)."""
    import json
    import sys

    out = tmp_path / "cpu.json"
    script = HERE.parent / "scripts" / "gpu_quant_check.py"
    proc = subprocess.run([sys.executable, str(script), "--device", "cpu", "--out", str(out)], capture_output=True,
                          text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    checks = [c for group in ("formats", "grid_export") for case in result[group].values()
              for c in (case.values() if "equal" not in case else [case])]  # fmt: skip
    checks += [*result["linear"].values(), *result["emulated_linear"].values(), result["fp8_block_scaled_mm"]]
    checks += list(result["trainer"].values())
    # codes and scales of 7 formats, 6 grid exports, 2 linears, 6 emulated linears, the block GEMM, 9 trainers
    assert len(checks) == 7 * 2 + 6 + 2 + 6 + 1 + 9, len(checks)
    assert all(c["equal"] for c in checks), [c for c in checks if not c["equal"]]


# --------------------------------------------------------------------- the formats as served layers (emulated)


def test_emulated_nvfp4_linear_is_vllms(vllm_outputs):
    """The NVFP4 layer the reference engine and the trainer compute is vLLM's own emulated NVFP4 linear
    (run_nvfp4_emulations on a packed NVFP4 weight), bit for bit, each token with its own global scale."""
    from roundalign.quant import SCHEMES, emulated

    w, x = inputs()["w"].t().contiguous(), inputs()["x"].bfloat16()
    out = emulated.linear(SCHEMES["nvfp4"])(x, emulated.quantize_weight(w, SCHEMES["nvfp4"]))
    assert torch.equal(out, vllm_outputs["nvfp4_linear_bf16"])


def test_blockwise_fp8_activations_are_vllms_group_quantizer(vllm_outputs):
    from roundalign.quant import emulated

    codes, scales = emulated.quantize_activations_1x128(inputs()["x"])
    assert torch.equal(codes, vllm_outputs["fp8_1x128_codes"]) and torch.equal(scales, vllm_outputs["fp8_1x128_scales"])


def test_emulated_mx_linears_multiply_the_dequantized_operands():
    """MXFP8 and MXFP4 W8A8 / W4A4: both operands quantized by the format's quantizer (test_mxfp8_is_vllms_quantizer,
    test_mxfp4_from_each_definition) and dequantized (exact: a grid value times a power of two), then torch's bf16
    linear, as vLLM's MX emulation kernels compute it."""
    from roundalign.quant import SCHEMES, emulated

    x, w = inputs()["x"].bfloat16(), inputs()["w"].t().contiguous()
    for name, quantize in (("mxfp8", formats.mxfp8), ("mxfp4", formats.mxfp4),
                           ("mxfp4-vllm", lambda t: formats.mxfp4(t, "vllm"))):  # fmt: skip
        out = emulated.linear(SCHEMES[name])(x, emulated.quantize_weight(w, SCHEMES[name]))
        expected = torch.nn.functional.linear(
            quantize(x.float()).dequantize(torch.bfloat16), quantize(w.float()).dequantize(torch.bfloat16)
        )
        assert torch.equal(out, expected), name


def test_block_gemm_is_the_definition():
    """Blockwise FP8's GEMM from its definition, scalar by scalar: for each 128-wide slice in order, the exact dot
    product of the codes (math.fsum) rounded to fp32, times the activation's scale times the weight block's scale
    (fp32 products), added to an fp32 accumulator."""
    from roundalign.quant import emulated

    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 256, generator=g) * torch.logspace(-2, 1, 256)
    w = torch.randn(256, 256, generator=g) * 0.05
    a, a_scale = emulated.quantize_activations_1x128(x)
    b = formats.fp8_blockwise(w)
    out = emulated.block_gemm(a, a_scale, b.codes, b.scales)
    f32 = ref.f32
    for m in range(3):
        for n in range(0, 256, 37):  # a spread of outputs over both weight blocks
            acc = 0.0
            for s in range(2):
                dot = f32(math.fsum(float(a[m, k]) * float(b.codes[n, k]) for k in range(128 * s, 128 * s + 128)))
                scale = f32(float(a_scale[m, s]) * float(b.scales[n // 128, s]))
                acc = f32(acc + f32(dot * scale))
            assert fp32_bits(float(out[m, n])) == fp32_bits(acc), (m, n)


def test_nvfp4_fused_projections_share_one_global_scale():
    """vLLM serves a fused q/k/v (gate/up) NVFP4 layer with one global scale, and llm-compressor writes the shards
    with the one from their joint amax: 448 * 6 / max(amax_q, amax_k, amax_v)."""
    import roundalign
    from roundalign.quant import SCHEMES, emulated
    from tests.test_engine_matches_trainer import trainer_model

    model = trainer_model("qwen3", num_hidden_layers=1)
    roundalign.apply(model, "vllm+quantization=nvfp4")
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, 4, model.config.hidden_size).bfloat16()
    roundalign.kernels.project(attn, ("q_proj", "k_proj", "v_proj"), x, attn._roundalign_gemm)
    weights = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    joint = max(float(w.float().abs().max()) for w in weights)
    assert float(emulated.fused_amax(weights)) == joint
    shard = emulated.quantize_weight(attn.k_proj.weight, SCHEMES["nvfp4"], emulated.fused_amax(weights))
    assert float(shard.global_scale) == ref.f32(ref.f32(448.0 * 6.0) / joint)


def test_gpu_formats_are_refused_where_they_cannot_run(tmp_path):
    import roundalign
    from roundalign.engines.dump import DumpConfig
    from roundalign.errors import UserError
    from roundalign.quant import SCHEMES
    from tests.test_engine_matches_trainer import trainer_model

    with pytest.raises(UserError, match="vLLM's CPU build serves none of NVFP4"):
        DumpConfig(engine="vllm", quantization="nvfp4", out=str(tmp_path)).validate()
    with pytest.raises(UserError, match="no kernel for it"):
        roundalign.apply(trainer_model("qwen3", num_hidden_layers=1), "vllm-0.32-cpu-eager-kernels+quantization=mxfp4")
    with pytest.raises(UserError, match="blocks of 128 x 128 weights; this layer is 256 x 320"):
        SCHEMES["fp8-block"].check_shape("down_proj", 256, 320)
    with pytest.raises(UserError, match="roundalign writes no checkpoint"):
        SCHEMES["mxfp8"].compressed_tensors_config()
