"""``roundalign fingerprint``: the battery, the runner's collection code and the reader, against simulated engines.

No vLLM or SGLang runs here (no GPU, neither installed). The simulated engines (tests/fingerprint_sim.py) plug into
the runner's own ``run_battery``/``collect`` as adapters, so the code path a user runs on the engine's machine is
the one tested, up to the engine's layers themselves:

- roundalign.ops under every named profile: the reader must name each region's rule (``hf``, ``liger`` and
  ``vllm-eager-legacy`` share every rule; ``sglang``'s RoPE depends on head_dim; ``round_at_attention`` and
  ``never_round`` are the same at the op level, by design);
- the runner's own ``--engine native`` adapter (vLLM's ``forward_native`` code), eager in process, and both modes
  end to end through the CLI and the copied-out script as a subprocess (compiled by Inductor; @slow);
- an engine that rounds where no rule does: "no rule", not the closest rule;
- a battery shaped like the shipped model (``make --model shipped``): the model's constants, its cases, its own
  line in the reader, and the profile at its head dim; an engine whose rule depends on the shape.

The expected rules are written here from what each engine's code does, never taken from the reader.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

import roundalign
import roundalign.models
from roundalign.cli import main
from roundalign.engine import native as engine_native
from roundalign.fingerprint import battery as B
from roundalign.fingerprint import reader, runner
from roundalign.fingerprint.cli import runner_source
from roundalign.numerics import bf16_ulp_distance
from roundalign.profiles import PROFILES, REGIONS, Profile, RopeRule, get_profile
from tests.fingerprint_sim import ProfileAdapter, ShapeDependentAdapter, WrongAdapter

BF16 = torch.bfloat16
RUNNER = runner_source()
SHIPPED_CONFIG = roundalign.models.path() / "config.json"


@pytest.fixture(scope="module")
def battery():
    return B.make_battery()


@pytest.fixture(scope="module")
def model_battery():
    return B.make_battery(model=B.model_constants("shipped"))


def _entry(battery, adapter) -> dict:
    results = runner.run_battery(battery, [adapter], log=lambda *a: None)
    (entry,) = reader.read_results(results)
    return entry


def _read(battery, adapter) -> dict:
    return _entry(battery, adapter)["regions"]


def _rules(regions) -> dict:
    return {name: (r.status, r.rules) for name, r in regions.items()}


# ----------------------------------------------------------------------------------------------------------------
# the battery


def test_make_is_deterministic(battery, tmp_path):
    again = B.make_battery()
    assert again["id"] == battery["id"]
    for a, b in zip(battery["cases"], again["cases"], strict=True):
        assert a["name"] == b["name"] and a["params"] == b["params"]
        for key in a["inputs"]:
            assert torch.equal(a["inputs"][key], b["inputs"][key]), (a["name"], key)
    path = tmp_path / "battery.pt"
    B.save_battery(path)
    loaded = torch.load(path, weights_only=True)
    B.check_battery(loaded, str(path))  # id recomputed from the loaded tensors
    assert loaded["id"] == battery["id"]


def test_battery_covers_the_regions_head_dims_and_positions(battery):
    regions = {c["region"] for c in battery["cases"]}
    assert regions == {"rms_norm", "qk_norm", "residual", "rope", "swiglu", "expert_swiglu"}
    rope = [c for c in battery["cases"] if c["op"] == "rope"]
    assert {c["params"]["head_dim"] for c in rope} >= {64, 128, 256, 80}
    assert all(int(c["inputs"]["positions"].max()) == B.MAX_POSITION - 1 for c in rope)
    for c in battery["cases"]:
        for key, w in c["inputs"].items():
            if "weight" in key:  # rounding before the weight is invisible with w = 1
                assert not torch.all(w == 1) and w.unique().numel() > 50, (c["name"], key)


def test_swiglu_inputs_sit_near_rounding_ties(battery):
    """Outside the typical quarter of rows, the two SwiGLU rules, written from their formulas, disagree almost
    everywhere: r(r(silu(g)) * u) != r(silu(g) * u)."""
    for case in (c for c in battery["cases"] if c["region"] in ("swiglu", "expert_swiglu")):
        x = case["inputs"]["x"]
        d = x.shape[-1] // 2
        g, u = x[..., :d].float(), x[..., d:].float()
        round_silu = (F.silu(g).to(BF16).float() * u).to(BF16)
        once = (F.silu(g) * u).to(BF16)
        rows = x.shape[0] // 4
        picked = (round_silu[rows:] != once[rows:]).float().mean().item()
        typical = (round_silu[:rows] != once[:rows]).float().mean().item()
        assert picked > 0.95 and typical < 0.5, (case["name"], picked, typical)


def test_ulp_distance():
    a = torch.tensor([1.0, -1.0, 0.0, 2.0], dtype=BF16)
    b = torch.tensor([1.0078125, -1.0078125, -0.0, 1.9921875], dtype=BF16)  # +1 ulp, -1 ulp, +-0, -1 ulp
    assert bf16_ulp_distance(a, b).tolist() == [1, 1, 0, 1]
    assert bf16_ulp_distance(torch.tensor([-1e-40], dtype=BF16), torch.tensor([1e-40], dtype=BF16)).item() > 1


# ----------------------------------------------------------------------------------------------------------------
# the reader against simulated engines


def _expected(profile: Profile, battery) -> dict:
    residual = str(profile.residual)
    twins = sorted(reader.OP_LEVEL_TWINS)
    out = {
        "rms_norm": ("determined", [str(profile.rms_norm)]),
        "qk_norm": ("determined", [str(profile.qk_norm)]),
        "residual": ("indistinguishable", twins) if residual in twins else ("determined", [residual]),
        "swiglu": ("determined", [str(profile.swiglu)]),
        "expert_swiglu": ("determined", [str(profile.expert_swiglu)]),
    }
    dims = sorted(c["params"]["head_dim"] for c in battery["cases"] if c["op"] == "rope")
    rules = {hd: str(profile.rope_for(hd)) for hd in dims}
    out["rope"] = (
        "determined",
        [next(iter(rules.values()))] if len(set(rules.values())) == 1 else [f"hd{hd}: {r}" for hd, r in rules.items()],
    )
    return out


@pytest.mark.parametrize("name", list(PROFILES))
def test_reader_names_every_profile(battery, name):
    regions = _read(battery, ProfileAdapter(name))
    assert _rules(regions) == _expected(get_profile(name), battery)
    for region in regions.values():  # the rules are far apart: every other rule is below 99% equal in some case
        assert all(
            row["worst_case"] < reader.FAR_BELOW
            for row in region.evidence
            if row["rule"] not in region.rules and "head_dim" not in row
        )


# What vLLM's forward_native code does, read from its source (runner.py's docstring), per mode. Eager rounds after
# every torch op: RMSNorm r(w*r(x*nu)); its add + norm normalizes the fp32 sum S (x = x + residual.to(fp32)) and
# carries r(S); RoPE's x1 * cos - x2 * sin on bf16 tensors rounds each product and the difference (bf16/per_op);
# SiluAndMul rounds silu first. Inductor rounds once per fused kernel: RMSNorm r(x*nu*w), the q/k norm flows
# unrounded into RoPE, RoPE and SiluAndMul round once, the residual between two add + norm calls of one graph is
# never rounded. The experts' op is opaque in both modes (vLLM's CUDA silu_and_mul): round_silu.
NATIVE = {
    "eager": {
        "rms_norm": ("determined", ["round_before_weight"]),
        "qk_norm": ("determined", ["round_before_weight"]),
        "residual": ("determined", ["normalize_fp32_sum"]),
        "rope": ("determined", ["bf16/per_op"]),
        "swiglu": ("determined", ["round_silu"]),
        "expert_swiglu": ("determined", ["round_silu"]),
    },
    "compiled": {
        "rms_norm": ("determined", ["round_after_weight"]),
        "qk_norm": ("determined", ["fused_into_rope"]),
        "residual": ("indistinguishable", ["never_round", "round_at_attention"]),
        "rope": ("determined", ["bf16/once"]),
        "swiglu": ("determined", ["once"]),
        "expert_swiglu": ("determined", ["round_silu"]),
    },
}


def test_native_adapter_is_engine_native_code(battery):
    """The standalone runner's copy of vLLM's forward_native equals roundalign.engine.native's bitwise, eagerly."""
    by_op = {c["op"]: c["inputs"] for c in battery["cases"]}
    x, w = by_op["rms_norm"]["x"], by_op["rms_norm"]["weight"]
    assert torch.equal(runner.rms_norm_native(x, w, 1e-6), engine_native.rms_norm_native(x, w, 1e-6))
    a = by_op["add_rms_norm"]
    for mine, theirs in zip(
        runner.rms_norm_native(a["x"], a["weight"], 1e-6, a["residual"]),
        engine_native.rms_norm_native(a["x"], a["weight"], 1e-6, a["residual"]),
        strict=True,
    ):
        assert torch.equal(mine, theirs)
    g = by_op["silu_and_mul"]["x"]
    assert torch.equal(runner.silu_and_mul_native(g), engine_native.silu_and_mul_native(g))
    assert torch.equal(runner.expert_silu_and_mul_native(g), engine_native.silu_and_mul_native(g))
    for case in (c for c in battery["cases"] if c["op"] == "rope"):
        hd, theta = case["params"]["head_dim"], case["params"]["theta"]
        mine = runner.cos_sin_cache_native(hd, theta, 4096)
        theirs = engine_native.cos_sin_cache(B.inv_freq(hd, theta), 4096, BF16)
        assert torch.equal(mine, theirs), hd
        pos = case["inputs"]["positions"] % 4096
        for m, t in zip(
            runner.rope_native(pos, case["inputs"]["q"], case["inputs"]["k"], mine, hd),
            engine_native.rope_native(pos, case["inputs"]["q"], case["inputs"]["k"], theirs, hd),
            strict=True,
        ):
            assert torch.equal(m, t), hd


def test_reader_on_the_native_engine_eager(model_battery):
    entry = _entry(model_battery, runner.NativeAdapter("eager", device="cpu"))
    assert entry["engine"] == "native"
    assert _rules(entry["regions"]) == NATIVE["eager"]
    assert entry["regions"]["residual"].note == "with norm=round_before_weight"
    model = entry["model"]  # the tiny model is dense: no experts' line
    assert _rules(model["regions"]) == {k: v for k, v in NATIVE["eager"].items() if k != "expert_swiglu"}
    assert model["differs"] == []


def test_reader_says_no_rule_for_a_wrong_engine(battery):
    regions = _read(battery, WrongAdapter())
    for name in ("swiglu", "expert_swiglu", "rope"):
        assert regions[name].status == "no_rule", name
        assert regions[name].rules == []
    assert "no rule matches" in regions["swiglu"].note
    assert regions["rms_norm"].rules == ["round_before_weight"]  # the regions it gets right are still named


# ----------------------------------------------------------------------------------------------------------------
# the runner script


def test_runner_is_standalone_and_reports_a_missing_engine(tmp_path, capsys, battery):
    out = tmp_path / "run_fingerprint.py"
    assert main(["fingerprint", "runner", "--out", str(out)]) == 0
    assert out.read_bytes() == RUNNER.read_bytes()
    compile(out.read_text(), str(out), "exec")
    torch.save(battery, tmp_path / "battery.pt")
    # roundalign (and vLLM, SGLang) blocked: the script must import, parse its arguments and say what is missing.
    code = (
        "import sys; sys.modules['roundalign'] = None; sys.modules['vllm'] = None; sys.modules['sglang'] = None;"
        f"sys.argv = ['run_fingerprint.py', 'battery.pt', '--engine', sys.argv[1]];"
        f"exec(compile(open({str(out)!r}).read(), 'run_fingerprint.py', 'exec'), {{'__name__': '__main__'}})"
    )
    for engine, name in (("vllm", "vLLM"), ("sglang", "SGLang")):
        proc = subprocess.run([sys.executable, "-c", code, engine], cwd=tmp_path, capture_output=True, text=True)
        assert proc.returncode == 1, proc.stderr
        assert f"{name} cannot be imported here" in proc.stderr


def test_vllm_adapter_without_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(runner.EngineMissing, match="vLLM cannot be imported"):
        runner.VllmAdapter("eager", device="cpu")
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(runner.EngineMissing, match="SGLang cannot be imported"):
        runner.SglangAdapter("compiled", device="cpu")


def test_runner_defaults_to_the_cpu_without_cuda(tmp_path, battery, capsys):
    torch.save(battery, tmp_path / "battery.pt")
    out = tmp_path / "results.pt"
    args = [str(tmp_path / "battery.pt"), "--engine", "native", "--modes", "eager", "--out", str(out)]
    assert runner.main(args) == 0
    (run,) = torch.load(out, weights_only=True)["runs"]
    assert (run["engine"], run["mode"]) == ("native", "eager")
    assert run["device"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    assert f"wrote {out}: {len(battery['cases'])} cases x eager" in capsys.readouterr().out


def test_collect_rejects_outputs_of_the_wrong_dtype(battery):
    class Fp32Swiglu(ProfileAdapter):
        def silu_and_mul(self):
            return lambda x: F.silu(x[..., : x.shape[-1] // 2].float())

    with pytest.raises(RuntimeError, match="silu_and_mul/d512.*expected"):
        runner.collect(battery, Fp32Swiglu("hf"), log=lambda *a: None)


# ----------------------------------------------------------------------------------------------------------------
# results.pt -> read, through the CLI


@pytest.fixture(scope="module")
def results_path(battery, tmp_path_factory):
    """What the user brings back: the sglang profile as the eager run, vllm's as the compiled one."""
    results = runner.run_battery(
        battery, [ProfileAdapter("sglang", "eager"), ProfileAdapter("vllm", "compiled")], log=lambda *a: None
    )
    path = tmp_path_factory.mktemp("fp") / "results.pt"
    torch.save(results, path)
    return path


def test_read_json_round_trip(results_path, capsys):
    assert main(["fingerprint", "read", str(results_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    eager, compiled = data["runs"]
    assert (eager["mode"], compiled["mode"]) == ("eager", "compiled")
    assert eager["regions"]["rms_norm"]["rules"] == ["round_after_weight"]
    assert eager["regions"]["rope"]["per_head_dim"]["80"]["rules"] == ["bf16/per_op"]
    assert eager["regions"]["rope"]["per_head_dim"]["128"]["rules"] == ["fp32/once"]
    assert compiled["regions"]["residual"]["status"] == "indistinguishable"
    assert compiled["regions"]["qk_norm"]["rules"] == ["fused_into_rope"]


@pytest.mark.parametrize("columns", ["80", "240"])
def test_read_table(results_path, capsys, monkeypatch, columns):
    """Piped output takes COLUMNS: a wide console gets one table per run, 80 columns one block per region; neither
    cuts a rule, a status or a number."""
    monkeypatch.setenv("COLUMNS", columns)
    assert main(["fingerprint", "read", str(results_path)]) == 0
    out = capsys.readouterr().out
    assert "compiled mode" in out and "indistinguishable" in out and "fused_into_rope" in out
    assert "…" not in out and all(len(line) <= int(columns) for line in out.splitlines())


def test_profile_out(results_path, tmp_path, capsys):
    path = tmp_path / "eager.json"
    assert main(["fingerprint", "read", str(results_path), "--profile-out", "eager", str(path)]) == 0
    got, sglang = Profile.load(path), get_profile("sglang")
    for region in ("rms_norm", "qk_norm", "residual", "swiglu", "expert_swiglu"):
        assert getattr(got, region) == getattr(sglang, region), region
    assert all(got.rope_for(hd) == sglang.rope_for(hd) for hd in (64, 80, 96, 128, 256))

    # compiled: the residual is round_at_attention or never_round; refused until the user names it
    out = tmp_path / "compiled.json"
    assert main(["fingerprint", "read", str(results_path), "--profile-out", "compiled", str(out)]) == 2
    assert "--residual" in capsys.readouterr().err and not out.exists()
    assert (
        main(
            [
                "fingerprint",
                "read",
                str(results_path),
                "--profile-out",
                "compiled",
                str(out),
                "--residual",
                "normalize_fp32_sum",
            ]
        )
        == 2
    )
    assert "contradicts" in capsys.readouterr().err
    assert (
        main(
            [
                "fingerprint",
                "read",
                str(results_path),
                "--profile-out",
                "compiled",
                str(out),
                "--residual",
                "round_at_attention",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["profile_out"]["sources"]["residual"].startswith("--residual")
    got, vllm = Profile.load(out), get_profile("vllm")
    assert all(
        getattr(got, r) == getattr(vllm, r)
        for r in ("rms_norm", "qk_norm", "residual", "rope", "swiglu", "expert_swiglu")
    )


def _broken(results_path, tmp_path, edit) -> Path:
    results = torch.load(results_path, weights_only=True)
    edit(results)
    path = tmp_path / "broken.pt"
    torch.save(results, path)
    return path


def _wrong_shape(results):
    results["runs"][1]["outputs"]["silu_and_mul/d512"] = [torch.zeros(3, dtype=BF16)]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r: r["battery"].update(version=3), "battery version 3, this roundalign reads versions 1, 2"),
        (lambda r: r.update(version=9), "results version 9"),
        (lambda r: r["runs"][0]["outputs"].pop("rope/hd80"), "missing case(s) ['rope/hd80']"),
        (_wrong_shape, "case 'silu_and_mul/d512' has outputs [((3,), torch.bfloat16)]"),
        (lambda r: r["battery"]["cases"][0]["inputs"]["x"].add_(1), "do not match its id"),
        (lambda r: r.update(format="something else"), "not a fingerprint results file"),
    ],
)
def test_read_rejects_bad_results(results_path, tmp_path, capsys, edit, message):
    path = _broken(results_path, tmp_path, edit)
    assert main(["fingerprint", "read", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_read_rejects_a_battery_and_a_missing_file(tmp_path, capsys, battery):
    torch.save(battery, tmp_path / "battery.pt")
    assert main(["fingerprint", "read", str(tmp_path / "battery.pt")]) == 2
    assert "not a fingerprint results file" in capsys.readouterr().err
    assert main(["fingerprint", "read", str(tmp_path / "nope.pt")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_make_cli(tmp_path, capsys, battery):
    out = tmp_path / "b.pt"
    assert main(["fingerprint", "make", "--out", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["id"] == battery["id"] and len(data["cases"]) == len(battery["cases"])
    assert torch.load(out, weights_only=True)["id"] == battery["id"]


# ----------------------------------------------------------------------------------------------------------------
# batteries shaped like the user's model (make --model)


def test_model_constants_of_the_shipped_model():
    config = json.loads(SHIPPED_CONFIG.read_text())  # read here independently of transformers
    got = B.model_constants("shipped")
    assert got == B.model_constants(SHIPPED_CONFIG) == B.model_constants(SHIPPED_CONFIG.parent)
    assert {
        k: got[k]
        for k in (
            "head_dim",
            "rope_theta",
            "rms_norm_eps",
            "hidden_size",
            "intermediate_size",
            "max_position_embeddings",
        )
    } == {
        "head_dim": config["head_dim"],
        "rope_theta": config["rope_parameters"]["rope_theta"],
        "rms_norm_eps": config["rms_norm_eps"],
        "hidden_size": config["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "max_position_embeddings": config["max_position_embeddings"],
    }
    assert got["moe_intermediate_size"] is None and got["qk_norm"] is True and got["name"] == "tiny-qwen3"


def _config_dir(tmp_path, **edit) -> Path:
    config = json.loads(SHIPPED_CONFIG.read_text())
    for key, value in edit.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_model_constants_of_other_configs(tmp_path):
    moe = B.model_constants(
        _config_dir(
            tmp_path / "moe",
            model_type="qwen3_moe",
            architectures=["Qwen3MoeForCausalLM"],
            head_dim=80,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=384,
            rope_parameters=None,
            rope_theta=5e5,
        )
    )
    assert (moe["head_dim"], moe["rope_theta"], moe["moe_intermediate_size"], moe["qk_norm"]) == (80, 5e5, 384, True)
    llama = B.model_constants(
        _config_dir(tmp_path / "llama", model_type="llama", architectures=["LlamaForCausalLM"], head_dim=None)
    )
    assert (llama["head_dim"], llama["qk_norm"], llama["moe_intermediate_size"]) == (256 // 4, False, None)


@pytest.mark.parametrize(
    "model, message",
    [
        ("nowhere", "no config.json in .*nowhere; give a local model directory"),
        ("odd", r"head_dim\W+63"),  # transformers' validator or ours: RoPE rotates pairs
        ("garbled", "transformers cannot read"),
    ],
)
def test_model_constants_refuse_bad_models(tmp_path, model, message):
    (tmp_path / "nowhere").mkdir()
    _config_dir(tmp_path / "odd", head_dim=63)
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "config.json").write_text('{"model_type": "no-such-model"}')
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        B.model_constants(tmp_path / model)


def test_model_battery_adds_marked_cases_at_the_model_shapes(battery, model_battery):
    m = model_battery["model"]
    generic = [c for c in model_battery["cases"] if not c["model"]]
    shaped = {c["name"]: c for c in model_battery["cases"] if c["model"]}
    assert [c["name"] for c in generic] == [c["name"] for c in battery["cases"]]  # generic cases unchanged
    for a, b in zip(generic, battery["cases"], strict=True):
        assert all(torch.equal(a["inputs"][k], b["inputs"][k]) for k in a["inputs"]), a["name"]
    assert sorted(shaped) == sorted(
        [
            "model/rms_norm/h256",
            "model/add_rms_norm/h256",
            "model/add_rms_norm_chain/h256",
            "model/silu_and_mul/d768",
            "model/rope/hd64",
            "model/qk_norm_rope/hd64",
        ]
    )
    assert shaped["model/rms_norm/h256"]["inputs"]["x"].shape[-1] == m["hidden_size"] == 256
    assert shaped["model/silu_and_mul/d768"]["inputs"]["x"].shape[-1] == 2 * m["intermediate_size"]
    rope = shaped["model/rope/hd64"]
    assert rope["params"] == {"head_dim": 64, "theta": 1e4, "max_position": 256}
    assert int(rope["inputs"]["positions"].max()) == 255  # the model's last position
    assert shaped["model/qk_norm_rope/hd64"]["params"]["eps"] == m["rms_norm_eps"]
    again = B.make_battery(model=B.model_constants("shipped"))
    assert again["id"] == model_battery["id"] != battery["id"]
    assert all(
        torch.equal(t, again["cases"][i]["inputs"][k])
        for i, c in enumerate(model_battery["cases"])
        for k, t in c["inputs"].items()
    )


def _v1_id(battery) -> str:
    """Version 1's id, written from its formula: format/version, then per case name|op|params and its tensors."""
    h = hashlib.sha256(f"{battery['format']}/1".encode())
    for case in battery["cases"]:
        h.update(f"{case['name']}|{case['op']}|{sorted(case['params'].items())}".encode())
        for key in sorted(case["inputs"]):
            t = case["inputs"][key]
            h.update(f"{key}{tuple(t.shape)}{t.dtype}".encode() + t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_version_1_batteries_are_still_read(battery, tmp_path, capsys):
    v1 = {
        "format": battery["format"],
        "version": 1,
        "dtype": "bfloat16",
        "seed": 0,
        "cases": [{k: v for k, v in c.items() if k != "model"} for c in battery["cases"]],
    }
    v1["id"] = _v1_id(v1)
    results = runner.run_battery(v1, [ProfileAdapter("vllm", "compiled")], log=lambda *a: None)
    (entry,) = reader.read_results(results)
    assert entry["model"] is None and entry["regions"]["rope"].rules == ["bf16/once"]
    torch.save(results, tmp_path / "r.pt")
    assert main(["fingerprint", "read", str(tmp_path / "r.pt")]) == 0
    assert "for your model" not in capsys.readouterr().out
    v1["cases"][0]["inputs"]["x"][0, 0] += 1
    with pytest.raises(ValueError, match="do not match its id"):
        B.check_battery(v1, "v1")


def test_model_line_and_profile_follow_the_model(model_battery, tmp_path, capsys):
    """sglang's RoPE depends on head_dim: the model's line and the profile hold its rule at head_dim 64, as one
    plain rule. An engine whose RMSNorm rule depends on the hidden size: the model's line differs from the
    generic cases, and the profile follows the model."""
    sglang = get_profile("sglang")
    results = runner.run_battery(
        model_battery,
        [ProfileAdapter("sglang", "eager"), ShapeDependentAdapter("vllm", 256, "compiled")],
        log=lambda *a: None,
    )
    path = tmp_path / "results.pt"
    torch.save(results, path)
    assert main(["fingerprint", "read", str(path), "--json"]) == 0
    eager, compiled = json.loads(capsys.readouterr().out)["runs"]
    assert eager["model"]["regions"]["rope"]["rules"] == [str(sglang.rope_for(64))]
    assert eager["model"]["differs"] == [] and eager["model"]["constants"]["head_dim"] == 64
    assert eager["model"]["line"].startswith("for your model tiny-qwen3 (head_dim=64, rope_theta=10000")
    assert compiled["regions"]["rms_norm"]["rules"] == ["round_after_weight"]
    assert compiled["model"]["regions"]["rms_norm"]["rules"] == ["round_before_weight"]
    assert compiled["model"]["differs"] == ["rms_norm"]

    out = tmp_path / "eager.json"
    assert main(["fingerprint", "read", str(path), "--profile-out", "eager", str(out)]) == 0
    assert "for your model tiny-qwen3" in capsys.readouterr().out
    got = Profile.load(out)
    assert got.rope == RopeRule.parse(str(sglang.rope_for(64)))  # a plain rule at the model's head dim
    assert all(getattr(got, r) == getattr(sglang, r) for r in REGIONS if r != "rope")
    out = tmp_path / "compiled.json"
    assert (
        main(
            [
                "fingerprint",
                "read",
                str(path),
                "--profile-out",
                "compiled",
                str(out),
                "--residual",
                "round_at_attention",
            ]
        )
        == 0
    )
    got, vllm = Profile.load(out), get_profile("vllm")
    assert str(got.rms_norm) == "round_before_weight"  # the model's shapes, not the generic cases'
    assert all(getattr(got, r) == getattr(vllm, r) for r in REGIONS if r != "rms_norm")
    assert "rms_norm from battery (the model's shapes)" in got.source and "head_dim=64" in got.engines


def test_make_model_cli(tmp_path, capsys, model_battery):
    out = tmp_path / "b.pt"
    assert main(["fingerprint", "make", "--model", "shipped", "--out", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["id"] == model_battery["id"] and data["model"]["head_dim"] == 64
    assert [row["case"] for row in data["cases"] if row["model"]][0] == "model/rms_norm/h256"
    assert main(["fingerprint", "make", "--model", str(tmp_path / "none"), "--out", str(out)]) == 2
    assert "no config.json" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------
# end to end on this machine: make --model shipped, the copied-out runner with --engine native, read, profile


@pytest.mark.slow
def test_native_dry_run_end_to_end(tmp_path, capsys):
    """The documented dry run, through the CLI and the copied-out script as a subprocess; the compiled mode
    compiles every case with Inductor. The expected rules are NATIVE's, written from vLLM's code."""
    assert main(["fingerprint", "make", "--model", "shipped", "--out", str(tmp_path / "b.pt")]) == 0
    assert main(["fingerprint", "runner", "--out", str(tmp_path / "run_fingerprint.py")]) == 0
    capsys.readouterr()
    proc = subprocess.run(
        [sys.executable, "run_fingerprint.py", "b.pt", "--engine", "native", "--device", "cpu", "--out", "r.pt"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "cases x eager, compiled" in proc.stdout

    assert main(["fingerprint", "read", str(tmp_path / "r.pt"), "--json"]) == 0
    eager, compiled = json.loads(capsys.readouterr().out)["runs"]
    for run in (eager, compiled):
        got = {name: (r["status"], r["rules"]) for name, r in run["regions"].items()}
        assert (run["engine"], got) == ("native", NATIVE[run["mode"]]), run["mode"]
        shaped = {name: (r["status"], r["rules"]) for name, r in run["model"]["regions"].items()}
        assert shaped == {k: v for k, v in NATIVE[run["mode"]].items() if k != "expert_swiglu"}, run["mode"]
    norm = compiled["regions"]["rms_norm"]["evidence"][0]
    print(f"compiled RMSNorm vs round_after_weight: {norm['equal']:.6f} equal, max {norm['max_ulp']} ulp")
    assert norm["max_ulp"] <= 1  # reduction order moves a few elements by one ulp, nothing more
    assert "roundalign fit" in compiled["regions"]["residual"]["note"]

    profile = tmp_path / "p.json"
    assert (
        main(
            [
                "fingerprint",
                "read",
                str(tmp_path / "r.pt"),
                "--profile-out",
                "compiled",
                str(profile),
                "--residual",
                "round_at_attention",
            ]
        )
        == 0
    )
    got, vllm = Profile.load(profile), get_profile("vllm")
    for region in REGIONS:  # the battery covers every region
        assert getattr(got, region) == getattr(vllm, region), region

    path = roundalign.models.path()
    ids = torch.arange(1, 40).unsqueeze(0)
    logits = []
    for prof in (got, "vllm"):  # a copy of the shipped model patched with the written profile, and with vllm's
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=BF16)
        roundalign.apply(model, prof)
        with torch.no_grad():
            logits.append(model(ids).logits)
    assert torch.isfinite(logits[0]).all() and torch.equal(logits[0], logits[1])
