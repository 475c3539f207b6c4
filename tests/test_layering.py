"""The package layering that docs/design.md ("Architecture") states, and no import circle anywhere in src/.

Every import of a roundalign module is read from the source (an AST walk: function-level imports included, which is
where circles hide), so this test needs nothing installed beyond the standard library. Two rules:

- no circle between modules: a module never reaches itself through the imports it makes;
- each component (a top-level module or package of roundalign) imports only components on lower layers of
  ``LAYERS``, so a package never imports one above it. A new component must be given its layer here and in
  docs/design.md.

``import roundalign`` (the package face, whose names load lazily) is not counted: it is how callers reach
``roundalign.apply`` and friends, and is allowed from any layer above ``patch``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Lowest first. Components on one layer do not import each other.
LAYERS = [
    ["errors", "compile_key", "native", "durable"],
    ["extras", "options", "models", "support", "untrusted", "tasks"],
    ["console", "prompts", "rollouts", "quant"],
    ["profiles"],
    ["numerics"],
    ["mixed_precision", "sync", "ops"],
    ["rotary"],
    ["engine"],
    ["kernels"],
    ["patch"],
    ["trainer"],
    ["engines"],
    ["probe", "dump", "fit", "fingerprint", "rl"],
    ["calibrate", "integrations"],
    ["cli"],
    ["__main__"],
]
LAYER = {c: i for i, layer in enumerate(LAYERS) for c in layer}


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "roundalign").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the roundalign modules it imports, wherever in the file the import stands."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {resolve(a.name) for a in node.names if a.name.startswith("roundalign")}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                if base.startswith("roundalign"):
                    found |= {resolve(f"{base}.{a.name}") if f"{base}.{a.name}" in modules else resolve(base)
                              for a in node.names}  # fmt: skip
        graph[name] = found - {None, name}
    return graph


def _component(module: str) -> str:
    return module.split(".")[1] if "." in module else "roundalign"


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), iteratively."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                members = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    members.append(w)
                    if w == v:
                        break
                if len(members) > 1:
                    found.append(sorted(members))
    return found


GRAPH = _imports(_modules())


def test_the_walk_sees_function_level_imports():
    # roundalign.cli imports each command module by name at run time, but its own imports are read here; and the
    # probe's run imports the engine launcher inside a method: that edge must be in the graph.
    assert "roundalign.engines.launch" in GRAPH["roundalign.probe.run"]
    assert "roundalign.errors" in GRAPH["roundalign.cli"]


def test_no_import_circle_in_src():
    assert _circles(GRAPH) == []


def test_the_circle_finder_finds_one():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_component_has_a_layer():
    components = {_component(m) for m in GRAPH} - {"roundalign"}
    assert components - set(LAYER) == set(), "give each new package its layer here and in docs/design.md"


def test_no_component_imports_one_on_its_layer_or_above():
    wrong = sorted(
        f"{m} -> {o}"
        for m, outs in GRAPH.items()
        for o in outs
        if _component(o) != "roundalign"
        and _component(m) != _component(o)
        and LAYER.get(_component(m), 99) <= LAYER.get(_component(o), 99)
    )
    assert wrong == []


def test_the_face_is_reached_only_from_above_patch():
    below = sorted(
        m for m, outs in GRAPH.items() if "roundalign" in outs and LAYER.get(_component(m), 99) <= LAYER["patch"]
    )
    assert below == []


def test_design_doc_states_the_same_layers():
    text = (SRC.parent / "docs" / "design.md").read_text()
    section = text[text.index(". Architecture\n") :]
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \|", section, flags=re.M)
    stated = {int(n): sorted(c.strip(" `") for c in names.split(",")) for n, names in rows}
    assert stated == {i: sorted(layer) for i, layer in enumerate(LAYERS)}
