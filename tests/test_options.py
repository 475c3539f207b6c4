"""roundalign.options, prompts and extras: the pieces every command shares, checked once here.

The sampling options are one definition (type, default, help, range) that probe, dump, calibrate and train read;
config fields carry their help; prompts are read and tokenized one way; a missing extra is named one way.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from roundalign.engines.dump import DumpConfig
from roundalign.errors import MissingDependency, UserError
from roundalign.extras import EXTRAS, require, require_engine
from roundalign.options import SAMPLING, add_sampling_arguments, check_sampling, field_help, option
from roundalign.prompts import read_prompts, round_robin, token_ids


@pytest.mark.parametrize(
    "values, message",
    [
        ({"num_samples": 0}, "--num-samples must be positive, got 0"),
        ({"max_tokens": -3}, "--max-tokens must be positive, got -3"),
        ({"temperature": -0.5}, "--temperature must be >= 0 (0 = greedy), got -0.5"),
        ({"temperature": float("nan")}, "--temperature must be >= 0 (0 = greedy), got nan"),
        ({"top_p": 0.0}, "--top-p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "--top-p must be in (0, 1], got 1.5"),
    ],
)
def test_every_command_refuses_a_sampling_value_in_the_same_words(values, message):
    with pytest.raises(UserError) as info:
        check_sampling(values)
    assert str(info.value) == message
    with pytest.raises(UserError) as again:  # dump's config says it in the same words
        DumpConfig(**values).validate()
    assert str(again.value) == message


def test_in_range_and_unset_values_pass():
    check_sampling({"num_samples": 1, "max_tokens": 1, "temperature": 0.0, "top_p": 1.0, "seed": -7})
    check_sampling(dict.fromkeys(SAMPLING))  # None: not given (probe fills its defaults later)
    check_sampling({"not_a_sampling_option": -1})


def test_sampling_arguments_take_the_commands_defaults_and_fill_help():
    parser = argparse.ArgumentParser()
    add_sampling_arguments(
        parser.add_argument, DumpConfig, {**{k: o.default for k, o in SAMPLING.items()}, "max_tokens": 125}
    )
    args = parser.parse_args([])
    assert (args.num_samples, args.max_tokens, args.top_p, args.seed) == (16, 125, 1.0, 0)
    helps = {a.dest: a.help for a in parser._actions if a.dest in SAMPLING}
    assert helps["max_tokens"] == "max completion tokens (default 125)"
    assert helps["num_samples"] == "completions, prompts round-robin (default 16)"  # the config's own help
    unset = argparse.ArgumentParser()
    add_sampling_arguments(unset.add_argument, DumpConfig, {"top_p": 1.0}, unset=True)
    assert unset.parse_args([]).top_p is None  # not given: the config fills in the default
    assert unset._actions[-1].help == "nucleus sampling, in (0, 1] (default 1.0)"


def test_config_fields_carry_their_help():
    @dataclasses.dataclass(frozen=True)
    class Config:
        out: str = option("runs", "where the runs go (default {default})")

    assert field_help(Config, "out") == "where the runs go (default runs)"
    assert field_help(Config, "out", default="elsewhere") == "where the runs go (default elsewhere)"
    missing = [f.name for f in dataclasses.fields(DumpConfig) if not f.metadata.get("help")]
    assert missing == []
    with pytest.raises(TypeError, match="default_factory"):
        option([], "a mutable default")


def test_prompts_are_read_tokenized_and_cycled(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("two plus two\n[5, 6, 7]\n")
    prompts = read_prompts(path)
    assert prompts == ["two plus two", [5, 6, 7]]

    def tokenizer(text, add_special_tokens):
        assert add_special_tokens is False
        return {"input_ids": [len(w) for w in text.split()]}

    ids = token_ids(prompts, tokenizer)
    assert ids == [[3, 4, 3], [5, 6, 7]]
    assert round_robin(ids, 3) == [[3, 4, 3], [5, 6, 7], [3, 4, 3]]
    with pytest.raises(UserError, match="no tokenizer files"):
        token_ids(["text"], None)
    with pytest.raises(UserError, match="prompt 1 is empty"):
        token_ids([[]], tokenizer)
    path.write_text("ok\n\nmore\n")
    with pytest.raises(UserError, match=r"prompts.txt:2: blank line"):
        read_prompts(path)


def test_a_missing_extra_or_engine_is_named_with_its_fix(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n in ("rich", "vllm") else real(n, *a))
    with pytest.raises(MissingDependency, match=r"the tables needs rich, which is in roundalign's \[cli\] extra"):
        require("rich", "the tables")
    with pytest.raises(MissingDependency, match=r"--engine vllm needs vllm: it is not importable .*make vllm"):
        require_engine("vllm", "--engine vllm", "run it where vLLM is (make vllm builds one)")
    require("matplotlib", "the plots")  # installed: no error
    assert set(EXTRAS.values()) <= {"cli", "tensorboard", "trl", "gym"}
