"""The chart's Grafana dashboard as Prometheus sees it: every query of its panels and variables,
with the variables set as Grafana sets them for "All", ready to send to a real Prometheus
(prometheus.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

DASHBOARD_FILE = (
    Path(__file__).resolve().parents[2] / "charts" / "multiworld-operator" / "dashboards" / "multiworld.json"
)
# What Grafana puts in place of its own variables; the dashboard's variables all become their
# allValue (what "All" selects).
GRAFANA_BUILTINS = {"__rate_interval": "1m", "__interval": "1m", "__range": "1h"}
VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")
LABEL_VALUES = re.compile(r"^label_values\((.+),\s*(\w+)\)$")


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD_FILE.read_text())
    return loaded


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def variables() -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard()["templating"]["list"]}


def substituted(expr: str) -> str:
    """The query as Grafana sends it with every variable set to "All"."""
    defined = variables()

    def value(match: re.Match[str]) -> str:
        name = next(group for group in match.groups() if group)
        if name in GRAFANA_BUILTINS:
            return GRAFANA_BUILTINS[name]
        if name not in defined:
            raise ValueError(f"{expr!r} uses the undefined variable ${name}")
        return str(defined[name]["allValue"])

    return VARIABLE.sub(value, expr)


def queries() -> list[tuple[str, str]]:
    """(where, PromQL as written) of every target of every panel ("<title>:<refId>"), and the
    selector of every variable's label_values query ("variable <name>")."""
    found = [
        (f"{panel['title']}:{target['refId']}", target["expr"]) for panel in panels() for target in panel["targets"]
    ]
    for variable in variables().values():
        if variable["type"] == "query":
            selector = LABEL_VALUES.match(variable["query"])
            if selector is None:
                raise ValueError(
                    f"variable {variable['name']}: {variable['query']!r} is no label_values(selector, label)"
                )
            found.append((f"variable {variable['name']}", selector.group(1)))
    return found
