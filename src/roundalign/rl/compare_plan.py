"""Planning a ``roundalign compare`` grid: its keys and values, its cells, each validated as the run it will be.

Part of ``roundalign compare`` (rl/compare.py is the command, rl/compare_run.py runs the cells). A grid key is an
alias (``GRID_ALIASES``), ``method`` (a set of multi-domain train options per value, rl/compare_methods.py) or a
``TrainConfig`` field that is a ``roundalign train`` option (rl/cli.py's ``OPTIONS``); a cell gives one value to
each key (``method=alone``: one cell per domain). The grid is the cartesian product of the value lists, in the order
the keys were given, with ``seed`` varied last so that the seeds of one configuration sit next to each other. Every
cell goes through ``roundalign train``'s own parser and ``TrainConfig.validate`` before anything runs, so a bad
combination fails the whole grid at once, naming the cell.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import re
from dataclasses import dataclass, field

from roundalign.errors import UserError, flag
from roundalign.rl import compare_methods
from roundalign.rl.compare_methods import METHOD_KEY
from roundalign.rl.compare_summary import GRID_ALIASES, config_label, short_name

__all__ = ["Cell", "grid_options", "parse_grid", "plan", "train_config", "train_parser"]

# Train options that are not a run's settings (compare sets --out and --quiet itself), and one that cannot be a
# grid key because its value holds the comma that separates grid values.
_NOT_GRID = {
    "out": "compare gives each cell its own --out",
    "resume": "compare starts fresh runs",
    "quiet": "compare runs every cell quietly",
    "no_tensorboard": "pass it in the fixed train options",
    "betas": "its value 'b1,b2' holds a comma, which separates grid values; set it in the fixed options",
}


class _TrainParser(argparse.ArgumentParser):
    """``roundalign train``'s parser, raising UserError instead of exiting, so plan() can name the bad cell."""

    def error(self, message):
        raise UserError(message)


def train_parser() -> argparse.ArgumentParser:
    """``roundalign train``'s options in a parser that raises ``UserError`` instead of exiting."""
    from roundalign.rl.cli import add_arguments

    parser = _TrainParser(prog="roundalign train", add_help=False)
    add_arguments(parser)
    return parser


def grid_options() -> dict:
    """TrainConfig field -> its train option (rl/cli.py's ``Option``), for every field a grid may vary."""
    from roundalign.rl.cli import OPTIONS
    from roundalign.rl.config import TrainConfig

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    return {name: o for name, o in OPTIONS.items() if name in fields and name not in _NOT_GRID}


def parse_grid(items: list[str]) -> dict[str, list[str]]:
    """``["trainer=hf,aligned", "seed=0,1"]`` -> ``{"trainer_profile": ["hf", "aligned"], "seed": ["0", "1"]}``.

    A key is an alias (``GRID_ALIASES``) or a ``TrainConfig`` field, with ``-`` or ``_``. Unknown keys, a key
    given twice, empty or repeated values are errors that list the valid keys.
    """
    options = grid_options()
    valid = ", ".join([*GRID_ALIASES, METHOD_KEY, *sorted(options)])
    if not items:
        raise UserError(f"the grid is empty; give KEY=V1,V2 items, with KEY one of: {valid}")
    grid: dict[str, list[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        name = GRID_ALIASES.get(key.strip(), key.strip().replace("-", "_"))
        if not sep or not key.strip():
            raise UserError(f"grid item {item!r} is not KEY=V1,V2; KEY is one of: {valid}")
        if name in _NOT_GRID:
            raise UserError(f"{key!r} cannot be a grid key: {_NOT_GRID[name]}")
        if name not in options and name != METHOD_KEY:
            raise UserError(f"unknown grid key {key!r}; valid keys: {valid}")
        if name in grid:
            raise UserError(f"grid key {key!r} ({name}) is given twice; list all its values in one item: {key}=A,B")
        vals = [v.strip() for v in values.split(",")]
        if not values.strip() or any(not v for v in vals):
            raise UserError(f"grid item {item!r} has an empty value; write {key}=A,B with no empty entries")
        repeated = sorted({v for v in vals if vals.count(v) > 1})
        if repeated:
            raise UserError(f"grid item {item!r} repeats {repeated}; each value once")
        if name == METHOD_KEY:
            compare_methods.check_values(vals)
        grid[name] = vals
    return grid


@dataclass
class Cell:
    """One run of the grid: its non-seed settings (TrainConfig field or ``method`` -> value text) and its seed.

    A ``method`` setting stands for ``method_options`` (rl/compare_methods.py), which leave out the fixed options
    named in ``drop``; ``domain`` is the one domain of a ``method=alone`` cell (not a setting: the cells of all the
    domains are one configuration)."""

    name: str  # filesystem-safe: "trainer-hf_sync-rne_seed-0"
    settings: dict[str, str]
    seed: str | None
    items: list[tuple[str, str]] = field(default_factory=list, repr=False)  # (field, value) in grid order, seed last
    method_options: tuple[str, ...] = ()
    drop: tuple[str, ...] = ()
    domain: str | None = None

    def __post_init__(self):
        if not self.items:
            self.items = [*self.settings.items(), *([("seed", self.seed)] if self.seed is not None else [])]

    @property
    def label(self) -> str:
        """The configuration: non-seed settings, ``"trainer=hf sync=rne"``."""
        return config_label(self.settings)

    def train_options(self) -> list[str]:
        """This cell's own ``roundalign train`` options (the fixed ones come first)."""
        options = grid_options()
        argv = []
        for name, value in self.items:
            if name == METHOD_KEY:
                argv += self.method_options
                continue
            option = options[name]
            if not option.takes_value:  # --loss-on-served / --no-loss-on-served, or a flag that is off by default
                off = next((s for s in option.flags if s.startswith("--no-")), None)
                if _boolean(value, name):
                    argv.append(option.flag)
                elif off is not None:
                    argv.append(off)  # a flag with no --no- form is off when not given
            else:
                argv.append(f"{option.flag}={value}")  # one token: a value like -1e-5 is not taken for an option
        return argv

    def argv(self, fixed_args: list[str]) -> list[str]:
        """The whole ``roundalign train`` argv of this cell (but --out): the fixed options less ``drop``, then its
        own."""
        return [*without(list(fixed_args), self.drop), *self.train_options()]


def without(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """``argv`` less the train options that set the TrainConfig fields ``names`` (with their values), however they
    are spelt (``--osol-tau 0.1``, ``--osol-tau=0.1``, an abbreviation argparse accepts)."""
    if not names:
        return argv
    from roundalign.rl.cli import OPTIONS

    spellings = {f: o for o in OPTIONS.values() for f in o.flags}
    out, i = [], 0
    while i < len(argv):
        token = argv[i]
        option = None
        if token.startswith("--"):
            spelt = token.split("=", 1)[0]
            found = {o.dest: o for f, o in spellings.items() if f == spelt} or {
                o.dest: o for f, o in spellings.items() if f.startswith(spelt)
            }
            option = next(iter(found.values())) if len(found) == 1 else None
        if option is not None and option.dest in names:
            i += 1 if "=" in token or not option.takes_value else 2
            continue
        out.append(token)
        i += 1
    left = sorted(set(names) & set(_given(out)))
    if left:  # a spelling the walk above did not recognise: refuse rather than run with it
        raise UserError(f"could not take {', '.join(map(flag, left))} out of the fixed options {argv}; spell it out")
    return out


def _boolean(value: str, name: str) -> bool:
    v = value.lower()
    if v in ("true", "yes", "on", "1"):
        return True
    if v in ("false", "no", "off", "0"):
        return False
    raise UserError(f"{name} is on or off: write {name}=true,false (got {value!r})")


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+]+", "-", text).strip("-") or "x"


def _cell(items: list[tuple[str, str]], method: compare_methods.Expansion | None = None) -> Cell:
    """The cell of ``items``; a ``method`` setting adds its options, and ``alone``'s domain to the name
    (``method-alone+counting_trainer-hf_seed-0``)."""
    domain = method.domain if method else None
    shown = [(k, f"{v}+{domain}" if k == METHOD_KEY and domain else v) for k, v in items]
    name = "_".join(f"{_safe(short_name(k))}-{_safe(v)}" for k, v in shown)
    settings = {k: v for k, v in items if k != "seed"}
    seed = next((v for k, v in items if k == "seed"), None)
    if method is None:
        return Cell(name=name, settings=settings, seed=seed, items=list(items))
    return Cell(name, settings, seed, list(items), method.options, method.drop, domain)


def _given(argv: list[str]) -> dict:
    """The train options ``argv`` sets (the train parser suppresses defaults, so only given ones appear)."""
    return vars(train_parser().parse_args(argv))


def plan(grid: dict[str, list[str]], fixed_args: list[str]) -> list[Cell]:
    """The grid's cells, in a stable order, each validated as the ``roundalign train`` run it will be.

    Raises ``ValueError`` naming the first bad cell (or a clash between the grid and the fixed options) before
    anything runs.
    """
    try:
        fixed = _given(list(fixed_args))
    except ValueError as exc:
        raise UserError(f"fixed train options {' '.join(fixed_args)!r}: {exc}") from None
    for name in ("out", "resume", "quiet"):
        if name in fixed:
            raise UserError(f"drop --{name.replace('_', '-')} from the fixed train options: {_NOT_GRID[name]}")
    domains = compare_methods.check(grid, fixed) if METHOD_KEY in grid else ()
    clash = sorted(set(grid) & set(fixed))
    if clash:
        raise UserError(
            f"{', '.join('--' + c.replace('_', '-') for c in clash)} is both a grid key and a fixed "
            "train option; keep it in one place"
        )
    keys = [k for k in grid if k != "seed"] + (["seed"] if "seed" in grid else [])
    cells = []
    for values in itertools.product(*(grid[k] for k in keys)):
        items = list(zip(keys, values, strict=True))
        method = dict(items).get(METHOD_KEY)
        if method is None:
            cells.append(_cell(items))
            continue
        for run in compare_methods.expand(method, domains, fixed, dict(items)):
            cells.append(_cell(items, run))
    seen: dict[str, Cell] = {}
    for cell in cells:
        if cell.name in seen:
            raise UserError(
                f"grid cells {seen[cell.name].items} and {cell.items} get the same directory name "
                f"{cell.name!r}; use values that differ in letters or digits"
            )
        seen[cell.name] = cell
        train_config(cell, fixed_args)
    return cells


def train_config(cell: Cell, fixed_args: list[str]):
    """The validated ``TrainConfig`` of ``cell``; ``ValueError`` naming the cell when it is not a valid run."""
    from roundalign.rl.cli import config_from_args

    try:
        config = config_from_args(train_parser().parse_args(cell.argv(fixed_args))).validate().config
    except (ValueError, TypeError) as exc:
        label = config_label(dict(cell.items))
        raise UserError(f"grid cell {cell.name} ({label}) is not a valid run: {exc}") from None
    return config
