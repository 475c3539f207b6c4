"""The ``method`` grid key of ``roundalign compare``: multi-domain baselines and OSOL's ablations, by name.

Part of ``roundalign compare`` (rl/compare_plan.py plans the grid and calls ``check`` and ``expand`` from here).
Each value stands for a set of ``roundalign train`` options, so that one grid compares the multi-domain methods::

    grpo                  mixed-domain GRPO:         --adv-estimator grpo
    alone                 each domain trained alone: --domains <one domain> --adv-estimator grpo, one cell per domain
    osol                  OSOL:                      --adv-estimator osol
    osol-no-residual      focus weighting only:      --adv-estimator osol --osol-residual none
    osol-random-residual  the penalties shuffled:    --adv-estimator osol --osol-residual random
    osol-equal-weights    no domain weighting:       --adv-estimator osol --osol-other-weight <the focus weight>

``method`` needs ``--domains`` with at least two domains in the fixed train options: the mixed methods train on all
of them, and ``alone`` expands into one cell per domain (``--domains <that domain's spec>``), with the same other
options, ``--prompts-per-step`` included: a domain alone gets the whole batch of every step, so each of its runs
sees as many samples per step as a mixed run (and as many of its own domain as all the domains of a mixed run
together). Its cells are one configuration in the summary (rl/compare_multidomain.py): each domain's held-out reward
comes from the run trained on it alone. The eval set of a domain is drawn from the domain and the seed only, so an
``alone`` run and a mixed run of one seed are scored on the same held-out items of that domain.

The method values set ``--adv-estimator``, ``--osol-residual``, ``--osol-other-weight`` and ``--domains``, so these
are refused as grid keys or fixed options next to ``method``. OSOL's other options (``--osol-tau``, ...) given in
the fixed options apply to the OSOL methods: the ``grpo`` and ``alone`` cells run without them (GRPO refuses them).
"""

from __future__ import annotations

from dataclasses import dataclass

from roundalign.errors import UserError, flag

METHOD_KEY = "method"
METHODS = {
    "grpo": "mixed-domain GRPO (--adv-estimator grpo)",
    "alone": "each domain trained alone (one cell per domain: --domains <domain> --adv-estimator grpo)",
    "osol": "OSOL (--adv-estimator osol)",
    "osol-no-residual": "OSOL's focus weighting only (--adv-estimator osol --osol-residual none)",
    "osol-random-residual": "OSOL with the penalties in a random order (--osol-residual random)",
    "osol-equal-weights": "OSOL without domain weights (--osol-other-weight = the focus weight)",
}
ALONE = "alone"
# Train settings the method values set: refused as grid keys or fixed options next to `method`.
SET_BY_METHOD = ("adv_estimator", "osol_residual", "osol_other_weight", "domains")


@dataclass(frozen=True)
class Expansion:
    """One run of a method: its own train options, the fixed options it leaves out, and (``alone``) its domain."""

    options: tuple[str, ...]
    drop: tuple[str, ...] = ()  # TrainConfig fields of the fixed options this run leaves out
    domain: str | None = None  # alone: the name of the one domain it trains


def check_values(values: list[str]) -> None:
    unknown = [v for v in values if v not in METHODS]
    if unknown:
        raise UserError(f"unknown method(s) {unknown} in the grid; method is one of: {', '.join(METHODS)}")


def check(grid: dict[str, list[str]], fixed: dict) -> tuple:
    """The fixed ``--domains`` (parsed) when ``method`` may be a grid key with these settings; ``UserError`` naming
    the clash otherwise. ``fixed``: the fixed train options as the train parser read them."""
    from roundalign.tasks.gym import parse_domains

    check_values(grid[METHOD_KEY])
    for name in SET_BY_METHOD:
        if name in grid:
            where, fix = "a grid key", f"drop the grid key {flag(name)[2:]}"
        elif name in fixed and name != "domains":  # the fixed --domains is what the methods share
            where, fix = "a fixed train option", f"drop {flag(name)} from the fixed options"
        else:
            continue
        raise UserError(
            f"{flag(name)} is {where} next to the grid key method, whose values set it ("
            f"{'; '.join(f'{k}: {v}' for k, v in METHODS.items())}); {fix}, or grid it without method"
        )
    if "domains" not in fixed:
        raise UserError(
            "grid key method compares multi-domain methods: give --domains with at least two domains in the fixed "
            "train options, e.g. -- --domains arithmetic,algorithmic,counting,probability --model tiny-llama-chars"
        )
    domains = parse_domains(fixed["domains"])
    if len(domains) < 2:
        raise UserError(
            f"grid key method compares multi-domain methods, but --domains {fixed['domains']!r} has one domain; "
            "give at least two (a run on one domain is method=alone's cell of it)"
        )
    if any(v in ("grpo", ALONE) for v in grid[METHOD_KEY]):
        varied = [k for k in grid if k.startswith("osol_")]
        if varied:
            raise UserError(
                f"grid key(s) {', '.join(flag(k)[2:] for k in varied)} vary OSOL's settings, which the grpo and alone "
                "methods do not have; grid them with OSOL methods only, or set them in the fixed options (they then "
                "apply to the OSOL methods)"
            )
    return domains


def expand(method: str, domains: tuple, fixed: dict, cell: dict[str, str]) -> list[Expansion]:
    """The run(s) ``method`` stands for: one, or one per domain for ``alone``. ``fixed``: the fixed train options
    (parsed); ``cell``: the cell's other grid settings (field -> value text)."""
    osol_fixed = tuple(k for k in fixed if k.startswith("osol_"))
    if method == "grpo":
        return [Expansion(("--adv-estimator=grpo",), drop=osol_fixed)]
    if method == ALONE:
        return [
            Expansion((f"--domains={d.spec()}", "--adv-estimator=grpo"), drop=("domains", *osol_fixed), domain=d.name)
            for d in domains
        ]
    if method == "osol":
        return [Expansion(("--adv-estimator=osol",))]
    if method == "osol-no-residual":
        return [Expansion(("--adv-estimator=osol", "--osol-residual=none"))]
    if method == "osol-random-residual":
        return [Expansion(("--adv-estimator=osol", "--osol-residual=random"))]
    if method == "osol-equal-weights":
        return [Expansion(("--adv-estimator=osol", f"--osol-other-weight={focus_weight(fixed, cell)!r}"))]
    check_values([method])
    raise AssertionError(method)


def focus_weight(fixed: dict, cell: dict[str, str]) -> float:
    """The run's ``--osol-focus-weight``: the cell's (a grid key), the fixed options', or TrainConfig's default."""
    from roundalign.rl.config import TrainConfig

    if "osol_focus_weight" in cell:
        try:
            return float(cell["osol_focus_weight"])
        except ValueError:
            raise UserError(f"osol-focus-weight is a number, got {cell['osol_focus_weight']!r}") from None
    return float(fixed.get("osol_focus_weight", TrainConfig.osol_focus_weight))
