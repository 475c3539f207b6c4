"""Turn one mode's fingerprint into a ``Profile`` (``roundalign fingerprint read --profile-out MODE PATH``).

Every region comes from the battery when the reader determined it. The one the op level cannot settle by design is
the residual: ``round_at_attention`` and ``never_round`` give the same op outputs. The user then names it with
``--residual`` (from ``roundalign fit``, or from knowing how the engine splits its graphs), and the profile's
``source`` says which regions came from where. Anything else undetermined is refused, never guessed.

With a battery made for a model (``--model``), the regions its cases cover are taken from them, at the model's own
shapes, and RoPE is one plain rule at the model's head dim; the generic cases fill in the rest (e.g. the experts'
SwiGLU of a dense model). Without one, RoPE is one rule or a head_dim-dependent one from the generic head dims.
"""

from __future__ import annotations

from roundalign.errors import UserError
from roundalign.profiles import HeadDimRope, Profile, ResidualRule, RopeRule


def _rope(region) -> RopeRule | HeadDimRope:
    """One RoPE rule, or a head_dim-dependent one when the battery's head dims split into two rules, one group
    of which holds every head dim that is not a power of two (the dims engines do not special-case)."""
    by_rule: dict[str, list[int]] = {}
    for hd, r in region.per_head_dim.items():
        by_rule.setdefault(r.rules[0], []).append(int(hd))
    if len(by_rule) == 1:
        return RopeRule.parse(next(iter(by_rule)))
    generic = [rule for rule, dims in by_rule.items() if any(d & (d - 1) for d in dims)]
    if (
        len(by_rule) == 2
        and len(generic) == 1
        and all(not (d & (d - 1)) for r, ds in by_rule.items() if r != generic[0] for d in ds)
    ):
        special = next(r for r in by_rule if r != generic[0])
        return HeadDimRope(head_dims=tuple(sorted(by_rule[special])), rule=special, other=generic[0])
    raise UserError(
        f"RoPE rules by head_dim {by_rule} do not fit one head_dim-dependent rule; "
        "write the profile by hand (docs/profiles.md)"
    )


def build_profile(entry: dict, residual: str | None = None) -> tuple[Profile, dict[str, str]]:
    """(Profile, {region: source}) from one entry of ``reader.read_results``; ValueError when a region is open."""
    model = entry.get("model")
    covered = model["regions"] if model else {}
    regions = {name: covered.get(name, r) for name, r in entry["regions"].items()}
    tag = f"{entry['engine']} {entry['mode']}"
    open_ = {name: r for name, r in regions.items() if r.status != "determined"}
    residual_region = regions["residual"]
    if residual is not None:
        residual = ResidualRule.parse(residual, "residual").value
        if residual not in residual_region.rules:
            raise UserError(
                f"--residual {residual} contradicts the battery: the {tag} run's residual is "
                f"{residual_region.status} {residual_region.rules}"
            )
        open_.pop("residual", None)
    if open_:
        detail = "; ".join(f"{name}: {r.status} {r.rules}" for name, r in open_.items())
        hint = (
            " (the residual: pass --residual round_at_attention|never_round, e.g. from `roundalign fit`)"
            if "residual" in open_ and residual_region.status == "indistinguishable"
            else ""
        )
        raise UserError(f"cannot write a profile for the {tag} run, not every region is determined: {detail}{hint}")
    rules = {name: r.rules[0] for name, r in regions.items() if name != "rope"}
    rules["residual"] = residual or rules["residual"]
    sources = {name: "battery (the model's shapes)" if name in covered else "battery" for name in regions}
    if residual is not None and residual_region.status != "determined":
        sources["residual"] = "--residual (the op level cannot tell it)"
    version = entry.get("engine_version", "?")
    rope = RopeRule.parse(regions["rope"].rules[0]) if model else _rope(regions["rope"])
    shaped = f", for {model['constants']['name']} (head_dim={model['constants']['head_dim']})" if model else ""
    profile = Profile(
        name=f"fingerprint-{entry['engine']}-{entry['mode']}",
        rope=rope,
        engines=f"{entry['engine']} {version}, {entry['mode']} mode, {entry.get('device', '?')}, "
        f"torch {entry.get('torch', '?')}{shaped}",
        source="roundalign fingerprint read: " + ", ".join(f"{k} from {v}" for k, v in sources.items()),
        **rules,
    )
    return profile, sources
