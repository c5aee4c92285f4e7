"""Fixtures rendering the multiworld-operator chart with real Helm (helm-python-sdk), offline."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import helm_python as helm
import pytest
import yaml

from tests.support.chart_support import CHART_DIR, RELEASE, RELEASE_NAMESPACE, Manifest, Rendered


@pytest.fixture(scope="session")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def render(chart: helm.Chart) -> Callable[..., Rendered]:
    def _render(values: dict[str, Any] | None = None) -> Rendered:
        manifests = chart.render(values, name=RELEASE, namespace=RELEASE_NAMESPACE)
        objects: list[Manifest] = []
        notes = ""
        for path, text in manifests.items():
            if path.endswith("NOTES.txt"):
                notes = text
                continue
            objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
        return Rendered(objects=objects, notes=notes)

    return _render
