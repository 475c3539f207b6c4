"""Arithmetic word problems with verifiable integer answers, in three levels of difficulty.

The shipped tiny model (``roundalign.models.path("tiny-qwen3")``) is trained on these problems, the probe prompts it
with them, and an RL loop can reward its answers with ``reward``. One problem reads::

    prompt (format_prompt):  Mia has 7 pens. She buys 5 more. How many pens does Mia have? Answer:
    reference completion:     7 + 5 = 12. The answer is 12.<|endoftext|>

The completion works one step at a time (``a op b = c.``), so a multi-step problem is solved by chaining steps
the model has seen alone, and ends with ``The answer is N.`` and the end-of-text token, so generation stops.

Levels (every intermediate value and every answer is a non-negative integer):

- 1, easy: one addition or subtraction on numbers up to 20.
- 2, medium: one addition or subtraction on two-digit numbers, one product of two numbers up to 9, or two steps on
  numbers up to 20.
- 3, hard: two to four steps: a one-digit times a two-digit number, or a two-digit start, then two additions or
  subtractions of two-digit numbers, and sometimes a final equal share (an exact division). Values reach the
  hundreds.

``make_problems(n, level, seed)`` is deterministic: it draws from a ``random.Random`` seeded with a string made of
the seed and the level (a string seed is hashed with sha512, so PYTHONHASHSEED does not matter), whose sequence
Python keeps stable across versions and platforms. ``vocabulary_words()`` lists every word a
template can produce, so a tokenizer built over it never meets an unknown word in a generated problem.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

LEVELS = (1, 2, 3)
ANSWER_CUE = " Answer:"  # the prompt ends here; the model continues with the worked steps
EOS_TEXT = "<|endoftext|>"  # the tokenizer's end-of-text token, as text

SHE, HE = ("She", "her"), ("He", "him")  # (subject at a sentence start, object)
NAMES = {
    "Mia": SHE, "Leo": HE, "Ava": SHE, "Sam": HE, "Zoe": SHE, "Max": HE, "Lily": SHE, "Ben": HE, "Emma": SHE,
    "Omar": HE, "Nora": SHE, "Ravi": HE, "Ella": SHE, "Tom": HE, "Sara": SHE, "Ivan": HE, "Anna": SHE, "Jack": HE,
    "Rosa": SHE, "Kenji": HE,
}  # fmt: skip
FRIENDS = ("a friend", "a neighbor", "the teacher", "grandma", "a classmate", "dad")
OBJECTS = (
    "pens", "apples", "books", "stickers", "marbles", "cookies", "cards", "shells", "stamps", "coins",
    "pencils", "candies", "balloons", "flowers", "eggs", "toys", "beads", "rocks", "buttons", "oranges",
)  # fmt: skip
CONTAINERS = ("boxes", "bags", "jars", "packs", "baskets")
CONTAINER_ONE = {"boxes": "box", "bags": "bag", "jars": "jar", "packs": "pack", "baskets": "basket"}

# Templates. {n} name, {p} pronoun (sentence start), {q} object pronoun, {o} objects, {f} friend (capitalised {F}),
# {c} container ({c1} one of them), {a} {b} {k} {d} numbers.
STARTS = ("{n} has {a} {o}.", "{n} owns {a} {o}.", "{n} starts with {a} {o}.", "There are {a} {o} in {n}'s bag.")
PRODUCT_STARTS = (
    "{n} has {a} {c} of {o}. Each {c1} holds {b} {o}.",
    "{n} buys {a} {c} with {b} {o} in each {c1}.",
    "{n} fills {a} {c} with {b} {o} each.",
)
ADDS = (
    "{p} buys {k} more.", "{p} finds {k} more {o}.", "{p} gets {k} more {o} from {f}.",
    "Then {p_low} picks up {k} more {o}.", "{F} gives {q} {k} more {o}.",
)  # fmt: skip
SUBS = (
    "{p} gives {k} {o} to {f}.", "{p} loses {k} {o}.", "{p} sells {k} of them.",
    "Then {p_low} uses {k} {o}.", "{F} takes {k} {o} from {q}.",
)  # fmt: skip
QUESTIONS = ("How many {o} does {n} have?", "How many {o} does {n} have now?", "How many {o} does {n} have in the end?")
SHARE = "{p} shares the {o} equally among {d} friends. How many {o} does each friend get?"


@dataclass(frozen=True)
class Problem:
    """One word problem: ``prompt`` is the question, ``solution`` the reference completion (without end-of-text)."""

    prompt: str
    answer: int
    level: int
    solution: str


def format_prompt(problem: Problem) -> str:
    """The exact text the model is prompted with; it ends where the model should continue."""
    return problem.prompt + ANSWER_CUE


_ANSWER = re.compile(r"The answer is (-?\d+)")
_BARE_INTEGER = re.compile(r"\s*(-?\d+)\s*\.?\s*")


def extract_answer(completion_text: str) -> int | None:
    """The model's answer in a completion, or None if it gives none.

    The answer is the integer after the first ``The answer is`` (a model stops after it; later text would follow an
    end-of-text token and is cut off here). A completion that is a bare integer (`` 12``) counts too. Anything else,
    such as worked steps that never state an answer, is None: an RL reward must not credit a number that merely
    appears on the way.
    """
    if not isinstance(completion_text, str):
        raise TypeError(f"completion_text must be a str, got {type(completion_text).__name__}")
    text = completion_text.split(EOS_TEXT, 1)[0]
    match = _ANSWER.search(text)
    if match:
        return int(match.group(1))
    bare = _BARE_INTEGER.fullmatch(text)
    return int(bare.group(1)) if bare else None


def reward(completion_text: str, problem: Problem) -> float:
    """1.0 if the completion's answer is the problem's answer, else 0.0."""
    return 1.0 if extract_answer(completion_text) == problem.answer else 0.0


def make_problems(n: int, level: int, seed: int) -> list[Problem]:
    """``n`` problems of one level, the same ones for the same ``(n, level, seed)``."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    rng = random.Random(f"roundalign-arithmetic/{seed}/{level}")
    return [_make_problem(rng, level) for _ in range(n)]


def vocabulary_words() -> list[str]:
    """Every word a template can produce (not numbers or punctuation), sorted."""
    texts = [*STARTS, *PRODUCT_STARTS, *ADDS, *SUBS, *QUESTIONS, SHARE, ANSWER_CUE, "The answer is"]
    texts += list(NAMES) + [w for pair in (SHE, HE) for w in (*pair, pair[0].lower())] + list(FRIENDS) + list(OBJECTS)
    texts += list(CONTAINERS) + list(CONTAINER_ONE.values())
    words = set()
    for text in texts:
        words.update(re.findall(r"[A-Za-z]+", re.sub(r"\{[a-z_0-9A-Z]+\}", " ", text)))
    words.update(friend.split()[0].capitalize() for friend in FRIENDS)  # {F}: a friend at a sentence start
    return sorted(words)


# -----------------------------------------------------------------------------
# Generation. A problem is a start value followed by steps; each step appends a sentence and a worked line.


def _make_problem(rng: random.Random, level: int) -> Problem:
    name = rng.choice(list(NAMES))
    pronoun, object_pronoun = NAMES[name]
    obj = rng.choice(OBJECTS)
    fill = {"n": name, "p": pronoun, "p_low": pronoun.lower(), "q": object_pronoun, "o": obj}
    sentences, lines = [], []

    kind = rng.random()
    if level == 1 or (level == 2 and kind < 0.4):
        value = _start(rng, fill, sentences, lines, top=20)
        steps = [20] if level == 1 else [20, 20]
    elif level == 2 and kind < 0.7:
        value = _start(rng, fill, sentences, lines, top=99, bottom=10)
        steps = [99]
    elif level == 2:
        value = _product_start(rng, fill, sentences, lines, top=9)
        steps = []
    else:
        if kind < 0.5:  # a one-digit times a two-digit number: hundreds of facts, so it must be worked out
            value = _product_start(rng, fill, sentences, lines, top=9, second=(10, 99))
        else:
            value = _start(rng, fill, sentences, lines, top=99, bottom=10)
        steps = [99, 99]

    for top in steps:
        value = _add_or_sub(rng, fill, sentences, lines, value, top)

    share = [d for d in range(2, 10) if value % d == 0 and value // d >= 2] if level == 3 else []
    if share and rng.random() < 0.4:
        d = rng.choice(share)
        sentences.append(SHARE.format(d=d, **fill))
        lines.append(f"{value} / {d} = {value // d}.")
        value //= d
    else:
        sentences.append(rng.choice(QUESTIONS).format(**fill))
    solution = " " + " ".join(lines) + f" The answer is {value}."
    return Problem(prompt=" ".join(sentences), answer=value, level=level, solution=solution)


def _start(rng, fill, sentences, lines, top: int, bottom: int = 2) -> int:
    a = rng.randint(bottom, top)
    sentences.append(rng.choice(STARTS).format(a=a, **fill))
    return a


def _product_start(rng, fill, sentences, lines, top: int, second: tuple[int, int] | None = None) -> int:
    a, b = rng.randint(2, top), rng.randint(*(second or (2, top)))
    c = rng.choice(CONTAINERS)
    sentences.append(rng.choice(PRODUCT_STARTS).format(a=a, b=b, c=c, c1=CONTAINER_ONE[c], **fill))
    lines.append(f"{a} * {b} = {a * b}.")
    return a * b


def _add_or_sub(rng, fill, sentences, lines, value: int, top: int) -> int:
    """One step: add up to ``top``, or subtract at most what there is (never below zero)."""
    friend = rng.choice(FRIENDS)
    fill = dict(fill, f=friend, F=friend[0].upper() + friend[1:])
    if value >= 2 and rng.random() < 0.5:
        k = rng.randint(2, min(top, value))  # from 2, so that "gives 1 pens" never happens
        sentences.append(rng.choice(SUBS).format(k=k, **fill))
        lines.append(f"{value} - {k} = {value - k}.")
        return value - k
    k = rng.randint(2, top)
    sentences.append(rng.choice(ADDS).format(k=k, **fill))
    lines.append(f"{value} + {k} = {value + k}.")
    return value + k
