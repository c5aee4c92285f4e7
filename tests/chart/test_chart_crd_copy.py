"""The chart ships the generated MultiWorld CRD unchanged: charts/.../crds/ is a byte-identical
copy of crds/ (refresh both with `make crd`)."""

from __future__ import annotations

import helm_python as helm
import pytest
import yaml

from tests.support.chart_support import CHART_DIR, REPO

pytestmark = pytest.mark.quick

CRD_FILE = "multiworld.io_multiworlds.yaml"


def test_chart_crd_is_a_byte_identical_copy_of_the_generated_one() -> None:
    generated = REPO / "crds" / CRD_FILE
    shipped = CHART_DIR / "crds" / CRD_FILE
    assert generated.is_file(), f"{generated} is missing: run `make crd`"
    assert shipped.is_file(), f"{shipped} is missing: run `make crd`"
    assert shipped.read_bytes() == generated.read_bytes(), f"{shipped} differs from {generated}: run `make crd`"


def test_chart_ships_only_the_multiworld_crd(chart: helm.Chart) -> None:
    (crd,) = chart.crds
    assert crd["filename"] == f"{chart.name}/crds/{CRD_FILE}"
    body = yaml.safe_load(crd["data"])
    assert body["kind"] == "CustomResourceDefinition"
    assert body["metadata"]["name"] == "multiworlds.multiworld.io"
