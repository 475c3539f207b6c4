"""``roundalign fingerprint``: the battery, the runner's collection code and the reader, against simulated engines.

No vLLM or SGLang runs here (no GPU, neither installed). The simulated engines (tests/fingerprint_sim.py) plug into
the runner's own ``run_battery``/``collect`` as adapters, so the code path a user runs on the engine's machine is
the one tested, up to the engine's layers themselves:

- roundalign.ops under every named profile: the reader must name each region's rule (``hf``, ``liger`` and
  ``vllm-eager-legacy`` share every rule; ``sglang``'s RoPE depends on head_dim; ``round_at_attention`` and
  ``never_round`` are the same at the op level, by design);
- vLLM's ``forward_native`` code (roundalign.engine.native), eager and compiled by Inductor;
- an engine that rounds where no rule does: "no rule", not the closest rule.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from roundalign.cli import main
from roundalign.fingerprint import battery as B
from roundalign.fingerprint import reader, runner
from roundalign.fingerprint.cli import runner_source
from roundalign.profiles import PROFILES, Profile, get_profile
from tests.fingerprint_sim import NativeAdapter, ProfileAdapter, WrongAdapter

BF16 = torch.bfloat16
RUNNER = runner_source()


@pytest.fixture(scope="module")
def battery():
    return B.make_battery()


def _read(battery, adapter) -> dict:
    results = runner.run_battery(battery, [adapter], log=lambda *a: None)
    (entry,) = reader.read_results(results)
    return entry["regions"]


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
    assert B.ulp_distance(a, b).tolist() == [1, 1, 0, 1]
    assert B.ulp_distance(torch.tensor([-1e-40], dtype=BF16), torch.tensor([1e-40], dtype=BF16)).item() > 1


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
    out["rope"] = ("determined", [next(iter(rules.values()))] if len(set(rules.values())) == 1
                   else [f"hd{hd}: {r}" for hd, r in rules.items()])
    return out


@pytest.mark.parametrize("name", list(PROFILES))
def test_reader_names_every_profile(battery, name):
    regions = _read(battery, ProfileAdapter(name))
    assert _rules(regions) == _expected(get_profile(name), battery)
    for region in regions.values():  # the rules are far apart: every other rule is below 99% equal in some case
        assert all(row["worst_case"] < reader.FAR_BELOW for row in region.evidence
                   if row["rule"] not in region.rules and "head_dim" not in row)


def test_reader_on_vllm_native_code_eager(battery):
    """vLLM's forward_native run eagerly rounds after every torch op: RMSNorm r(w*r(x*nu)); its add + norm
    normalizes the fp32 sum S (x = x + residual.to(fp32)) and carries r(S); RoPE's ``x1 * cos - x2 * sin`` on bf16
    tensors rounds each product and the difference (bf16/per_op, not once); SiluAndMul rounds silu first."""
    regions = _read(battery, NativeAdapter("eager"))
    assert _rules(regions) == {
        "rms_norm": ("determined", ["round_before_weight"]),
        "qk_norm": ("determined", ["round_before_weight"]),
        "residual": ("determined", ["normalize_fp32_sum"]),
        "rope": ("determined", ["bf16/per_op"]),
        "swiglu": ("determined", ["round_silu"]),
        "expert_swiglu": ("determined", ["round_silu"]),
    }
    assert regions["residual"].note == "with norm=round_before_weight"


@pytest.mark.slow
def test_reader_on_vllm_native_code_compiled(battery):
    """Compiled by Inductor (default config), the same code rounds once per fused kernel: RMSNorm r(x*nu*w); the
    q/k norm flows unrounded into RoPE; RoPE and SiluAndMul round once; the residual between two add + norm calls
    of one graph is never rounded. The experts' op is opaque (vLLM's CUDA silu_and_mul): still round_silu."""
    regions = _read(battery, NativeAdapter("compiled"))
    assert _rules(regions) == {
        "rms_norm": ("determined", ["round_after_weight"]),
        "qk_norm": ("determined", ["fused_into_rope"]),
        "residual": ("indistinguishable", ["never_round", "round_at_attention"]),
        "rope": ("determined", ["bf16/once"]),
        "swiglu": ("determined", ["once"]),
        "expert_swiglu": ("determined", ["round_silu"]),
    }
    norm = regions["rms_norm"].evidence[0]
    print(f"compiled RMSNorm vs round_after_weight: {norm['equal']:.6f} equal, max {norm['max_ulp']} ulp")
    assert norm["max_ulp"] <= 1  # reduction order moves a few elements by one ulp, nothing more
    assert "roundalign fit" in regions["residual"].note


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
    code = ("import sys; sys.modules['roundalign'] = None; sys.modules['vllm'] = None; sys.modules['sglang'] = None;"
            f"sys.argv = ['run_fingerprint.py', 'battery.pt', '--engine', sys.argv[1]];"
            f"exec(compile(open({str(out)!r}).read(), 'run_fingerprint.py', 'exec'), {{'__name__': '__main__'}})")
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
    results = runner.run_battery(battery, [ProfileAdapter("sglang", "eager"), ProfileAdapter("vllm", "compiled")],
                                 log=lambda *a: None)
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


def test_read_table(results_path, capsys):
    assert main(["fingerprint", "read", str(results_path)]) == 0
    out = capsys.readouterr().out
    assert "compiled mode" in out and "indistinguishable" in out and "fused_into_rope" in out


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
    assert main(["fingerprint", "read", str(results_path), "--profile-out", "compiled", str(out),
                 "--residual", "normalize_fp32_sum"]) == 2
    assert "contradicts" in capsys.readouterr().err
    assert main(["fingerprint", "read", str(results_path), "--profile-out", "compiled", str(out),
                 "--residual", "round_at_attention", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["profile_out"]["sources"]["residual"].startswith("--residual")
    got, vllm = Profile.load(out), get_profile("vllm")
    assert all(getattr(got, r) == getattr(vllm, r) for r in ("rms_norm", "qk_norm", "residual", "rope", "swiglu",
                                                             "expert_swiglu"))


def _broken(results_path, tmp_path, edit) -> Path:
    results = torch.load(results_path, weights_only=True)
    edit(results)
    path = tmp_path / "broken.pt"
    torch.save(results, path)
    return path


def _wrong_shape(results):
    results["runs"][1]["outputs"]["silu_and_mul/d512"] = [torch.zeros(3, dtype=BF16)]


@pytest.mark.parametrize("edit, message", [
    (lambda r: r["battery"].update(version=2), "battery version 2"),
    (lambda r: r.update(version=9), "results version 9"),
    (lambda r: r["runs"][0]["outputs"].pop("rope/hd80"), "missing case(s) ['rope/hd80']"),
    (_wrong_shape, "case 'silu_and_mul/d512' has outputs [((3,), torch.bfloat16)]"),
    (lambda r: r["battery"]["cases"][0]["inputs"]["x"].add_(1), "do not match its id"),
    (lambda r: r.update(format="something else"), "not a fingerprint results file"),
])
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
