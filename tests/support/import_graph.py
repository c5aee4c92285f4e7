"""The import graph of the project's packages: `make check` fails on any cycle and on any import
that breaks the layer table of docs/architecture.md (its data: tests/support/layers.py).

Every import counts, wherever it is written: at module top, inside a function (a lazy import
still ties the two modules together) and under `TYPE_CHECKING` (a type hint that closes a
circle is a circle a reader has to untangle). An import of a name resolves to the module that
defines it when that name is a module of the project, else to the module named. A layer rule
may count only the imports that run when the module loads (not inside a function, not under
`TYPE_CHECKING`): "torch at module top only in ...".

    python -m tests.support.import_graph worker/multiworld operator/multiworld_operator
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

from tests.support.layers import LAYERS, Layer


def modules(package_dirs: Iterable[Path]) -> dict[str, Path]:
    """Every module of the packages by its dotted name (a package by its own name)."""
    found = {}
    for package in package_dirs:
        for path in sorted(package.rglob("*.py")):
            parts = path.relative_to(package.parent).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


class Site(NamedTuple):
    """One module an import statement names: project or third party."""

    target: str
    line: int
    at_load: bool  # runs when the module is imported: not inside a function, not under TYPE_CHECKING


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def sites(name: str, path: Path, known: Mapping[str, Path]) -> list[Site]:
    """Every module that module `name` (at `path`) imports, with where and when."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Site] = []

    def walk(nodes: Iterable[ast.AST], at_load: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and _type_checking(node.test):
                walk(node.body, False)
                walk(node.orelse, at_load)
                continue
            if isinstance(node, ast.Import):
                found.extend(Site(alias.name, node.lineno, at_load) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    found.append(Site(submodule if submodule in known else base, node.lineno, at_load))
            inside = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            walk(ast.iter_child_nodes(node), at_load and not inside)

    walk([ast.parse(path.read_text(), str(path))], True)
    return found


def imports(name: str, path: Path, known: Mapping[str, Path]) -> set[str]:
    """The project's modules that module `name` (at `path`) imports."""
    return {s.target for s in sites(name, path, known) if s.target in known and s.target != name}


def graph(package_dirs: Iterable[Path]) -> dict[str, set[str]]:
    known = modules(package_dirs)
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """The import cycles: each strongly connected group of two or more modules, sorted
    (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return sorted(found)


def violations(package_dirs: Iterable[Path], layers: Iterable[Layer] = LAYERS) -> list[str]:
    """Each import that breaks a layer rule, as `module -> imported (rule; ...) at path:line`,
    and each module no layer holds."""
    known = modules(package_dirs)
    layers = list(layers)
    found = []
    for name, path in sorted(known.items()):
        mine = [layer for layer in layers if layer.holds(name)]
        if not mine:
            found.append(f"{name} -> nothing (no layer of the table holds {name})")
        broken: dict[str, tuple[int, list[str]]] = {}
        for site in sites(name, path, known):
            rules = [
                f"{layer.name} must not import {rule.label}" for layer in mine for rule in layer.breaks(name, site)
            ]
            if rules and site.target != name:
                line, seen = broken.setdefault(site.target, (site.line, []))
                seen.extend(r for r in rules if r not in seen)
        for target, (line, rules) in sorted(broken.items()):
            found.append(f"{name} -> {target} ({'; '.join(rules)}) at {path}:{line}")
    return found


def main(argv: list[str]) -> int:
    dirs = [Path(a) for a in argv]
    found = cycles(graph(dirs))
    for group in found:
        sys.stderr.write(f"import cycle: {' <-> '.join(group)}\n")
    broken = violations(dirs)
    for line in broken:
        sys.stderr.write(f"layer broken: {line}\n")
    return 1 if found or broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
