"""``roundalign probe`` on the command line: bad input exits 2 with a message naming the problem; a small run writes
its report, rollouts and plots."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from roundalign.cli import main
from tests.vllm_native import tiny_qwen3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    tiny_qwen3(seed=5, num_hidden_layers=2, vocab_size=128, hidden_size=128, intermediate_size=256).save_pretrained(
        path
    )
    return path


def _fails(capsys, argv, *words):
    assert main(["probe", *argv]) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, err
    return err


def test_missing_model_directory(capsys, tmp_path):
    _fails(capsys, ["--model", str(tmp_path / "nope"), "--out", str(tmp_path)], "does not exist")


def test_directory_without_config(capsys, tmp_path):
    _fails(capsys, ["--model", str(tmp_path), "--out", str(tmp_path / "o")], "no config.json")


def test_corrupt_weights(capsys, tmp_path, model_dir):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((model_dir / "config.json").read_text())
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    _fails(capsys, ["--model", str(bad), "--out", str(tmp_path / "o")], "cannot load the weights")


def test_corrupt_config(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    _fails(capsys, ["--model", str(tmp_path), "--out", str(tmp_path / "o")], "config.json")


def test_unsupported_family(capsys, tmp_path):
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    _fails(capsys, ["--model", str(tmp_path), "--out", str(tmp_path / "o")], "'gpt2' is not supported", "qwen3")


def test_empty_prompt_file(capsys, tmp_path, model_dir):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n\n")
    _fails(capsys, ["--model", str(model_dir), "--prompts", str(prompts), "--out", str(tmp_path)], "empty")


def test_blank_line_in_prompt_file(capsys, tmp_path, model_dir):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("[1, 2, 3]\n\n[4, 5]\n")
    _fails(capsys, ["--model", str(model_dir), "--prompts", str(prompts), "--out", str(tmp_path)], ":2:", "blank")


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--max-tokens", "0"], ["--max-tokens", "positive"]),
        (["--temperature", "-0.5"], ["--temperature"]),
        (["--top-p", "0"], ["--top-p", "(0, 1]"]),
        (["--top-p", "1.5"], ["--top-p", "(0, 1]"]),
        (["--engine-profile", "vlm"], ["unknown profile 'vlm'", "vllm"]),
        (["--trainer-profiles", "hf,nope"], ["unknown profile 'nope'"]),
        (["--backends", "tensorrt"], ["unknown engine backend", "kernels"]),
        (["--num-samples", "0"], ["--num-samples"]),
    ],
)
def test_bad_options(capsys, tmp_path, model_dir, argv, words):
    _fails(capsys, ["--model", str(model_dir), "--out", str(tmp_path), *argv], *words)


def test_bad_jsonl_line_is_an_error_with_its_line_number(capsys, tmp_path, model_dir):
    dump = tmp_path / "dump.jsonl"
    good = {"prompt_token_ids": [1, 2], "token_ids": [3, 4], "logprobs": [-0.5, -1.0]}
    bad = {"prompt_token_ids": [1, 2], "token_ids": [3, 4], "logprobs": [-0.5]}
    dump.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    _fails(capsys, ["--model", str(model_dir), "--engine-logprobs", str(dump), "--out", str(tmp_path)], ":2:")


def test_small_run_writes_report_rollouts_and_plots(capsys, tmp_path, model_dir):
    from roundalign.probe.report import load_report

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("[1, 2, 3, 4]\n[5, 6]\n[7, 8, 9]\n")
    out = tmp_path / "out"
    argv = [
        "--model",
        str(model_dir),
        "--prompts",
        str(prompts),
        "--num-samples",
        "3",
        "--max-tokens",
        "6",
        "--backends",
        "kernels",
        "--out",
        str(out),
    ]
    assert main(["probe", *argv]) == 0
    text = capsys.readouterr().out
    assert "k3" in text and "hf" in text and "vllm" in text
    report = load_report(out / "report.json")  # validates against the schema
    assert report["tokens"]["sequences"] == 3
    # The default run: the reference engine with its decode-consistent kernels, and three trainers: stock HF, the
    # rounding rules alone, and the same kernels, which is exactly on-policy (decode and prefill references alike).
    assert report["engine"]["profile"]["name"] == "vllm-reference-kernels"
    assert {c["trainer_profile"] for c in report["comparisons"]} == {"hf", "vllm", "vllm-reference-kernels"}
    for c in report["comparisons"]:
        exact = c["metrics"]["mismatch/bitwise_equal_frac"] == 1.0 and c["metrics"]["rollout_corr/k3_kl"] == 0.0
        assert exact == (c["trainer_profile"] == "vllm-reference-kernels"), c
    for name in ("log_ratio_hist.png", "layer_agreement.png", "attribution.png"):
        assert (out / name).stat().st_size > 5000
    lines = (out / "rollouts.jsonl").read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[1])["prompt_token_ids"] == [5, 6]
    assert all(torch.tensor(json.loads(x)["logprobs"]).le(0).all() for x in lines)


def test_profile_files_are_accepted_as_engine_and_trainer_profiles(capsys, tmp_path, model_dir):
    """A profile file (as fit and calibrate write) works wherever a profile name does: the engine samples with its
    rules and the trainer computes with them, under the file's profile name."""
    from roundalign.probe.report import load_report
    from roundalign.profiles import get_profile

    mine = get_profile("vllm").replace(qk_norm="round_after_weight")  # rules no built-in profile has
    mine = type(mine)(**{**mine.__dict__, "name": "mine"})
    mine.save(tmp_path / "mine.json")
    out, prompts = tmp_path / "out", tmp_path / "prompts.txt"
    prompts.write_text("[1, 2, 3, 4]\n")
    argv = ["--model", str(model_dir), "--prompts", str(prompts), "--engine-profile", str(tmp_path / "mine.json")]
    argv += ["--trainer-profiles"]
    argv += [f"hf,{tmp_path / 'mine.json'}", "--num-samples", "2", "--max-tokens", "4", "--backends", "kernels"]
    argv += ["--layer-sequences", "0", "--no-plots", "--out", str(out)]
    assert main(["probe", *argv]) == 0, capsys.readouterr().err
    report = load_report(out / "report.json")
    assert report["engine"]["profile"]["name"] == "mine"
    assert report["engine"]["profile"]["qk_norm"] == "round_after_weight"
    by = {(c["trainer_profile"], c["reference"]): c["metrics"] for c in report["comparisons"]}
    assert set(by) == {(p, r) for p in ("hf", "mine") for r in ("decode", "prefill")}
    # The reference engine and the trainer under the same rules agree bit for bit in prefill (docs/engine.md).
    assert by[("mine", "prefill")]["mismatch/bitwise_equal_frac"] == 1.0


def test_sampling_options_with_an_imported_dump_are_errors(capsys, tmp_path, model_dir):
    """--engine-logprobs replaces sampling: a sampling option beside it would be silently ignored, so it is refused."""
    dump = tmp_path / "dump.jsonl"
    dump.write_text(json.dumps({"prompt_token_ids": [1, 2], "token_ids": [3, 4], "logprobs": [-0.5, -1.0]}) + "\n")
    argv = ["--model", str(model_dir), "--engine-logprobs", str(dump), "--out", str(tmp_path / "o")]
    err = _fails(
        capsys,
        [*argv, "--num-samples", "3", "--temperature", "0.5"],
        "--num-samples",
        "--temperature",
        "would be ignored",
    )
    assert "Traceback" not in err
    _fails(capsys, [*argv, "--backends", "kernels"], "--backends")
    assert not (tmp_path / "o").exists()


def test_the_inductor_backend_refuses_a_profile_it_does_not_implement(capsys, tmp_path, model_dir):
    """The inductor backend runs vLLM's compiled code whatever the profile: under sglang it would be mislabelled."""
    _fails(
        capsys,
        ["--model", str(model_dir), "--engine-profile", "sglang", "--backends", "inductor", "--out", str(tmp_path)],
        "inductor",
        "cannot serve profile 'sglang'",
        "kernels backend",
    )


def test_by_default_backends_follow_the_profile_rules_not_its_name(tmp_path, model_dir):
    """A renamed copy of vllm's rules gets both backends; sglang's rules only the kernels backend."""
    from roundalign.probe.run import ProbeConfig
    from roundalign.profiles import get_profile

    renamed = tmp_path / "mine.json"
    renamed.write_text(json.dumps(get_profile("vllm").to_dict() | {"name": "mine"}))
    assert ProbeConfig(model=str(model_dir), engine_profile=str(renamed)).validate().backends == ("kernels", "inductor")
    assert ProbeConfig(model=str(model_dir), engine_profile="sglang").validate().backends == ("kernels",)


def test_unsupported_rope_type_is_bad_input_with_an_honest_hint(capsys, tmp_path):
    """A RoPE type whose angles roundalign does not compute ends in exit 2 and one message, not a traceback; it does
    not send the user to --engine-logprobs, which needs the same trainer-side patch."""
    tiny_qwen3(
        seed=0,
        num_hidden_layers=1,
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    ).save_pretrained(tmp_path)
    capsys.readouterr()  # save_pretrained's progress bar
    err = _fails(
        capsys,
        ["--model", str(tmp_path), "--out", str(tmp_path / "o")],
        "rope_type 'dynamic' is not supported",
        "cannot run on it",
    )
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_device_is_checked(capsys, tmp_path, model_dir):
    _fails(capsys, ["--model", str(model_dir), "--device", "gpu0", "--out", str(tmp_path)], "is not a torch device")
