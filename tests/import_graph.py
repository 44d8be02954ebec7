"""The package's imports, read from its source: which evalkit module imports which, circles, arrows up.

Every `import` statement counts, at module level or inside a function (a lazy import is still
a dependency: it only moves the moment it is paid). `from evalkit.store import runs` names the
module `evalkit.store.runs`; `from evalkit.store.db import now` names `evalkit.store.db`.

The layers, each with the layers it may import (its own included). The store and the readers of
stored runs (report, release, compare) never import the engines, which load models; the floor
imports nothing above itself. An import of a layer that is not allowed is an arrow up. Within a
layer, modules must not form a circle.

    python tests/import_graph.py      # prints the circles and the arrows up (exit 1 when any)
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "evalkit"

# layer -> (module prefixes, layers it may import besides itself); the longest matching prefix places a module
LAYERS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "floor": (("evalkit.errors", "evalkit.kinds", "evalkit.defaults", "evalkit.envvars", "evalkit.version",
               "evalkit.install", "evalkit.labels", "evalkit.contract", "evalkit.paths", "evalkit.progress",
               "evalkit.memo", "evalkit.cachedir", "evalkit.loaderrors",
               "evalkit.redact", "evalkit.textsafe", "evalkit.threads"),
              frozenset()),
    "scoring": (("evalkit.scoring",), frozenset({"floor"})),
    "prompts": (("evalkit.prompts",), frozenset({"floor", "scoring"})),
    "store": (("evalkit.store",), frozenset({"floor", "scoring"})),
    "engines": (("evalkit.engines",), frozenset({"floor", "scoring", "prompts"})),
    "readers": (("evalkit.report", "evalkit.release", "evalkit.compare"),
                frozenset({"floor", "scoring", "prompts", "store"})),
    "runner": (("evalkit.runner", "evalkit.inspection"), frozenset({"floor", "scoring", "prompts", "store", "engines"})),
    "surface": (("evalkit", "evalkit.api", "evalkit.cli", "evalkit.__main__"),
                frozenset({"floor", "scoring", "prompts", "store", "engines", "readers", "runner"})),
}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(p, package.parent): p for p in sorted(package.rglob("*.py"))}


def imported(path: Path, name: str, known: set[str]) -> Iterator[tuple[str, int]]:
    """(evalkit module, line) for every import statement of one file."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "evalkit":
                    yield _known(alias.name, known), node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            if base.split(".")[0] != "evalkit":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield (sub if sub in known else _known(base, known)), node.lineno


def _known(dotted: str, known: set[str]) -> str:
    while dotted not in known and "." in dotted:
        dotted = dotted.rsplit(".", 1)[0]
    return dotted


def graph(package: Path = PACKAGE) -> nx.DiGraph:
    """evalkit module -> evalkit module, each edge with the (file, line) of its first import."""
    found = modules(package)
    g = nx.DiGraph()
    g.add_nodes_from(found)
    for name, path in found.items():
        for target, line in imported(path, name, set(found)):
            if target != name and not g.has_edge(name, target):
                g.add_edge(name, target, where=f"{path.relative_to(package.parent)}:{line}")
    return g


def layer_of(module: str) -> str:
    best, depth = None, -1
    for layer, (prefixes, _) in LAYERS.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > depth:
                best, depth = layer, len(prefix)
    if best is None:
        raise ValueError(f"{module} is in no layer of tests/import_graph.py: place it")
    return best


def circles(g: nx.DiGraph) -> list[list[str]]:
    """Each group of modules that import each other, directly or around a circle (sorted)."""
    return sorted(sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1)


def arrows_up(g: nx.DiGraph) -> list[str]:
    """Each import of a layer its importer may not import, with where it is."""
    out = []
    for a, b, data in g.edges(data=True):
        la, lb = layer_of(a), layer_of(b)
        if la != lb and lb not in LAYERS[la][1]:
            out.append(f"{a} ({la}) -> {b} ({lb})  at {data['where']}")
    return sorted(out)


def report(g: nx.DiGraph) -> str:
    lines = [f"{g.number_of_nodes()} modules, {g.number_of_edges()} imports between them"]
    found = circles(g)
    lines.append(f"circles: {len(found)}")
    for group in found:
        cycle = nx.find_cycle(g.subgraph(group))
        lines.append(f"  {len(group)} modules: {', '.join(group)}")
        lines.append("    e.g. " + " -> ".join([a for a, _ in cycle] + [cycle[0][0]]))
    up = arrows_up(g)
    lines.append(f"arrows up: {len(up)}")
    lines += [f"  {a}" for a in up]
    return "\n".join(lines)


if __name__ == "__main__":
    g = graph()
    print(report(g))
    sys.exit(1 if circles(g) or arrows_up(g) else 0)
