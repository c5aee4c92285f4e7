"""The import check `make check` runs (tests/support/import_graph.py): it finds every cycle, lazy and
type-hint imports included, and each import that breaks docs/architecture.md's layer table (its data:
tests/support/layers.py); the project has neither, and the table in the doc says what the data says."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.import_graph import cycles, graph, violations
from tests.support.layers import LAYERS, Layer, Rule

pytestmark = pytest.mark.quick

REPO = Path(__file__).resolve().parents[2]
PACKAGES = [REPO / "worker" / "multiworld", REPO / "operator" / "multiworld_operator"]


def tree(root: Path, files: dict[str, str]) -> list[Path]:
    """The files written under `root`; its top folders (the packages)."""
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return sorted(p for p in root.iterdir() if p.is_dir())


def test_a_cycle_closed_by_a_lazy_or_type_hint_import_is_found(tmp_path: Path) -> None:
    packages = tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg import b\n",
            "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.c import C\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/c.py": "def f():\n    from ..a import x\n",
            "pkg/d.py": "import pkg.a\n",
        },
    )
    edges = graph(packages)
    assert edges["pkg.d"] == {"pkg.a"} and edges["pkg.sub.c"] == {"pkg.a"}
    assert cycles(edges) == [["pkg.a", "pkg.b", "pkg.sub.c"]]


def test_a_graph_without_a_circle_has_no_cycle() -> None:
    assert cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_the_project_imports_no_module_in_a_circle() -> None:
    assert cycles(graph(PACKAGES)) == []


# A fake tree under the real table. Broken: kopf in kube/api, the planner importing kube (for a type
# hint) and torch (in a function), the manager importing world and torch at module top. Kept:
# kubernetes in kube/, torch in world and for a type hint in holdings, world inside a function.
LAYERED = {
    "multiworld_operator/__init__.py": "",
    "multiworld_operator/kube/__init__.py": "",
    "multiworld_operator/kube/client/api.py": "import kopf\nimport kubernetes.client\n",
    "multiworld_operator/planner/__init__.py": "",
    "multiworld_operator/planner/decide.py": (
        "from typing import TYPE_CHECKING\n"
        "from multiworld import contract\n"
        "if TYPE_CHECKING:\n    from ..kube.client import api\n"
        "def plan():\n    import torch\n"
    ),
    "multiworld/__init__.py": "",
    "multiworld/contract.py": "",
    "multiworld/world/core.py": "import torch\n",
    "multiworld/membership/holdings.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n",
    "multiworld/membership/joining.py": "def join():\n    from multiworld import world\n",
    "multiworld/manager.py": "from multiworld.world.core import World\nfrom torch import Tensor\n",
}


def test_each_import_that_breaks_a_layer_is_reported(tmp_path: Path) -> None:
    packages = tree(tmp_path, LAYERED)
    found = violations(packages)
    assert [line.split(" (")[0] for line in found] == [
        "multiworld.manager -> multiworld.world.core",
        "multiworld.manager -> torch",
        "multiworld_operator.kube.client.api -> kopf",
        "multiworld_operator.planner.decide -> multiworld_operator.kube.client.api",
        "multiworld_operator.planner.decide -> torch",
    ]
    decide = tmp_path / "multiworld_operator" / "planner" / "decide.py"
    assert found[3] == (
        "multiworld_operator.planner.decide -> multiworld_operator.kube.client.api (`planner/` must not import any "
        f"operator module outside `planner/` and `spec/` (kube, local, ...)) at {decide}:4"
    )
    assert "the operator: `multiworld_operator` must not import torch (its image has none)" in found[4]
    assert "`kube/` must not import kopf outside" in found[2]


def test_a_rule_names_what_it_forbids_and_where_it_allows_it(tmp_path: Path) -> None:
    layers = [
        Layer(
            "`a`", ("pkg.a",), (Rule("b but `b.ok`", ("pkg.b",), allowed=("pkg.b.ok",), allowed_in=("pkg.a.free",)),)
        ),
        Layer("`b`", ("pkg.b",), ()),
    ]
    packages = tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a/__init__.py": "from ..b import ok\n",
            "pkg/a/bad.py": "def f():\n    from pkg.b.deep import x\n",
            "pkg/a/free.py": "import pkg.b.deep\n",
            "pkg/b/__init__.py": "",
            "pkg/b/ok.py": "",
            "pkg/b/deep.py": "",
        },
    )
    assert violations(packages, layers) == [
        "pkg -> nothing (no layer of the table holds pkg)",
        f"pkg.a.bad -> pkg.b.deep (`a` must not import b but `b.ok`) at {tmp_path / 'pkg' / 'a' / 'bad.py'}:2",
    ]


def test_the_project_breaks_no_layer() -> None:
    assert violations(PACKAGES) == []


def doc_table() -> list[tuple[str, str]]:
    lines = (REPO / "docs" / "architecture.md").read_text().splitlines()
    start = lines.index("| Layer | May import | Must not import |") + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        assert len(cells) == 3, line
        rows.append((cells[0], cells[2]))
    return rows


def test_the_docs_layer_table_says_what_the_check_enforces() -> None:
    assert doc_table() == [(layer.name, layer.must_not_cell()) for layer in LAYERS]
