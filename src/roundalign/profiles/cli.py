"""``roundalign profiles``: the built-in rounding profiles, side by side, or one in detail.

    roundalign profiles                 # every built-in profile: engines covered, one formula per region
    roundalign profiles --sources       # ... plus where each profile was read
    roundalign profiles vllm            # one profile in detail: rule, formula, whether it differs from HF
    roundalign profiles fit-out/profile.json     # a profile file, in detail
    roundalign profiles --json          # all profiles as JSON (a list of Profile.to_dict())

Formulas use the notation of docs/engine-rounding.md: ``r(.)`` rounds fp32 to bf16, everything inside one
``r(...)`` is fp32, ``nu(x) = rsqrt(mean(x^2) + eps)``. The tables need ``rich`` (the ``[cli]`` extra); ``--json``
works without it. This module imports neither torch nor transformers, so it answers at once.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from roundalign.errors import ExitStatus, UserError
from roundalign.options import field_help, option
from roundalign.profiles.builtin import get_profile, list_profiles
from roundalign.profiles.profile import Profile
from roundalign.profiles.rules import REGIONS

CAPTION = "r(.) rounds fp32 to bf16; nu(x) = rsqrt(mean(x^2) + eps); dim = same as stock HF"


@dataclass(frozen=True)
class ProfilesConfig:
    """``roundalign profiles``'s options: one profile (a name or a .json file) or all; a source column; JSON."""

    name: str | None = option(None, "one profile to show in detail ({names}), or a profile .json file")
    sources: bool = option(False, "add the column saying where each profile was read")
    json: bool = option(False, "print JSON (Profile.to_dict) instead of a table")

    def validate(self) -> ProfilesConfig:
        if self.name is not None:
            get_profile(self.name)  # an unknown name or a bad file: UserError naming the choices
        if self.sources and self.name is not None:
            raise UserError("--sources adds a column to the overview; one profile's detail shows its source already")
        return self


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", help=field_help(ProfilesConfig, "name", names=", ".join(list_profiles())))
    parser.add_argument("--sources", action="store_true", help=field_help(ProfilesConfig, "sources"))
    parser.add_argument("--json", action="store_true", help=field_help(ProfilesConfig, "json"))


def config_from_args(args: argparse.Namespace) -> ProfilesConfig:
    return ProfilesConfig(name=args.name, sources=args.sources, json=args.json)


def _display(formula: str) -> str:
    # "R=r(a+h); norm(R)" and SGLang's "head_dim in {...}: ...; else ..." read better on two lines.
    return formula.replace("; ", ";\n")


def _cell(p: Profile, region: str, formula: str) -> str:
    # Rules that stock HF shares are dimmed, so what a profile changes stands out.
    text = _display(formula)
    return text if getattr(p, region) != getattr(get_profile("hf"), region) else f"[dim]{text}[/dim]"


def _wide_table(profiles: list[Profile], sources: bool):
    from rich.table import Table

    table = Table(title="roundalign built-in profiles", caption=CAPTION, show_lines=True)
    table.add_column("profile", style="bold cyan", no_wrap=True)
    table.add_column("engines", min_width=20, ratio=1)
    for region in REGIONS:
        table.add_column(region, no_wrap=True)  # a formula is never folded: it reads whole or goes per profile
    if sources:
        table.add_column("source", min_width=20, ratio=1, style="dim", overflow="fold")
    for p in profiles:
        formulas = p.describe()
        table.add_row(p.name, p.engines, *(_cell(p, r, formulas[r]) for r in REGIONS), *([p.source] if sources else []))
    return table


def _profile_table(p: Profile, sources: bool):
    """One profile as a region | formula table, narrow enough for a terminal (docs/profiles.md)."""
    from rich.table import Table

    caption = f"source: {p.source}" if sources else None
    table = Table(
        title=f"[bold cyan]{p.name}[/]: {p.engines}", caption=caption, title_justify="left", caption_justify="left"
    )
    table.add_column("region", no_wrap=True)
    table.add_column("formula", no_wrap=True)
    for region, formula in p.describe().items():
        table.add_row(region, _cell(p, region, formula))
    return table


def overview(profiles: list[Profile], sources: bool, console) -> list:
    """Every profile side by side when the console is wide enough to show every formula whole, else one small table
    per profile."""
    from rich.text import Text

    from roundalign.console import fits

    wide = _wide_table(profiles, sources)
    if fits(console, wide):
        return [wide]
    return [*(_profile_table(p, sources) for p in profiles), Text(CAPTION, style="dim")]


def _detail_rows(p: Profile) -> list[tuple[str, str, str, str]]:
    """(region, rule, formula, differs from HF) per region, then where RoPE's angles come from, the kernels and the
    served quantization."""
    hf = get_profile("hf")
    rows = [
        (region, str(getattr(p, region)), _display(text), "yes" if getattr(p, region) != getattr(hf, region) else "no")
        for region, text in p.describe().items()
    ]
    angles = "inv_freq from the config, fp32" if str(p.rope_angles) == "fp32" else "the rotary module's inv_freq"
    rows.append(("rope angles", str(p.rope_angles), angles, "yes" if p.rope_angles != hf.rope_angles else "no"))
    for kernel in ("attention", "gemm", "forward"):
        rule = getattr(p, kernel)
        rows.append(
            (kernel, str(rule), "whose kernel the trainer runs", "yes" if rule != getattr(hf, kernel) else "no")
        )
    q = p.quantization
    rows.append(("quantization", str(q), _display(q.description), "yes" if q.quantized else "no"))
    return rows


def detail(p: Profile, console) -> list:
    """One profile: a region x (rule, formula, differs from HF) table, or, narrower than it, one block per region."""
    from rich.table import Table

    from roundalign.console import fits, key_value_table

    table = Table(title=f"profile {p.name}", caption=f"engines: {p.engines}\nsource: {p.source}", show_lines=True)
    table.add_column("region", style="bold cyan", no_wrap=True)
    table.add_column("rule", no_wrap=True)
    table.add_column("formula", no_wrap=True)
    table.add_column("differs from HF", no_wrap=True)
    rows = _detail_rows(p)
    for row in rows:
        table.add_row(*row)
    if fits(console, table):
        return [table]
    head = key_value_table([("profile", p.name), ("engines", p.engines), ("source", p.source)])
    return [
        head,
        *(
            key_value_table(
                [("rule", rule), ("formula", formula), ("differs from HF", differs)], title=f"[bold cyan]{region}[/]"
            )
            for region, rule, formula, differs in rows
        ),
    ]


def run(config: ProfilesConfig) -> int:
    from roundalign.console import make_console

    profiles = [get_profile(config.name)] if config.name is not None else [get_profile(n) for n in list_profiles()]
    if config.json:
        # One profile is a single object (Profile.load reads it back); all of them, a list.
        data = profiles[0].to_dict() if config.name is not None else [p.to_dict() for p in profiles]
        print(json.dumps(data, indent=2))
        return ExitStatus.OK
    console = make_console()
    shown = detail(profiles[0], console) if config.name is not None else overview(profiles, config.sources, console)
    for renderable in shown:
        console.print(renderable)
    return ExitStatus.OK
