"""``roundalign fit``: every built-in profile is recovered from a dump its engine wrote, a wrong checkpoint is refused.

Dumps come from independent implementations, never from the trainer model ``fit`` patches: the reference engine
(``roundalign.engine``, the kernels backend and vLLM's compiled ``forward_native`` code) for the shipped Qwen3, and
the formula-written forward in ``tests/model_reference.py`` for Llama and Qwen3-MoE, which the engine does not run.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json

import pytest
import torch
import torch.nn.functional as F

import roundalign
from roundalign import models
from roundalign.cli import main
from roundalign.engine import Engine, SamplingParams
from roundalign.fit import DumpNotExplained, Space, fit, sign_test
from roundalign.fit import search as fit_search
from roundalign.fit.search import MAX_EXCESS
from roundalign.fit.space import RULES
from roundalign.profiles import Profile, get_profile
from roundalign.prompts import default_prompts
from roundalign.rollouts import Rollout, read_engine_logprobs, write_engine_logprobs
from roundalign.trainer import TrainerSide, load_trainer_model
from tests import models as test_models
from tests.cpu_kernels import gemm_rows_matter
from tests.helpers import rounding_profiles
from tests.model_reference import reference_logits

SCREEN = 40  # tokens: one sequence, so that the screening-and-pruning path runs on these small dumps


def _weights_key(model) -> str:
    """What decides a forward of ``model`` besides the rules and the tokens: its class, config and every weight."""
    h = hashlib.sha256(f"{type(model).__qualname__}|{model.config.to_json_string()}".encode())
    h.update(str(model.config._attn_implementation).encode())
    for name, t in model.state_dict().items():
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module", autouse=True)
def _forwards_shared_across_fits():
    """Every fit here re-scores the same completions with the same candidates: the engine's log-probs differ from
    dump to dump, the trainer's forwards do not. A forward is deterministic (the same model, rules, tokens, GEMM
    function and thread count give the same bits), so each such forward is computed once in this module and handed
    to later fits as it was computed; a fit counts it as a forward all the same (its stats and progress are
    unchanged), and ranks, prunes and checks exactly the log-probs it would have computed. The key holds the
    weights' bytes (not the model object: the CLI loads its own copy of the shipped model, and a model built by one
    test can reuse a freed one's id) and the current ``F.linear``, which ``gemm_rows_matter`` swaps. The first fit
    to need a forward runs it for real, and every later fit runs one shared forward again as a check; the
    sampler-shape forwards of the model check (``_Scorer.decode``) and every direct ``TrainerSide`` call in the
    tests are never shared."""
    computed: dict = {}
    original = fit_search._Scorer.score

    def score(self, entry, idxs):
        todo = [i for i in idxs if i not in entry.logprobs]
        if not todo:
            return
        if not hasattr(self, "_weights_key"):  # once per fit: the model is unpatched here, between candidates
            self._weights_key = _weights_key(self.trainer.model)
        keys = {
            i: (
                self._weights_key,
                F.linear,
                torch.get_num_threads(),
                entry.candidate,
                tuple(self.rollouts[i].prompt_token_ids),
                tuple(self.rollouts[i].token_ids),
            )
            for i in todo
        }
        fresh = [i for i in todo if keys[i] not in computed]
        if fresh:
            original(self, entry, fresh)  # real forwards, counted and reported by fit itself
            computed.update({keys[i]: entry.logprobs[i].clone() for i in fresh})
        shared = [i for i in todo if i not in fresh]
        if shared and not getattr(self, "_spot_checked", False):
            # Once per fit, a shared forward is run again for real: were anything besides the key to change a
            # forward (global state left by an earlier test), sharing would be wrong, and this fails.
            self._spot_checked = True
            with self.trainer.patched(self.space.profile(entry.candidate)) as model:
                again = TrainerSide.token_logprobs(model, self.rollouts[shared[0]])
            assert torch.equal(again, computed[keys[shared[0]]]), "a shared trainer forward is not reproducible"
        for i in shared:
            entry.logprobs[i] = computed[keys[i]].clone()
            self.forwards += 1
            self.progress(1)

    fit_search._Scorer.score = score
    try:
        yield computed
    finally:
        fit_search._Scorer.score = original


@pytest.fixture(scope="module")
def shipped():
    return load_trainer_model(models.path())


@pytest.fixture(scope="module")
def completions():
    """Four completions of 40 tokens, sampled once; every dump below scores these same tokens."""
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=0, ignore_eos=True)
    return Engine(models.path(), "hf").generate(default_prompts(4, 0), params)


def engine_dump(completions, profile, mode="prefill", model=None, backend="kernels", temperature=1.0):
    engine = Engine(model if model is not None else models.path(), profile, backend=backend)
    lps = engine.score(
        [c.prompt_token_ids for c in completions],
        [c.token_ids for c in completions],
        mode=mode,
        temperature=temperature,
    )
    return [
        Rollout(list(c.prompt_token_ids), list(c.token_ids), lp.tolist())
        for c, lp in zip(completions, lps, strict=True)
    ]


def assert_determined_regions_true(result, profile):
    truth = result.space.key_of(profile)
    wrong = {r: d for r, d in result.regions.items() if d["status"] == "determined" and d["rule"] != truth.rule(r)}
    assert not wrong, f"{profile}: regions called determined with the wrong rule: {wrong}"


# ------------------------------------------------------------------------------------------------------------
# the rule space


def test_space_covers_every_rule_combination_the_model_exercises(shipped):
    space = Space.of(shipped)
    assert space.regions == ("rms_norm", "qk_norm", "residual", "rope", "swiglu")
    assert set(space.idle) == {"expert_swiglu"}
    cands = space.candidates()
    assert len(cands) == len(set(cands)) == 2 * 3 * 4 * 5 * 2 == space.size()
    for region in space.regions:  # every rule of every region appears
        assert {c.rule(region) for c in cands} == {str(r) for r in RULES[region]}
    llama = Space.of(test_models.build("llama"))
    assert set(llama.idle) == {"qk_norm", "expert_swiglu"} and llama.size() == 80
    moe = Space.of(test_models.build("qwen3_moe"))  # mlp_only_layers=[1]: a dense layer too
    assert moe.idle == {} and moe.size() == 480
    moe_only = Space.of(test_models.build("qwen3_moe", mlp_only_layers=[]))
    assert set(moe_only.idle) == {"swiglu"}


def test_named_profiles_resolve_rope_at_the_models_head_dim(shipped):
    space = Space.of(shipped)  # head_dim 64: SGLang's fp32 cos/sin kernel
    assert space.key_of("sglang").rule("rope") == "fp32/once"
    other = Space("qwen3", 80, space.regions, space.idle)
    assert other.key_of("sglang").rule("rope") == "bf16/per_op"
    assert space.key_of("hf") == space.key_of("liger") == space.key_of("vllm-eager-legacy")


def test_sign_test_counts_closer_tokens():
    data = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0])
    a = torch.tensor([0.0, 0.1, 0.0, 0.3, 0.2])
    b = torch.tensor([0.1, 0.2, 0.0, 0.1, 0.2])
    wins, losses, z = sign_test(a, b, data)
    assert (wins, losses) == (2, 1) and z == pytest.approx(1 / 3**0.5)
    assert sign_test(a, a, data) == (0, 0, 0.0)


# ------------------------------------------------------------------------------------------------------------
# recovery


@pytest.mark.slow
@pytest.mark.parametrize("profile", rounding_profiles())
def test_fit_recovers_each_profile_from_its_prefill_dump(shipped, completions, profile, tmp_path):
    # Through the dump file: fit takes what the reader returns (one Rollout type everywhere).
    write_engine_logprobs(tmp_path / "dump.jsonl", engine_dump(completions, profile))
    dump = read_engine_logprobs(
        tmp_path / "dump.jsonl",
        vocab_size=shipped.config.vocab_size,
        max_model_len=shipped.config.max_position_embeddings,
    )
    result = fit(shipped, dump, screen_tokens=SCREEN)
    truth = result.space.key_of(profile)
    assert truth in result.equivalents, f"{profile}: fitted {result.best.candidate.label()}"
    assert profile in result.named_matches
    assert result.best.metrics["mismatch/bitwise_equal_frac"] == 1.0
    assert result.stats["screen_tokens"] > 0  # the pruning path ran
    assert_determined_regions_true(result, profile)
    # The profile file reproduces the dump bit for bit through roundalign.apply (a path is a profile too).
    result.profile.save(tmp_path / "p.json")
    model = copy.deepcopy(shipped)
    roundalign.apply(model, str(tmp_path / "p.json"))
    for r in dump:
        assert torch.equal(TrainerSide.token_logprobs(model, r), torch.tensor(r.logprobs, dtype=torch.float32))


@pytest.mark.slow
def test_pruning_agrees_with_the_exhaustive_search(shipped, completions):
    for profile, mode in (("vllm", "prefill"), ("hf", "decode")):
        dump = engine_dump(completions, profile, mode)
        pruned, full = fit(shipped, dump, screen_tokens=2 * SCREEN), fit(shipped, dump, exhaustive=True)
        assert full.stats["screen_tokens"] == 0 and full.stats["forwards"] == 240 * len(dump)
        if mode == "prefill":  # exact agreement decides fast: rules drop at screening
            assert pruned.stats["forwards"] < full.stats["forwards"]
        assert set(pruned.equivalents) <= set(full.equivalents)
        assert pruned.best.metrics == full.best.metrics


@pytest.mark.slow
@pytest.mark.parametrize("gemms", ["this cpu", "rows depend on the row count"])
@pytest.mark.parametrize("profile", ["vllm", "hf", "sglang"])
def test_decode_dump_never_determines_a_wrong_rule(shipped, completions, profile, gemms):
    """Decode kernels compute apart from prefill, so fewer tokens are exact: regions may stay unclear, never wrong,
    and the engine's own dump is explained by the model check (no DumpNotExplained), also when the GEMMs' rows
    depend on the call's row count (Intel AMX; emulated here on any CPU)."""
    with gemm_rows_matter() if gemms != "this cpu" else contextlib.nullcontext():
        result = fit(shipped, engine_dump(completions, profile, "decode"), screen_tokens=SCREEN)
    assert result.best.metrics["mismatch/bitwise_equal_frac"] < 1.0
    assert_determined_regions_true(result, profile)


@pytest.mark.slow
@pytest.mark.parametrize("gemms", ["this cpu", "rows depend on the row count"])
def test_vllm_compiled_native_code_fits_the_vllm_profile(shipped, completions, gemms):
    """vLLM's forward_native code under Inductor (the engine's inductor backend), as a real vLLM dump would be: its
    decode dump is explained, and no region is decided wrong. How many regions 40 decode tokens decide depends on
    the CPU's kernels (one flipped bit spreads along a sequence), so ``unclear`` is an accepted answer; the
    prefill dump of the same code, where the kernels are the trainer's, must decide RMSNorm."""
    with gemm_rows_matter() if gemms != "this cpu" else contextlib.nullcontext():
        decode = fit(shipped, engine_dump(completions, "vllm", "decode", backend="inductor"), screen_tokens=SCREEN)
    assert_determined_regions_true(decode, "vllm")
    assert {d["status"] for d in decode.regions.values()} <= {"determined", "identical", "unclear"}
    if gemms == "this cpu":  # a prefill's GEMM calls are the trainer's under either kind: one fit says it
        prefill = fit(shipped, engine_dump(completions, "vllm", "prefill", backend="inductor"), screen_tokens=SCREEN)
        assert_determined_regions_true(prefill, "vllm")
        assert prefill.regions["rms_norm"]["status"] == "determined"


@pytest.mark.slow
@pytest.mark.parametrize("family,profile", [("llama", "vllm-eager"), ("qwen3_moe", "vllm"), ("qwen3_moe", "sglang")])
def test_fit_on_llama_and_moe_against_the_formula_reference(family, profile):
    model = test_models.build(family)
    g = torch.Generator().manual_seed(3)
    dump = []
    for length in (24, 20):
        ids = torch.randint(0, model.config.vocab_size, (1, length), generator=g)
        logp = reference_logits(model, model.config, ids, profile)[0].float().log_softmax(-1)
        picked = logp[5:-1].gather(-1, ids[0, 6:, None])[:, 0]
        dump.append(Rollout(ids[0, :6].tolist(), ids[0, 6:].tolist(), picked.tolist()))
    result = fit(model, dump)
    assert result.space.key_of(profile) in result.equivalents
    assert profile in result.named_matches
    assert_determined_regions_true(result, profile)


# ------------------------------------------------------------------------------------------------------------
# a dump from another checkpoint, or processed log-probs, is refused


def _noisy(model, sigma: float, seed: int = 0):
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.copy_((p.float() * (1 + sigma * torch.randn(p.shape, generator=g))).bfloat16())
    return out


@pytest.mark.slow
def test_wrong_checkpoint_or_processed_logprobs_are_not_fitted(shipped, completions):
    cases = {
        "3% weight noise": engine_dump(completions, "vllm", model=_noisy(shipped, 0.03)),
        "another init": engine_dump(
            completions,
            "vllm",
            model=copy.deepcopy(shipped).apply(
                lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None
            ),
        ),
        "temperature 0.9": engine_dump(completions, "vllm", temperature=0.9),
    }
    for name, dump in cases.items():
        with pytest.raises(DumpNotExplained, match="not explained by any rounding profile") as info:
            fit(shipped, dump, screen_tokens=SCREEN)
        assert info.value.evidence["excess"] > MAX_EXCESS, name
        assert info.value.evidence["kernel_scale"] is not None, name  # refused only after kernels were measured
    # The same model's dump passes the check, with room to spare.
    assert fit(shipped, engine_dump(completions, "vllm"), screen_tokens=SCREEN).excess["excess"] == 0.0


# ------------------------------------------------------------------------------------------------------------
# the command line and the profile file


def _write(path, dump):
    write_engine_logprobs(path, [Rollout(r.prompt_token_ids, r.token_ids, r.logprobs) for r in dump])


@pytest.mark.slow
def test_cli_writes_a_profile_the_other_commands_accept(completions, tmp_path, capsys):
    _write(tmp_path / "dump.jsonl", engine_dump(completions, "sglang"))
    out = tmp_path / "fit"
    assert (
        main(
            [
                "fit",
                "--engine-logprobs",
                str(tmp_path / "dump.jsonl"),
                "--out",
                str(out),
                "--screen-tokens",
                str(SCREEN),
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert set(report["named_matches"]) == {"sglang", "aligned"}  # identical at head_dim 64
    assert report["regions"]["expert_swiglu"]["status"] == "not exercised"
    assert report["best"]["mismatch/bitwise_equal_frac"] == 1.0
    assert report["margin"]["k3_kl_ratio"] is None  # over a best k3_kl of 0: strict JSON has no Infinity
    saved = Profile.load(out / "profile.json")
    assert json.loads((out / "report.json").read_text())["profile"] == saved.to_dict()
    shipped_space = Space.of(load_trainer_model(models.path()))
    assert shipped_space.key_of(saved) == shipped_space.key_of("sglang")
    assert main(["profiles", str(out / "profile.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == saved.name
    # The table output.
    assert (
        main(
            [
                "fit",
                "--engine-logprobs",
                str(tmp_path / "dump.jsonl"),
                "--out",
                str(out),
                "--screen-tokens",
                str(SCREEN),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "fitted rule per region" in text and "sglang, aligned" in text
    assert "240 candidates (2 x 3 x 4 x 5 x 2 rules" in text and "x 4 sequences (160 tokens) = 960 forwards" in text


def test_cli_refuses_a_wrong_checkpoint_with_status_5(shipped, completions, tmp_path, capsys):
    _write(tmp_path / "dump.jsonl", engine_dump(completions, "vllm", model=_noisy(shipped, 0.1)))
    status = main(
        [
            "fit",
            "--engine-logprobs",
            str(tmp_path / "dump.jsonl"),
            "--out",
            str(tmp_path / "o"),
            "--screen-tokens",
            str(SCREEN),
        ]
    )
    assert status == 5
    assert "not explained by any rounding profile" in capsys.readouterr().out
    assert not (tmp_path / "o" / "profile.json").exists()


def test_cli_bad_input(tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    assert main(["fit", "--engine-logprobs", str(missing)]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_token_ids": [1], "token_ids": [2], "log_probs": [-1.0]}\n')
    assert main(["fit", "--engine-logprobs", str(bad)]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"prompt_token_ids": [1], "token_ids": [2], "logprobs": [-1.0]}\n')
    assert main(["fit", "--engine-logprobs", str(ok), "--screen-tokens", "0"]) == 2
    assert "--screen-tokens must be positive" in capsys.readouterr().err
    assert main(["fit", "--engine-logprobs", str(ok), "--exhaustive", "--screen-tokens", "64"]) == 2
    assert "--screen-tokens and --prune-z would be ignored" in capsys.readouterr().err
    assert main(["fit", "--engine-logprobs", str(ok), "--device", "gpu0"]) == 2
    assert "is not a torch device" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["fit", "--engine-logprobs", str(ok), "--device", "cuda"]) == 2
        assert "torch sees none" in capsys.readouterr().err


def test_fit_refuses_a_patched_model_and_an_empty_dump(shipped):
    with pytest.raises(ValueError, match="at least one"):
        fit(shipped, [])
    with pytest.raises(ValueError, match="one engine log-prob per completion token"):
        fit(shipped, [Rollout([1], [2, 3], [-1.0])])
    model = roundalign.apply(copy.deepcopy(shipped), "vllm")
    with pytest.raises(ValueError, match="unpatched"):
        fit(model, [Rollout([1], [2], [-1.0])])


def test_profile_files_are_profiles_everywhere(tmp_path):
    get_profile("vllm").replace(swiglu="round_silu").save(tmp_path / "p.json")
    assert get_profile(str(tmp_path / "p.json")).swiglu == get_profile("vllm-eager").swiglu
    assert get_profile(tmp_path / "p.json") == Profile.load(tmp_path / "p.json")
    with pytest.raises(ValueError, match="does not exist"):
        get_profile(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text('{"name": "x"}')
    with pytest.raises(ValueError, match="not a valid profile"):
        get_profile(str(tmp_path / "bad.json"))
