"""Multi-domain tasks from reasoning-gym: procedurally generated questions, scored by reasoning-gym's own verifiers.

A *domain* is a named group of reasoning-gym datasets, each with its config. Multi-domain RL (``roundalign train
--domains ...``, docs/multi-domain.md) samples every step's prompts from several domains and reports the reward of
each; OSOL's focus domain is one of them. Built-in domains, sized so that a few-million-parameter character-level
model can learn them (the shipped ``tiny-llama-chars`` was trained on exactly these)::

    arithmetic   basic_arithmetic (two one-digit terms, + -), chain_sum (two or three terms up to 20)
    algorithmic  spell_backward (words of 3 to 5 letters)
    counting     letter_counting (2 to 4 words), count_bits (numbers up to 63)
    probability  coin_flip (2 to 10 flips)

A domain can also be written out: ``words=spell_backward+word_sorting`` groups those datasets under the name
``words``, each with reasoning-gym's default config (whose prompts may be long). ``parse_domains`` reads a
comma-separated list of either form.

Prompt and completion (one line each)::

    prompt:      Spell this word backward (example: sun -> nus): bird
                 Answer:
    completion:   drib<|endoftext|>

The answer is the completion's text up to the end-of-text token, stripped; reasoning-gym's ``score_answer`` scores it
(1.0 for a correct answer; some datasets give partial credit). A completion with no answer (empty, or only spaces)
scores 0.0, as reasoning-gym scores ``None``.

Items are a pure function of (domain spec, seed): ``make_items`` builds each dataset with reasoning-gym's own seeded
generator (``create_dataset(name, size=n, seed=s, **config)``), so a resumed run and a rerun see the same prompts.
reasoning-gym is an optional extra (``pip install roundalign[gym]``); nothing is downloaded at run time, its data
files ship inside its wheel.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

from roundalign.errors import MissingDependency, UserError

ANSWER_CUE = "\nAnswer:"  # the prompt ends here; the model continues with " <answer>" and end-of-text
EOS_TEXT = "<|endoftext|>"

# name -> ((dataset, config), ...): small configs, so that short prompts and short answers keep a tiny model's
# rewards away from 0 and 1 (docs/tiny-model.md, tiny-llama-chars).
BUILTIN_DOMAINS: dict[str, tuple[tuple[str, dict], ...]] = {
    "arithmetic": (
        ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                              "operators": ("+", "-"), "allow_parentheses": False, "allow_negation": False}),
        ("chain_sum", {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}),
    ),
    "algorithmic": (("spell_backward", {"min_word_len": 3, "max_word_len": 5}),),
    "counting": (
        ("letter_counting", {"min_words": 2, "max_words": 4}),
        ("count_bits", {"min_n": 1, "max_n": 63}),
    ),
    "probability": (("coin_flip", {"min_trials": 2, "max_trials": 10}),),
}  # fmt: skip
DEFAULT_DOMAINS = "arithmetic,algorithmic,counting,probability"
_NAME = re.compile(r"[a-z][a-z0-9_]*")


def _reasoning_gym():
    try:
        import reasoning_gym
    except ModuleNotFoundError as exc:
        if exc.name != "reasoning_gym":  # installed, but broken: say what it lacks rather than "not installed"
            raise UserError(f"reasoning-gym is installed but does not import: {exc}; reinstall it") from None
        raise MissingDependency("reasoning-gym", "gym", "multi-domain tasks (--domains)") from None
    return reasoning_gym


@dataclass(frozen=True)
class Domain:
    """A named group of reasoning-gym datasets with their configs."""

    name: str
    datasets: tuple[tuple[str, dict], ...]

    def spec(self) -> str:
        """How ``parse_domains`` reads this domain back (a built-in's name, or ``name=a+b``)."""
        if BUILTIN_DOMAINS.get(self.name) == self.datasets:
            return self.name
        return f"{self.name}=" + "+".join(d for d, _ in self.datasets)


@dataclass(frozen=True)
class Item:
    """One question: ``prompt`` (what the model is given), the reference ``answer``, where it comes from, and
    reasoning-gym's entry (what its scorer reads)."""

    prompt: str
    answer: str
    domain: str
    dataset: str
    entry: dict = field(repr=False, compare=False)

    @property
    def solution(self) -> str:
        """The reference completion, without end-of-text."""
        return " " + self.answer


def parse_domains(spec: str) -> tuple[Domain, ...]:
    """``"arithmetic,counting"`` or ``"arithmetic,words=spell_backward+word_sorting"`` -> domains, in order.

    Raises ``UserError`` naming the bad part: an unknown domain, an unknown dataset, an empty domain, a repeated name
    (of a domain, or of a dataset within one).
    Dataset names are checked against reasoning-gym's registry (so it must be installed)."""
    if not isinstance(spec, str) or not spec.strip():
        raise UserError(
            f"--domains must name at least one domain (built-in: {', '.join(BUILTIN_DOMAINS)}), got {spec!r}"
        )
    domains: list[Domain] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            raise UserError(f"--domains {spec!r} has an empty entry; separate domains with single commas")
        name, eq, datasets = part.partition("=")
        name = name.strip()
        if not _NAME.fullmatch(name):
            raise UserError(f"--domains: {name!r} is not a domain name (lower-case letters, digits and _)")
        if not eq:
            if name not in BUILTIN_DOMAINS:
                raise UserError(
                    f"--domains: unknown domain {name!r}; built-in: {', '.join(BUILTIN_DOMAINS)}, or write one out "
                    f"as {name}=dataset+dataset with reasoning-gym dataset names"
                )
            domains.append(Domain(name, BUILTIN_DOMAINS[name]))
            continue
        names = [d.strip() for d in datasets.split("+")]
        if not any(names):
            raise UserError(f"--domains: domain {name!r} is empty; give it datasets, e.g. {name}=spell_backward")
        if "" in names:
            raise UserError(
                f"--domains: domain {name!r} has an empty dataset name in {datasets!r}; separate datasets with single +"
            )
        twice = sorted({d for d in names if names.count(d) > 1})
        if twice:  # the same seed would give the same items: each would come twice in a row
            raise UserError(f"--domains: domain {name!r} names dataset(s) {twice} more than once; each dataset once")
        registry = _registry()
        unknown = [d for d in names if d not in registry]
        if unknown:
            raise UserError(
                f"--domains: domain {name!r} names unknown reasoning-gym dataset(s) {unknown}; "
                f"known: {', '.join(sorted(registry))}"
            )
        domains.append(Domain(name, tuple((d, {}) for d in names)))
    seen = [d.name for d in domains]
    repeated = sorted({n for n in seen if seen.count(n) > 1})
    if repeated:
        raise UserError(f"--domains names {repeated} more than once; each domain once")
    for d in domains:
        for dataset, _ in d.datasets:
            if dataset not in _registry():
                raise UserError(f"domain {d.name!r}: reasoning-gym {_version()} has no dataset {dataset!r}")
    return tuple(domains)


def _registry() -> dict:
    _reasoning_gym()  # names the extra when it is missing
    from reasoning_gym.factory import DATASETS

    return DATASETS


def _version() -> str:
    from importlib.metadata import version

    return version("reasoning_gym")


def _seed(seed: int, *parts: object) -> int:
    """A 31-bit seed from (seed, parts) with sha256: stable across Python runs and platforms."""
    digest = hashlib.sha256("/".join(["roundalign.gym", str(seed), *map(str, parts)]).encode()).digest()
    return int.from_bytes(digest[:8], "little") % 2**31


_DATASET_CACHE: dict[tuple, object] = {}


def _dataset(name: str, config: dict, size: int, seed: int):
    key = (name, tuple(sorted(config.items())), size, seed)
    if key not in _DATASET_CACHE:
        if len(_DATASET_CACHE) > 256:
            _DATASET_CACHE.clear()
        _DATASET_CACHE[key] = _reasoning_gym().create_dataset(name, size=size, seed=seed, **config)
    return _DATASET_CACHE[key]


def make_items(domain: Domain, n: int, seed: int) -> list[Item]:
    """``n`` items of ``domain``, its datasets in turn (item i from dataset i mod k), the same for the same seed."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    k = len(domain.datasets)
    out: list[Item] = []
    for j, (name, config) in enumerate(domain.datasets):
        count = len(range(j, n, k))
        if not count:
            continue
        ds = _dataset(name, config, count, _seed(seed, domain.name, name))
        out += [_item(ds[i], domain.name, name) for i in range(count)]
    # interleave: dataset j's i-th item goes to position i * k + j
    by_dataset = [[it for it in out if it.dataset == name] for name, _ in domain.datasets]
    return [by_dataset[i % k][i // k] for i in range(n)]


def _item(entry: dict, domain: str, dataset: str) -> Item:
    question = str(entry["question"]).strip()
    return Item(prompt=question + ANSWER_CUE, answer=str(entry["answer"]), domain=domain, dataset=dataset, entry=entry)


def extract_answer(completion_text: str) -> str | None:
    """The answer in a completion: its text before end-of-text, stripped; None when nothing is left."""
    if not isinstance(completion_text, str):
        raise TypeError(f"completion_text must be a str, got {type(completion_text).__name__}")
    text = completion_text.split(EOS_TEXT, 1)[0].strip()
    return text or None


def score(completion_text: str, item: Item) -> float:
    """reasoning-gym's score of the completion's answer for ``item``, in [0, 1]; 0.0 when it gives no answer, or a
    number no verifier should be handed (an exponent beyond 999, or one its float() overflows on).

    One correction: reasoning-gym 0.1.25's coin_flip gives a wrong answer the length of its matching prefix over the
    *shorter* of the two numbers' texts, so any prefix of the right answer scores 1.0 (" 0" scores 1.0 on 61 of the
    64 held-out items, whose answers are 0.xxx). An RL loop learns that at once. Here a wrong coin_flip answer's
    partial credit is over the *longer* text instead (a right one, within reasoning-gym's tolerance, still 1.0)."""
    answer = extract_answer(completion_text)
    if answer is None or _huge_exponent(answer):
        return 0.0
    try:
        value = float(_scorer(item.dataset).score_answer(answer=answer, entry=item.entry))
        if item.dataset == "coin_flip" and value > 0:
            value *= _coin_flip_correction(answer, str(item.entry["answer"]))
    except (ArithmeticError, ValueError):
        # a number the verifier cannot hold ("1e400": Fraction's float() overflows in coin_flip's scorer) is a
        # wrong answer, as an unparsable one already is there; raising would end the run in the middle of a step
        return 0.0
    return value


# A number's exponent at the end of the answer ("1e999999999", "2E+1_000_000"). Fraction() expands it to an exact
# integer, 10 ** exponent, which for a billion does not come back: reasoning-gym's numeric verifiers (coin_flip) would
# hang the run on a sampled completion. No answer of a built-in dataset comes near 1e1000.
_EXPONENT = re.compile(r"[eE][+-]?(\d[\d_]*)\s*$")


def _huge_exponent(answer: str) -> bool:
    """Whether ``answer`` ends in an exponent of more than three digits (it scores 0, its verifier is not called)."""
    m = _EXPONENT.search(answer)
    return m is not None and len(m.group(1).replace("_", "").lstrip("0")) > 3


def _coin_flip_correction(answer: str, oracle: str, tol: float = 1e-4) -> float:
    """1 for a right answer (within coin_flip's tolerance); for a wrong one, min / max of the two numbers' texts as
    its scorer writes them (``f"{float(Fraction(x)):.10g}"``), which turns its prefix over the shorter text into a
    prefix over the longer. ``value > 0`` means both parsed (the scorer returns 0 for what does not)."""
    from fractions import Fraction

    a, o = (float(Fraction(x.replace(",", ""))) for x in (answer, oracle))
    if abs(a - o) <= tol:
        return 1.0
    a_text, o_text = f"{a:.10g}", f"{o:.10g}"
    return min(len(a_text), len(o_text)) / max(len(a_text), len(o_text))


_SCORERS: dict[str, object] = {}


def _scorer(dataset: str):
    """A dataset object of ``dataset`` to call its ``score_answer`` on (it reads only the entry and the answer)."""
    if dataset not in _SCORERS:
        for d in BUILTIN_DOMAINS.values():
            config = dict(d).get(dataset)
            if config is not None:
                break
        _SCORERS[dataset] = _dataset(dataset, config or {}, 1, 0)
    return _SCORERS[dataset]
