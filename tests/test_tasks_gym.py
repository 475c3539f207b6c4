"""roundalign.tasks.gym: items from reasoning-gym's seeded generators, scored by its verifiers; the --domains reader.

The scores are checked against reasoning-gym itself: each item's completion is also scored by a dataset object this
test builds with ``reasoning_gym.create_dataset`` (not gym.py's cached scorer), and each item's entry is compared with
the one reasoning-gym's generator gives for the seed gym.py documents. Tests that need reasoning-gym (the ``[gym]``
extra) skip without it; the spec errors that come before its registry and the missing-extra message do not need it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from roundalign.errors import MissingDependency, UserError
from roundalign.tasks import gym
from roundalign.tasks.gym import BUILTIN_DOMAINS, DEFAULT_DOMAINS, EOS_TEXT, Domain, extract_answer, parse_domains

N = 24  # items per domain: every dataset of every built-in domain several times over, in well under a second
WORDS = "words=spell_backward+word_sorting"


def _rg():
    return pytest.importorskip("reasoning_gym")


def _fingerprint(items):
    return [(it.prompt, it.answer, it.domain, it.dataset, it.entry) for it in items]


# --- extract_answer ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        (" 42<|endoftext|>", "42"),
        ("  drib \n<|endoftext|> trailing text", "drib"),  # stripped; what follows end-of-text is not the answer
        (" 7<|endoftext|> 8<|endoftext|>", "7"),  # the first end-of-text ends it
        (" 0.25", "0.25"),  # no end-of-text (a completion cut at max tokens): all of it
        (" a b ", "a b"),  # inner spaces stay
        ("", None),
        (" ", None),
        (" \n\t ", None),
        ("<|endoftext|>", None),
        ("   <|endoftext|> 42", None),  # an answer only after end-of-text is no answer
    ],
)
def test_extract_answer_is_the_text_before_end_of_text_stripped(completion, answer):
    assert extract_answer(completion) == answer


@pytest.mark.parametrize("bad", [None, 42, b" 42<|endoftext|>", [" 42"]])
def test_extract_answer_refuses_what_is_not_a_str(bad):
    with pytest.raises(TypeError, match="must be a str"):
        extract_answer(bad)


# --- parse_domains: the reader of --domains ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "fragments"),
    [
        ("nope", ["unknown domain 'nope'", "built-in: arithmetic, algorithmic, counting, probability", "nope=dataset"]),
        ("words=", ["domain 'words' is empty", "e.g. words=spell_backward"]),
        (" words = ", ["domain 'words' is empty"]),
        ("a=spell_backward+", ["domain 'a'", "empty dataset name in 'spell_backward+'", "single +"]),
        ("a=spell_backward++count_bits", ["empty dataset name in 'spell_backward++count_bits'"]),
        ("arithmetic,,counting", ["'arithmetic,,counting' has an empty entry", "single commas"]),
        ("arithmetic,", ["has an empty entry"]),
        ("arithmetic,counting,arithmetic", ["['arithmetic'] more than once", "each domain once"]),
        ("w=spell_backward+spell_backward", ["domain 'w'", "['spell_backward'] more than once", "each dataset once"]),
        ("Words=spell_backward", ["'Words' is not a domain name", "lower-case letters, digits and _"]),
        ("2x", ["'2x' is not a domain name"]),
        ("=spell_backward", ["'' is not a domain name"]),
        ("my-words=spell_backward", ["'my-words' is not a domain name"]),
        ("", ["must name at least one domain", "built-in: arithmetic"]),
        ("  ", ["must name at least one domain"]),
    ],
)
def test_a_bad_spec_is_a_user_error_that_names_the_bad_part_and_the_fix(spec, fragments):
    """These are found before reasoning-gym's registry is read: they need no reasoning-gym."""
    with pytest.raises(UserError) as caught:
        parse_domains(spec)
    assert not isinstance(caught.value, MissingDependency)
    for fragment in fragments:
        assert fragment in str(caught.value)


def test_unknown_datasets_and_repeated_written_out_domains_are_user_errors():
    _rg()
    with pytest.raises(UserError) as caught:
        parse_domains("arithmetic,words=spell_backward+no_such_dataset+also_not")
    message = str(caught.value)
    assert "domain 'words'" in message and "['no_such_dataset', 'also_not']" in message
    assert "known: " in message and "spell_backward" in message and "word_sorting" in message  # the fix: real names
    with pytest.raises(UserError, match=r"\['w'\] more than once; each domain once"):
        parse_domains("w=spell_backward,arithmetic,w=count_bits")


def test_built_in_domains_are_read_in_the_order_given():
    _rg()
    domains = parse_domains(DEFAULT_DOMAINS)
    assert [d.name for d in domains] == list(BUILTIN_DOMAINS) == DEFAULT_DOMAINS.split(",")
    assert all(d.datasets == BUILTIN_DOMAINS[d.name] for d in domains)
    assert [d.name for d in parse_domains(" probability , arithmetic ")] == ["probability", "arithmetic"]


def test_a_written_out_domain_groups_its_datasets_with_their_default_configs():
    _rg()
    assert parse_domains(f"counting, {WORDS.replace('+', ' + ')}") == (
        Domain("counting", BUILTIN_DOMAINS["counting"]),
        Domain("words", (("spell_backward", {}), ("word_sorting", {}))),
    )
    # a built-in's name written out is the datasets written, with reasoning-gym's default configs, not the built-in
    assert parse_domains("algorithmic=spell_backward") == (Domain("algorithmic", (("spell_backward", {}),)),)


@pytest.mark.parametrize("spec", [DEFAULT_DOMAINS, f"probability,{WORDS},arithmetic", "algorithmic=spell_backward"])
def test_spec_reads_back_as_the_same_domains(spec):
    _rg()
    domains = parse_domains(spec)
    specs = [d.spec() for d in domains]
    assert parse_domains(",".join(specs)) == domains
    assert [parse_domains(s) for s in specs] == [(d,) for d in domains]
    assert [d.spec() for d in parse_domains(DEFAULT_DOMAINS)] == list(BUILTIN_DOMAINS)  # a built-in by its name


# --- without reasoning-gym --------------------------------------------------------------------------------------------


def test_without_reasoning_gym_the_error_names_the_gym_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` raises ModuleNotFoundError
    with pytest.raises(ModuleNotFoundError) as plain:
        import reasoning_gym  # noqa: F401
    assert plain.value.name == "reasoning_gym"
    for call in (
        lambda: parse_domains("arithmetic"),
        lambda: parse_domains(WORDS),
        lambda: gym.make_items(Domain("fresh", (("spell_backward", {}),)), 3, seed=987654321),  # not in its cache
    ):
        with pytest.raises(MissingDependency) as caught:
            call()
        message = str(caught.value)
        assert "reasoning-gym" in message and "[gym] extra" in message and "pip install -e '.[gym]'" in message


def test_a_broken_reasoning_gym_is_not_reported_as_missing(monkeypatch, tmp_path):
    """Installed, but one of its own imports fails: the message says that, not "install the extra"."""
    package = tmp_path / "reasoning_gym"
    package.mkdir()
    (package / "__init__.py").write_text("import roundalign_test_no_such_module\n")
    monkeypatch.delitem(sys.modules, "reasoning_gym", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError) as caught:
        parse_domains("arithmetic")
    assert not isinstance(caught.value, MissingDependency)
    assert "installed but does not import" in str(caught.value)
    assert "roundalign_test_no_such_module" in str(caught.value) and "reinstall" in str(caught.value)


# --- make_items -------------------------------------------------------------------------------------------------------


def test_make_items_returns_n_items_and_refuses_a_bad_n():
    _rg()
    (domain,) = parse_domains("arithmetic")
    for n in (0, 1, 2, 5, N):
        items = gym.make_items(domain, n, seed=1)
        assert len(items) == n and all(isinstance(it, gym.Item) for it in items)
    for bad in (-1, 1.0, "3", True, None):
        with pytest.raises(ValueError, match="non-negative int"):
            gym.make_items(domain, bad, seed=1)


def test_make_items_is_a_function_of_the_domain_and_the_seed():
    _rg()
    domains = parse_domains(f"{DEFAULT_DOMAINS},{WORDS}")
    first = [_fingerprint(gym.make_items(d, N, seed=5)) for d in domains]
    gym._DATASET_CACHE.clear()  # built again, not read from the cache
    assert [_fingerprint(gym.make_items(d, N, seed=5)) for d in domains] == first
    for d, same in zip(domains, first, strict=True):
        other = gym.make_items(d, N, seed=6)
        assert [it.prompt for it in other] != [p for p, *_ in same], d.name
    # a domain's name is part of its seed: the same datasets under two names give different items
    a, b = (gym.make_items(Domain(name, (("spell_backward", {}),)), N, seed=5) for name in ("a", "b"))
    assert [it.prompt for it in a] != [it.prompt for it in b]


def test_the_items_are_the_same_in_another_python_process():
    """The seeds come from sha256, not hash(): a rerun (another PYTHONHASHSEED) sees the same prompts."""
    _rg()
    code = (
        "import json, sys\n"
        "from roundalign.tasks import gym\n"
        "ds = gym.parse_domains(sys.argv[1])\n"
        "print(json.dumps([[it.prompt, it.answer] for d in ds for it in gym.make_items(d, 12, seed=3)]))\n"
    )
    spec = f"{DEFAULT_DOMAINS},{WORDS}"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code, spec], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    here = [[it.prompt, it.answer] for d in parse_domains(spec) for it in gym.make_items(d, 12, seed=3)]
    assert json.loads(proc.stdout) == here


@pytest.mark.parametrize("spec", [*BUILTIN_DOMAINS, WORDS])
def test_items_interleave_the_datasets_and_are_reasoning_gyms_own_entries(spec):
    """Item i comes from dataset i mod k; dataset j's items, in order, are reasoning-gym's generator's entries for
    ``create_dataset(name, size=count, seed=s, **config)`` with gym.py's documented seed of (seed, domain, dataset)."""
    rg = _rg()
    (domain,) = parse_domains(spec)
    n, seed, k = 11, 42, len(domain.datasets)  # 11: the datasets of a two-dataset domain get 6 and 5 items
    items = gym.make_items(domain, n, seed=seed)
    assert [it.dataset for it in items] == [domain.datasets[i % k][0] for i in range(n)]
    assert {it.domain for it in items} == {domain.name}
    for j, (name, config) in enumerate(domain.datasets):
        mine = items[j::k]
        ds = rg.create_dataset(name, size=len(mine), seed=gym._seed(seed, domain.name, name), **config)
        assert [it.entry for it in mine] == [ds[i] for i in range(len(mine))]
        for it in mine:
            assert it.entry["metadata"]["source_dataset"] == name
            assert it.prompt == str(it.entry["question"]).strip() + "\nAnswer:"
            assert it.answer == str(it.entry["answer"]) and it.solution == " " + it.answer


def _longer_text_ratio(answer: str | None, oracle: str) -> float:
    """1 for a right coin_flip answer; else min / max of the two numbers' texts (written out here from reasoning-gym's
    scorer: ``f"{float(Fraction(x)):.10g}"``)."""
    from fractions import Fraction

    try:
        a, o = float(Fraction(answer)), float(Fraction(oracle))
    except (TypeError, ValueError, ZeroDivisionError):
        return 1.0  # the scorer gave 0 already
    if abs(a - o) <= 1e-4:
        return 1.0
    return min(len(f"{a:.10g}"), len(f"{o:.10g}")) / max(len(f"{a:.10g}"), len(f"{o:.10g}"))


@pytest.mark.parametrize("name", list(BUILTIN_DOMAINS))
def test_every_built_in_domain_scores_its_reference_1_and_no_answer_0_as_reasoning_gym_does(name):
    rg = _rg()
    (domain,) = parse_domains(name)
    items = gym.make_items(domain, N, seed=2026)
    assert {it.dataset for it in items} == {d for d, _ in BUILTIN_DOMAINS[name]}
    assert len({it.prompt for it in items}) > N // 2  # not one question repeated
    # reasoning-gym's own scorers, built here: a dataset object of each dataset with the domain's config
    scorers = {d: rg.create_dataset(d, size=1, seed=7, **config) for d, config in domain.datasets}
    for it in items:
        ref = scorers[it.dataset]
        completions = [
            it.solution + EOS_TEXT,  # the reference completion
            it.solution + EOS_TEXT + " 12345",  # what follows end-of-text is not read
            it.solution,  # cut before end-of-text: the answer is all of it
            " ",  # no answer
            "<|endoftext|>",
            " 12345" + EOS_TEXT,  # wrong (or, for some datasets, partly right: reasoning-gym's partial credit)
            " " + it.answer + "0" + EOS_TEXT,
            " nope" + EOS_TEXT,
        ]
        got = [gym.score(c, it) for c in completions]
        assert got[:3] == [1.0, 1.0, 1.0], (it.prompt, it.answer)
        assert got[3:5] == [0.0, 0.0], it.prompt
        expected = [float(ref.score_answer(answer=extract_answer(c), entry=it.entry)) for c in completions]
        if it.dataset == "coin_flip":  # the one correction: a wrong answer's prefix credit over the longer text
            ratios = [_longer_text_ratio(extract_answer(c), it.answer) for c in completions]
            expected = [e * r for e, r in zip(expected, ratios, strict=True)]
        assert got == expected, (it.prompt, it.answer)
        assert ref.score_answer(answer=it.answer, entry=it.entry) == 1.0
        assert ref.score_answer(answer=None, entry=it.entry) == 0.0
        assert all(0.0 <= s <= 1.0 for s in got)


def test_a_written_out_domain_is_scored_by_reasoning_gym_too():
    rg = _rg()
    (domain,) = parse_domains(WORDS)
    for it in gym.make_items(domain, 6, seed=3):
        ref = rg.create_dataset(it.dataset, size=1, seed=0)
        assert gym.score(it.solution + EOS_TEXT, it) == 1.0 == ref.score_answer(answer=it.answer, entry=it.entry)
        assert gym.score(" ", it) == 0.0
        wrong = " zzz" + EOS_TEXT
        assert gym.score(wrong, it) == float(ref.score_answer(answer="zzz", entry=it.entry))


def test_a_prefix_of_a_coin_flip_answer_is_not_full_credit():
    """reasoning-gym 0.1.25 scores a wrong coin_flip answer by its matching prefix over the shorter text, so " 0"
    would score 1.0 against 0.9375; gym.score divides by the longer text (6 characters here): 1/6."""
    pytest.importorskip("reasoning_gym")
    domain = gym.parse_domains("probability")[0]
    item = next(it for it in gym.make_items(domain, 64, seed=1_000_003) if it.answer == "0.9375")
    assert gym.score(" 0", item) == 1 / 6
    assert gym.score(" 0.93", item) == 4 / 6
    assert gym.score(" 0.9375<|endoftext|>", item) == gym.score(" 15/16", item) == 1.0
    assert gym.score(" 0.5", item) == 2 / 6  # "0." matches
    assert gym.score(" heads", item) == 0.0


# Sampled text a verifier must survive: numbers too large for a float, a zero denominator, an exponent of a billion
# (Fraction("1e999999999") builds 10 ** 999999999 and does not return), garbage. Every one scores in [0, 1] and none
# raises: an exception here ends an RL run in the middle of a step (a grid cell died on " 1e400" in coin_flip).
ADVERSARIAL = ["1e400", "-1e400", "1e-400", "1e999", "1/0", "0/0", "nan", "inf", "-inf", "9" * 400, "1/" + "9" * 400,
               "(", "1e", "--1", "1/2/3", "0x10", "１２", "1_000", "\x00", "+", "1/1e400", "1e400/1"]  # fmt: skip


@pytest.mark.parametrize("name", sorted(BUILTIN_DOMAINS))
def test_adversarial_answers_score_in_0_1_and_never_raise(name):
    _rg()
    for item in gym.make_items(parse_domains(name)[0], 4, seed=3):
        for text in ADVERSARIAL:
            assert 0.0 <= gym.score(" " + text + EOS_TEXT, item) <= 1.0, (item.dataset, text)


def test_a_float_overflow_in_coin_flips_verifier_is_a_wrong_answer():
    """reasoning-gym 0.1.25's coin_flip raises OverflowError on float(Fraction("1e400")); the answer scores 0."""
    _rg()
    item = gym.make_items(parse_domains("probability")[0], 1, seed=3)[0]
    with pytest.raises(OverflowError):  # the verifier itself: if this stops raising, the guard may go
        gym._scorer("coin_flip").score_answer(answer="1e400", entry=item.entry)
    assert gym.score(" 1e400", item) == gym.score(" -1e400", item) == 0.0


@pytest.mark.parametrize("text", ["1e999999999", "1E+1_000_000", "-2.5e-0001000", "7e12345  "])
def test_an_exponent_beyond_999_scores_0_without_calling_the_verifier(monkeypatch, text):
    """The verifier is never handed it: Fraction() would expand the power exactly and hang the run."""

    class Refuse:
        def score_answer(self, answer, entry):
            raise AssertionError(f"the verifier was called with {answer!r}")

    monkeypatch.setattr(gym, "_scorer", lambda dataset: Refuse())
    item = gym.Item(prompt="p", answer="0.5", domain="probability", dataset="coin_flip", entry={"answer": "0.5"})
    assert gym.score(" " + text, item) == 0.0


@pytest.mark.parametrize("text", ["1e999", "1e-0999", "0.5", "5e-1"])
def test_an_exponent_up_to_999_still_goes_to_the_verifier(monkeypatch, text):
    seen = []

    class Record:
        def score_answer(self, answer, entry):
            seen.append(answer)
            return 0.0

    monkeypatch.setattr(gym, "_scorer", lambda dataset: Record())
    item = gym.Item(prompt="p", answer="0.5", domain="probability", dataset="coin_flip", entry={"answer": "0.5"})
    assert gym.score(" " + text, item) == 0.0 and seen == [text]
