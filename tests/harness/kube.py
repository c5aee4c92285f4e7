"""The test cluster's modules, for the kube tests (tests/kube/conftest.py) and the benches.

tests/cluster/ is no package (its files run as scripts: `python tests/cluster/images.py`), so
its cluster.py and images.py are loaded from their files, once, under the names everything
imports them by: `multiworld_test_cluster` and `multiworld_test_images` (their types:
tests/kube/multiworld_test_*.pyi).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TESTS = Path(__file__).resolve().parents[1]
_CLUSTER_FILES = {"multiworld_test_cluster": "cluster.py", "multiworld_test_images": "images.py"}


def cluster_modules() -> tuple[ModuleType, ModuleType]:
    """tests/cluster/cluster.py and images.py as multiworld_test_cluster and multiworld_test_images."""
    for name, file in _CLUSTER_FILES.items():
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, TESTS / "cluster" / file)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
    return sys.modules["multiworld_test_cluster"], sys.modules["multiworld_test_images"]


def kube_support(name: str) -> ModuleType:
    """A support module of the kube tests (operator_support, node_support) outside pytest, which
    puts tests/kube on sys.path for its tests; they import the cluster modules above."""
    cluster_modules()
    folder = str(TESTS / "kube")
    if folder not in sys.path:
        sys.path.append(folder)
    return importlib.import_module(name)
