"""The import check `make check` runs (tests/support/import_graph.py): it finds every cycle, lazy and
type-hint imports included, and the project has none."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.import_graph import cycles, graph

pytestmark = pytest.mark.quick

REPO = Path(__file__).resolve().parents[2]


def package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_a_cycle_closed_by_a_lazy_or_type_hint_import_is_found(tmp_path: Path) -> None:
    pkg = package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from pkg import b\n",
            "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.c import C\n",
            "sub/__init__.py": "",
            "sub/c.py": "def f():\n    from ..a import x\n",
            "d.py": "import pkg.a\n",
        },
    )
    edges = graph([pkg])
    assert edges["pkg.d"] == {"pkg.a"} and edges["pkg.sub.c"] == {"pkg.a"}
    assert cycles(edges) == [["pkg.a", "pkg.b", "pkg.sub.c"]]


def test_a_graph_without_a_circle_has_no_cycle() -> None:
    assert cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_the_project_imports_no_module_in_a_circle() -> None:
    assert cycles(graph([REPO / "worker" / "multiworld", REPO / "operator" / "multiworld_operator"])) == []
