"""The arithmetic word-problem task: determinism, answers checked by an independent reader, the answer checker.

The answers are checked two ways, neither by the generator's own arithmetic: ``_read_answer`` computes the answer from
the prompt's words (a reader of the templates' meaning written for this test), and ``_check_worked_lines`` evaluates
each ``a op b = c.`` line of the reference solution with Python integers.
"""

import re

import pytest

from roundalign.tasks import LEVELS, Problem, extract_answer, format_prompt, make_problems, reward
from roundalign.tasks.arithmetic import vocabulary_words

SUBTRACT_VERBS = ("gives", "loses", "sells", "uses", "takes")


def _read_answer(prompt: str) -> int:
    """The answer, read from the prompt's sentences: a start (a count, or a count of containers times their
    content), then steps that add ("more") or take away, then an optional equal share."""
    sentences = [s for s in re.split(r"(?<=[.?])\s+", prompt) if s]
    numbers = [[int(n) for n in re.findall(r"\d+", s)] for s in sentences]
    if len(numbers[0]) == 2:  # "buys 3 bags with 4 pens in each bag."
        value, rest = numbers[0][0] * numbers[0][1], 1
    elif sentences[1].startswith("Each"):  # "has 3 boxes of pens. Each box holds 4 pens."
        value, rest = numbers[0][0] * numbers[1][0], 2
    else:
        value, rest = numbers[0][0], 1
    for sentence, found in zip(sentences[rest:], numbers[rest:], strict=True):
        if "equally among" in sentence:
            assert value % found[0] == 0, f"share does not divide: {prompt}"
            value //= found[0]
        elif " more" in sentence:
            value += found[0]
        elif any(f" {verb} " in sentence for verb in SUBTRACT_VERBS):
            value -= found[0]
        else:
            assert not found and sentence.startswith("How many"), f"unread sentence {sentence!r} in {prompt}"
    return value


def _check_worked_lines(problem: Problem) -> list[tuple[int, str, int, int]]:
    """Evaluates every worked line; each one after the first starts from the previous result."""
    lines = re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)\.", problem.solution)
    assert lines, problem.solution
    previous, parsed = None, []
    for a, op, b, c in lines:
        a, b, c = int(a), int(b), int(c)
        parsed.append((a, op, b, c))
        exact = {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op]
        assert exact == c, f"{a} {op} {b} != {c} in {problem.solution!r}"
        assert previous is None or a == previous, problem.solution
        previous = c
    assert problem.solution.endswith(f" The answer is {previous}."), problem.solution
    return parsed


@pytest.mark.parametrize("level", LEVELS)
def test_answers_read_from_the_prompt_and_worked_lines_agree(level):
    for problem in make_problems(400, level, seed=7):
        assert problem.level == level
        assert _read_answer(problem.prompt) == problem.answer, problem
        lines = _check_worked_lines(problem)
        assert all(min(a, b, c) >= 0 for a, _, b, c in lines), problem  # no negatives anywhere
        assert extract_answer(problem.solution) == problem.answer
        assert reward(problem.solution, problem) == 1.0


def test_levels_get_harder():
    easy, medium, hard = (make_problems(500, level, seed=3) for level in LEVELS)
    steps = [[len(_check_worked_lines(p)) for p in problems] for problems in (easy, medium, hard)]
    assert set(steps[0]) == {1} and set(steps[1]) == {1, 2} and set(steps[2]) == {2, 3, 4}
    for p in easy:  # one addition or subtraction on numbers up to 20
        a, op, b, _ = _check_worked_lines(p)[0]
        assert op in "+-" and max(a, b) <= 20
    assert max(p.answer for p in medium) > 40 and any(" * " in p.solution for p in medium)
    assert any(" / " in p.solution for p in hard) and any(" * " in p.solution for p in hard)


def test_deterministic_and_seeded():
    assert make_problems(50, 2, seed=11) == make_problems(50, 2, seed=11)
    assert make_problems(50, 2, seed=11) != make_problems(50, 2, seed=12)
    assert make_problems(20, 2, seed=11) == make_problems(50, 2, seed=11)[:20]  # a prefix of a longer draw
    assert make_problems(0, 1, seed=0) == []
    prompts = [p.prompt for level in LEVELS for p in make_problems(300, level, seed=5)]
    assert len(set(prompts)) > 0.95 * len(prompts)  # varied templates, names, objects


def test_prompt_format_and_vocabulary():
    problem = make_problems(1, 1, seed=0)[0]
    assert format_prompt(problem) == problem.prompt + " Answer:"
    assert problem.solution.startswith(" ")  # the model continues after "Answer:" with a space
    words = set(vocabulary_words())
    for level in LEVELS:
        for p in make_problems(300, level, seed=9):
            used = set(re.findall(r"[A-Za-z]+", format_prompt(p) + p.solution))
            assert used <= words, used - words
            assert not re.search(r"\b1 [a-z]+s\b", p.prompt), p.prompt  # never "1 pens"


@pytest.mark.parametrize(
    "completion, expected",
    [
        (" 7 + 5 = 12. The answer is 12.<|endoftext|>", 12),
        (" 7 + 5 = 12. The answer is 12.", 12),
        (" 8 * 4 = 32. 32 - 3 = 29. The answer is 29.", 29),
        (" 12", 12),
        (" 12.", 12),
        ("12<|endoftext|>", 12),
        (" 007", 7),
        (" The answer is -3.", -3),
        (" The answer is 4. The answer is 5.", 4),  # the first answer counts
        (" 3<|endoftext|> The answer is 4.", 3),  # nothing after end-of-text counts
        (" 7 + 5 = 12.", None),  # worked steps without an answer
        (" The answer is", None),
        ("", None),
        (" twelve", None),
        (" 12 apples", None),
        ("<|endoftext|>The answer is 4.", None),
    ],
)
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


def test_reward():
    problem = Problem(prompt="Mia has 7 pens. She buys 5 more. How many pens does Mia have?", answer=12, level=1,
                      solution=" 7 + 5 = 12. The answer is 12.")  # fmt: skip
    assert reward(" 7 + 5 = 12. The answer is 12.<|endoftext|>", problem) == 1.0
    assert reward(" 7 + 5 = 13. The answer is 13.", problem) == 0.0
    assert reward(" 7 + 5 = 12.", problem) == 0.0
    assert reward("", problem) == 0.0


def test_bad_input_is_an_error():
    with pytest.raises(ValueError, match="level must be one of"):
        make_problems(3, 4, seed=0)
    with pytest.raises(ValueError, match="non-negative"):
        make_problems(-1, 1, seed=0)
    with pytest.raises(TypeError, match="seed must be an int"):
        make_problems(3, 1, seed="0")
    with pytest.raises(TypeError, match="str"):
        extract_answer(b" 12")
