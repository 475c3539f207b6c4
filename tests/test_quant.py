"""Quantized rollouts without vLLM: the quantizers against the formats' definitions, the checkpoint layout, the
profile field, the reference engine against the trainer, the straight-through backward, and the errors.

The bitwise tests against the real vLLM are tests/test_quant_vllm.py; the independent producer (compressed-tensors
itself) is there too, where it is installed.
"""

from __future__ import annotations

import json

import pytest
import torch

import roundalign
from roundalign.engine import Engine
from roundalign.errors import UserError
from roundalign.profiles import Profile, get_profile
from roundalign.quant import SCHEMES, Scheme, checkpoint, from_compressed_tensors, grid
from roundalign.trainer import TrainerSide
from tests import quant_formulas as ref
from tests.test_engine_matches_trainer import sequences, trainer_logprobs, trainer_model

QUANTIZED = [s for s in SCHEMES if s != "none"]
CHECKPOINTS = [s for s in QUANTIZED if not SCHEMES[s].from_bf16]  # written as a checkpoint (else the engine quantizes)


def _weights(rows=64, cols=256, seed=0, scale=0.05) -> torch.Tensor:
    """bf16 weights with the cases a quantizer can get wrong: a zero row, a row of one sign, a constant row, and
    values on exact ties of the grid."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * scale
    w[0] = 0.0
    w[1] = w[1].abs()
    w[2] = -0.03
    w[3, :8] = torch.tensor([0.5, -0.5, 0.25, 0.125, 1.0, -1.0, 0.0, 0.75]) * scale
    return w.to(torch.bfloat16)


@pytest.mark.parametrize("name", [s for s in CHECKPOINTS if SCHEMES[s].weights != "fp8"])
def test_integer_weights_match_the_definition(name):
    scheme = SCHEMES[name]
    w = _weights()
    q = grid.quantize_weight(w, scheme)
    group = scheme.group_size or w.shape[1]
    for row in range(w.shape[0]):
        for start in range(0, w.shape[1], group):
            values = [float(v) for v in w[row, start : start + group].float()]
            codes, scale, zero = ref.int_codes(values, scheme.bits, scheme.symmetric)
            g = start // group
            assert q.codes[row, start : start + group].tolist() == codes, (row, g)
            assert float(q.scale[row, g]) == scale, (row, g)
            assert (0 if q.zero_point is None else int(q.zero_point[row, g])) == zero, (row, g)


@pytest.mark.parametrize("name", ["fp8", "fp8-online"])
def test_fp8_weights_match_the_definition(name):
    w = _weights(rows=24, cols=64)
    q = grid.quantize_weight(w, SCHEMES[name])
    assert q.codes.dtype == torch.float8_e4m3fn
    formula = ref.fp8_online_codes if SCHEMES[name].online else ref.fp8_codes
    for row in range(w.shape[0]):
        codes, scale = formula([float(v) for v in w[row].float()])
        assert q.codes[row].float().tolist() == codes, row
        assert float(q.scale[row, 0]) == scale, row
    assert q.scale.dtype == (torch.float32 if SCHEMES[name].online else torch.bfloat16)


def test_dequantize_is_code_minus_zero_point_times_scale_rounded_once():
    w = _weights()
    q = grid.quantize_weight(w, SCHEMES["w4a16-g32-zp"])
    scale = q.scale.float().repeat_interleave(32, dim=1)
    zero = q.zero_point.float().repeat_interleave(32, dim=1)
    expected = ((q.codes.float() - zero) * scale).to(torch.bfloat16)
    assert torch.equal(q.dequantize(), expected)


def test_int4_packing_is_the_pack_quantized_layout():
    g = torch.Generator().manual_seed(3)
    values = torch.randint(-8, 8, (16, 64), generator=g, dtype=torch.int8)
    packed = grid.pack_int4(values, dim=1)
    assert packed.dtype == torch.int32 and packed.shape == (16, 8)
    for row in range(16):
        assert packed[row].tolist() == ref.pack_nibbles(values[row].tolist())
    assert torch.equal(grid.unpack_int4(packed, dim=1), values)
    along_rows = grid.pack_int4(values, dim=0)  # zero points pack along the output dimension
    assert along_rows.shape == (2, 64)
    assert along_rows[:, 5].tolist() == ref.pack_nibbles(values[:, 5].tolist())
    assert torch.equal(grid.unpack_int4(along_rows, dim=0), values)


def test_activation_quantizers_match_vllms():
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(6, 96, generator=g) * 3).to(torch.bfloat16)
    x[2] = 0.0  # a zero row: scale 0, codes 0 (int8); the floor scale (FP8)
    codes, scale = grid.quantize_activations(x)
    codes8, scale8 = grid.quantize_activations_fp8(x)
    for row in range(x.shape[0]):
        values = [float(v) for v in x[row].float()]
        want, want_scale = ref.int8_token(values)
        assert codes[row].tolist() == want and float(scale[row, 0]) == want_scale, row
        want, want_scale = ref.fp8_token(values)
        assert codes8[row].float().tolist() == want and float(scale8[row, 0]) == want_scale, row


def test_int8_linear_is_the_integer_gemm_with_vllms_epilogue():
    """The exact integer GEMM, then (acc * s_w) * s_x, or fma(acc * s_w, s_x, b), in fp32. Weight codes within
    [-64, 64]: on CPUs without VNNI (AVX2 only) oneDNN's s8s8 GEMM, torch._int_mm's and vLLM's alike, saturates
    pairs of products at int16 (its ``vpmaddubsw``; oneDNN's documentation says so), which no pair of such codes
    can reach; the full range is checked against vLLM itself (tests/test_quant_vllm.py)."""
    g = torch.Generator().manual_seed(5)
    weight = grid.Quantized(
        torch.randint(-64, 65, (32, 64), generator=g, dtype=torch.int8),
        (torch.rand(32, 1, generator=g) * 0.01).to(torch.bfloat16),
        None,
    )
    x = (torch.randn(5, 64, generator=g) * 3).to(torch.bfloat16)
    bias = torch.randn(32, generator=g).to(torch.bfloat16)
    codes, scale = grid.quantize_activations(x)
    acc = codes.long() @ weight.codes.long().t()  # exact in int64
    scaled = acc.float() * weight.scale.float().view(1, -1)
    assert torch.equal(grid.int8_linear(x, weight), (scaled * scale).to(torch.bfloat16))
    # With a bias, one fused multiply-add (one rounding to fp32), written here with exact rationals.
    from fractions import Fraction

    got = grid.int8_linear(x, weight, bias)
    for i, j in [(0, 0), (1, 7), (4, 31), (2, 16)]:
        exact = Fraction(float(scaled[i, j])) * Fraction(float(scale[i, 0])) + Fraction(float(bias[j]))
        want = torch.tensor(ref.f32(float(exact)), dtype=torch.float32).to(torch.bfloat16)
        assert torch.equal(got[i, j], want), (i, j)


# ----------------------------------------------------------------------------------------------- checkpoint


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_checkpoint_round_trip(name, tmp_path):
    from roundalign import models

    scheme = SCHEMES[name]
    out = checkpoint.write(models.path(), tmp_path / "served", scheme)
    config = json.loads((out / "config.json").read_text())
    assert from_compressed_tensors(config["quantization_config"]) is scheme
    assert (out / "tokenizer.json").is_file()
    read_scheme, linears = checkpoint.read(out)
    assert read_scheme is scheme
    from safetensors.torch import load_file

    source = load_file(str(models.path() / "model.safetensors"))
    quantized = {k.removesuffix(".weight") for k, v in source.items() if checkpoint.is_quantized_linear(k, v)}
    assert set(linears) == quantized and len(quantized) == 7 * 4  # every projection of the 4 layers
    for name_, q in linears.items():
        again = grid.quantize_weight(source[f"{name_}.weight"], scheme)
        assert torch.equal(q.codes.view(torch.int8), again.codes.view(torch.int8)), name_
        assert torch.equal(q.scale, again.scale), name_
    served = load_file(str(out / "model.safetensors"))
    assert torch.equal(served["lm_head.weight"], source["lm_head.weight"])  # the lm_head stays bf16


def test_checkpoint_refuses_to_overwrite_a_model(tmp_path):
    from roundalign import models

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text("{}")
    with pytest.raises(UserError, match="not a quantized checkpoint"):
        checkpoint.write(models.path(), tmp_path / "mine", SCHEMES["w8a8-int8"])
    served = checkpoint.write(models.path(), tmp_path / "served", SCHEMES["w4a16"])
    checkpoint.write(models.path(), served, SCHEMES["w8a8-int8"])  # a served copy is replaced whole
    assert checkpoint.read(served)[0].name == "w8a8-int8"
    with pytest.raises(UserError, match="already quantized"):
        checkpoint.write(served, tmp_path / "again", SCHEMES["w4a16"])


def test_online_schemes_have_no_checkpoint(tmp_path):
    from roundalign import models

    with pytest.raises(UserError, match="quantized by vLLM itself at load .*fp8_per_channel"):
        checkpoint.write(models.path(), tmp_path / "served", SCHEMES["fp8-online"])


def test_unknown_checkpoint_schemes_are_named():
    config = SCHEMES["w4a16"].compressed_tensors_config()
    config["config_groups"]["group_0"]["weights"]["group_size"] = 64
    with pytest.raises(UserError, match="none of the schemes"):
        from_compressed_tensors(config)
    with pytest.raises(UserError, match="quant_method"):
        from_compressed_tensors({"quant_method": "gptq"})


# ---------------------------------------------------------------------------------------------------- profile


def test_profiles_carry_the_scheme():
    p = get_profile("vllm-0.32-cpu-eager-kernels+quantization=w8a8-int8")
    assert p.quantization is SCHEMES["w8a8-int8"]
    assert p.rounding_only().name == "vllm-0.32-cpu-eager+quantization=w8a8-int8"
    assert p.rounding_only().replace(quantization="none").name == "vllm-0.32-cpu-eager"
    assert not p.same_rules("vllm-0.32-cpu-eager-kernels")
    assert Profile.from_dict(p.to_dict()) == p
    assert Profile.from_dict({k: v for k, v in get_profile("vllm").to_dict().items() if k != "quantization"}) == (
        get_profile("vllm")
    )  # profile files written before quantization existed read as bf16
    with pytest.raises(UserError, match="unknown quantization scheme 'int3'"):
        get_profile("vllm+quantization=int3")


def test_scheme_shapes_are_checked():
    with pytest.raises(UserError, match="not a multiple of w4a16's group size 128"):
        SCHEMES["w4a16"].check_shape("model.layers.0.mlp.down_proj", 256, 96)
    with pytest.raises(UserError, match="multiples of 32"):
        SCHEMES["w4a16-g32"].check_shape("q_proj", 48, 64)
    SCHEMES["w8a8-int8"].check_shape("q_proj", 48, 96)  # no constraint


# ------------------------------------------------------------------------------------------ engine vs trainer


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("name", QUANTIZED)
def test_reference_engine_matches_the_quantized_trainer(family, name):
    """The reference engine serving the scheme (its own quantized copy of its served weights, its own layer loop)
    and the trainer with the same profile give the same log-probs bit for bit; the bf16 trainer does not."""
    model = trainer_model(family, num_hidden_layers=2)
    profile = f"vllm-reference-kernels+quantization={name}"
    engine = Engine(model, profile=profile)
    seqs = sequences(model.config.vocab_size, lengths=(9, 40))
    scored = [engine.score([s[:3]], [s[3:]], mode="prefill")[0] for s in seqs]
    bf16 = [trainer_logprobs(model, s)[2:-1].gather(1, torch.tensor(s[3:])[:, None])[:, 0] for s in seqs]
    roundalign.apply(model, profile)
    mine = [trainer_logprobs(model, s)[2:-1].gather(1, torch.tensor(s[3:])[:, None])[:, 0] for s in seqs]
    for a, b in zip(mine, scored, strict=True):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(bf16, scored, strict=True))


def test_the_engine_requantizes_after_a_weight_sync():
    model = trainer_model("qwen3", num_hidden_layers=1)
    engine = Engine(model, profile="vllm-reference-kernels+quantization=w8a8-int8")
    ids = sequences(model.config.vocab_size, lengths=(20,))[0]
    before = engine.score([ids[:3]], [ids[3:]], mode="prefill")[0]
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.05)
    engine.load_weights(model.state_dict())
    after = engine.score([ids[:3]], [ids[3:]], mode="prefill")[0]
    fresh = Engine(model, profile="vllm-reference-kernels+quantization=w8a8-int8")
    assert not torch.equal(before, after)
    assert torch.equal(after, fresh.score([ids[:3]], [ids[3:]], mode="prefill")[0])


def test_straight_through_gradients():
    """The backward is that of x @ Q(W)^T with dQ/dW = I: written here with autograd's own linear on the
    dequantized weight, the weight entering through W + (Q(W) - W).detach()."""
    model = trainer_model("qwen3", num_hidden_layers=1).requires_grad_(True)
    roundalign.apply(model, "vllm+quantization=w4a16-g32")
    mlp = model.model.layers[0].mlp
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 5, model.config.hidden_size, generator=g).to(torch.bfloat16).requires_grad_()
    upstream = torch.randn(2, 5, model.config.intermediate_size, generator=g).to(torch.bfloat16)
    gate, _ = roundalign.kernels.project(mlp, ("gate_proj", "up_proj"), x, mlp._roundalign_gemm)
    gate.backward(upstream)
    w = mlp.gate_proj.weight
    deq = grid.quantize_weight(w, SCHEMES["w4a16-g32"]).dequantize()
    w2 = w.detach().clone().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    torch.nn.functional.linear(x2, w2 + (deq - w2).detach()).backward(upstream)
    assert torch.equal(gate.detach(), torch.nn.functional.linear(x.detach(), deq))
    assert torch.equal(x.grad, x2.grad)
    assert torch.equal(w.grad, w2.grad)


# ------------------------------------------------------------------------------------------------------ errors


def test_moe_and_fp16_are_refused_with_the_fix():
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    moe = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with pytest.raises(UserError, match="Qwen3-MoE's experts are not served quantized"):
        roundalign.apply(moe, "vllm+quantization=w8a8-int8")
    with pytest.raises(UserError, match="bf16 activations"):
        Engine(trainer_model("qwen3", num_hidden_layers=1), profile="vllm+quantization=w8a8-int8", dtype=torch.float16)


def test_a_layer_the_scheme_cannot_serve_is_named():
    model = trainer_model("qwen3", num_hidden_layers=1, intermediate_size=320)  # 320 inputs to down_proj
    with pytest.raises(UserError, match="down_proj: 320 inputs are not a multiple of w4a16's group size 128"):
        roundalign.apply(model, "vllm+quantization=w4a16")  # at apply time, not in the first forward


def test_scheme_names():
    assert str(Scheme.parse("w8a8-int8")) == "w8a8-int8"
    with pytest.raises(UserError, match="choose one of none, w8a8-int8, fp8, fp8-online, w4a16"):
        Scheme.parse("int3")


def test_fit_carries_the_served_quantization():
    """A dump from an engine that served w4a16: every candidate fit scores computes the scheme, so the engine's
    rules fit it bit for bit, and the fitted profile names the scheme."""
    from roundalign import models
    from roundalign.fit.dumps import reference_dump
    from roundalign.fit.search import fit
    from roundalign.trainer import load_trainer_model

    model = load_trainer_model(models.path())
    dump = reference_dump("vllm+quantization=w4a16", tokens=120, max_tokens=40)
    result = fit(model, dump, quantization="w4a16", screen_tokens=40)
    assert result.profile.quantization is SCHEMES["w4a16"]
    assert result.best.metrics["mismatch/bitwise_equal_frac"] == 1.0
    assert "vllm" in result.named_matches
    roundalign.apply(model, result.profile)
    for r in dump:
        assert torch.equal(TrainerSide.token_logprobs(model, r), torch.tensor(r.logprobs, dtype=torch.float32))


def test_sync_exports_the_served_copy_from_the_bf16_cast():
    """``roundalign.sync.export_quantized`` quantizes the RNE bf16 copy of an fp32 master, as the checkpoint is
    written from it."""
    from roundalign.sync import export_quantized

    g = torch.Generator().manual_seed(7)
    master = {"model.layers.0.mlp.down_proj.weight": torch.randn(64, 128, generator=g) * 0.05,
              "model.norm.weight": torch.ones(64) + 1e-4}  # fmt: skip
    served = export_quantized(master, "w4a16")
    q = grid.quantize_weight(master["model.layers.0.mlp.down_proj.weight"].to(torch.bfloat16), SCHEMES["w4a16"])
    assert torch.equal(served["model.layers.0.mlp.down_proj.weight_packed"], grid.pack_int4(q.codes, dim=1))
    assert torch.equal(served["model.layers.0.mlp.down_proj.weight_scale"], q.scale)
    assert served["model.norm.weight"].dtype == torch.bfloat16


def test_the_compiled_forward_refuses_a_quantized_engine():
    """vLLM's compiled forward (kernels/graph.py) is its bf16 code: it would leave the scheme out, so it refuses."""
    model = trainer_model("qwen3", num_hidden_layers=1)
    with pytest.raises(UserError, match="enforce_eager mode only"):
        roundalign.apply(model, "vllm-0.32-cpu-compiled-kernels+quantization=w8a8-int8")


@pytest.mark.parametrize("scheme", ["w8a8-int8", "fp8-block"])
def test_train_on_a_quantized_reference_engine_is_exactly_on_policy(scheme, tmp_path):
    """``roundalign train --quantization SCHEME`` with the reference engine (re-quantized after every weight sync),
    for a scheme vLLM's CPU build serves and an emulated GPU format: the trainer with the same profile has
    k3_kl = 0 at every step; the stock bf16 trainer does not."""
    from roundalign.rl.config import TrainConfig
    from roundalign.rl.logbook import read_metrics
    from roundalign.rl.loop import train

    small = dict(prompts_per_step=2, group_size=2, max_tokens=24, eval_problems=4, eval_every=2, lr=1e-4, steps=2)
    profile = "vllm-reference-kernels"  # the engine's decode kernels in the trainer too
    kl = {}
    for trainer in ("engine", "hf"):
        config = TrainConfig(engine_profile=profile, quantization=scheme, trainer_profile=trainer, **small)
        out = train(config.validate(), tmp_path / trainer, progress=False, tensorboard=False)
        kl[trainer] = [r["rollout_corr/k3_kl"] for r in read_metrics(out / "metrics.jsonl") if r["step"] > 0]
        written = json.loads((out / "config.json").read_text())
        assert written["engine_profile"] == f"{profile}+quantization={scheme}"
    assert kl["engine"] == [0.0, 0.0]
    assert all(k > 0 for k in kl["hf"])
    if scheme == "w8a8-int8":
        with pytest.raises(UserError, match="enforce_eager mode: add --enforce-eager"):
            TrainConfig(engine="vllm", quantization=scheme).validate()
    else:
        with pytest.raises(UserError, match="vLLM's CPU build serves none of NVFP4"):
            TrainConfig(engine="vllm", quantization=scheme, enforce_eager=True).validate()


def test_train_names_the_quantization_aligned_trainer_and_the_bf16_engine():
    """``--trainer-profile quantization-aligned`` is the engine's rounding profile with its scheme (torch's kernels),
    and ``--quantization none`` the bf16 engine, so one compare grid can hold every level and engine."""
    from roundalign.rl.config import TrainConfig
    from roundalign.rl.loop import _quantization_aligned

    assert TrainConfig(quantization="none").validate().quantization is None
    engine = "vllm-reference-kernels+quantization=w8a8-int8"  # what train makes of --quantization w8a8-int8
    config = TrainConfig(engine_profile=engine, trainer_profile="quantization-aligned").validate()
    name = _quantization_aligned(config)
    assert name == "vllm+quantization=w8a8-int8"
    profile = get_profile(name)
    assert (
        profile.replace(quantization="none").same_rules(get_profile("vllm"))
        and str(profile.quantization) == "w8a8-int8"
    )
    assert profile.gemm is get_profile("vllm").gemm  # not the engine's kernels
    assert _quantization_aligned(TrainConfig(trainer_profile="quantization-aligned").validate()) == "vllm"


@pytest.mark.parametrize("sync", ["stochastic", "error-feedback"])
def test_fair_cast_on_the_grid_trains_exactly_and_resumes_bitwise(sync, tmp_path):
    """``train --quantization w4a16-g32-zp --sync SYNC`` on the reference engine: the export chooses the codes
    (``roundalign.sync.grid``), the engine serves them and the trainer computes with them (loss on the served
    copy), so every step is exactly on-policy; a run stopped after step 2 and resumed (the served checkpoint
    tensors from its checkpoint, the exporter's noise step or residuals from its state) continues bit for bit."""
    from roundalign.cli import main
    from roundalign.rl.config import TrainConfig
    from roundalign.rl.logbook import read_metrics
    from roundalign.rl.loop import train

    small = dict(prompts_per_step=2, group_size=4, max_tokens=24, eval_problems=4, eval_every=2, lr=1e-3)
    base = dict(engine_profile="vllm-reference-kernels", quantization="w4a16-g32-zp", sync=sync, save_every=1)

    def rows(out):
        return [{k: v for k, v in r.items() if not k.startswith("timing")} for r in read_metrics(out / "metrics.jsonl")]

    straight = train(
        TrainConfig(steps=3, **base, **small).validate(), tmp_path / "a", progress=False, tensorboard=False
    )
    assert [r["rollout_corr/k3_kl"] for r in rows(straight) if "rollout_corr/k3_kl" in r] == [0.0, 0.0, 0.0]
    assert any(r.get("sync/update_transfer") is not None for r in rows(straight))  # the master moved
    cut = train(TrainConfig(steps=2, **base, **small).validate(), tmp_path / "b", progress=False, tensorboard=False)
    assert main(["train", "--resume", str(cut), "--steps", "3", "--no-tensorboard", "--quiet"]) == 0
    assert rows(cut) == rows(straight)


def test_probe_quantizes_built_in_engine_profiles_only(tmp_path):
    from roundalign.probe.run import ProbeConfig

    cfg = ProbeConfig(quantization="w4a16", layer_sequences=0).validate()
    assert cfg.engine_profile == "vllm-reference-kernels+quantization=w4a16"
    assert cfg.trainer_profiles == (
        "hf", "vllm", "vllm+quantization=w4a16", "vllm-reference-kernels+quantization=w4a16",
    )  # fmt: skip
    mine = get_profile("vllm").replace(qk_norm="round_after_weight")  # rules no built-in profile has
    Profile(**{**mine.__dict__, "name": "vllm"}).save(tmp_path / "mine.json")  # under a built-in's name, even
    with pytest.raises(UserError, match="applies to a built-in engine profile"):
        ProbeConfig(quantization="w4a16", engine_profile=str(tmp_path / "mine.json")).validate()
    with pytest.raises(UserError, match="unknown quantization scheme 'int2'"):
        ProbeConfig(quantization="int2").validate()
