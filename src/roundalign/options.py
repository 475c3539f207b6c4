"""Options defined once: the sampling options several commands share, and the help that config fields carry.

``probe``, ``dump``, ``calibrate`` and ``train`` all sample, and each used to declare ``--num-samples``,
``--max-tokens``, ``--temperature``, ``--top-p`` and ``--seed`` with its own help and its own range checks. Here
each is one ``Option``: type, default, help and the range it must lie in, so a command adds the options it takes
(``add_sampling_arguments``) and checks them (``check_sampling``) with the same words everywhere. A command may
add a rule of its own on top (``train`` refuses temperature 0: greedy groups learn nothing).

Config dataclasses carry each field's help in its metadata (``option(default, help)``), as TRL's configs do, so a
library user reading the config sees what the command line says; the command line reads it from there
(``field_help``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from roundalign.errors import UserError, flag


@dataclass(frozen=True)
class Option:
    """One command-line option: its type, default, help (``{default}`` is filled in) and range check."""

    type: type
    default: Any
    help: str
    problem: Callable[[Any], str | None] = lambda _v: None  # what is wrong with a value, in words, or None


def _positive(v) -> str | None:
    return None if v > 0 else "must be positive"


SAMPLING: dict[str, Option] = {
    "num_samples": Option(
        int, 16, "completions to sample; prompts are used round-robin (default {default})", _positive
    ),
    "max_tokens": Option(int, 48, "max completion tokens (default {default})", _positive),
    "temperature": Option(
        float,
        1.0,
        "sampling temperature (default {default}; 0 = greedy)",
        lambda v: None if math.isfinite(v) and v >= 0 else "must be >= 0 (0 = greedy)",
    ),
    "top_p": Option(
        float,
        1.0,
        "nucleus sampling, in (0, 1] (default {default})",
        lambda v: None if 0 < v <= 1 else "must be in (0, 1]",
    ),
    "seed": Option(int, 0, "sampling seed (default {default})"),
}


def check_sampling(values: Mapping[str, Any]) -> None:
    """``UserError`` for the first sampling option in ``values`` outside its range (``None`` values are skipped)."""
    for name, value in values.items():
        opt = SAMPLING.get(name)
        if opt is None or value is None:
            continue
        problem = opt.problem(value)
        if problem:
            raise UserError(f"{flag(name)} {problem}, got {value}")


def add_sampling_arguments(add, config, defaults: Mapping[str, Any], *, unset: bool = False) -> None:
    """``add(--flag, type=..., default=..., help=...)`` for each sampling option in ``defaults`` (name -> the default
    this command applies): the type from ``SAMPLING``, the help from ``config``'s field with that default shown.
    ``unset``: no argparse default, so that the config can tell an option left out from one given (it fills the
    default in itself, or refuses the option in a mode that ignores it)."""
    for name, default in defaults.items():
        help = field_help(config, name, default=default)
        add(flag(name), type=SAMPLING[name].type, default=None if unset else default, help=help)


def option(default, help: str, **kwargs) -> dataclasses.Field:
    """A config field with its help: ``top_p: float = option(1.0, "nucleus sampling, in (0, 1]")``."""
    if isinstance(default, list | dict | set):
        raise TypeError("a mutable default needs default_factory")
    return dataclasses.field(default=default, metadata={"help": help}, **kwargs)


def field_help(cls, name: str, **fmt) -> str:
    """A config field's help, with ``{default}`` (and any ``fmt`` names) filled in."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    fmt.setdefault("default", f.default)
    return f.metadata["help"].format(**fmt)


__all__ = ["SAMPLING", "Option", "add_sampling_arguments", "check_sampling", "field_help", "option"]
