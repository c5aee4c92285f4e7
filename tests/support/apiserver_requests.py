"""The API server's own account of the write requests it served, from its /metrics: how many
of each kind (apiserver_request_total) and how long it took over them
(apiserver_request_duration_seconds). Totals since it started; subtract two snapshots."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from kubernetes import client

WRITE_VERBS = frozenset({"POST", "PUT", "PATCH", "DELETE", "DELETECOLLECTION", "APPLY"})
_SAMPLE = re.compile(
    r"^(?P<metric>apiserver_request_total|apiserver_request_duration_seconds_sum)"
    r"\{(?P<labels>[^}]*)\} (?P<value>\S+)$"
)
_LABEL = re.compile(r'(\w+)="([^"]*)"')

Kind = tuple[str, str, str]  # (verb, resource, subresource)


def label(kind: Kind) -> str:
    verb, resource, subresource = kind
    return f"{verb} {resource}/{subresource}" if subresource else f"{verb} {resource}"


def encoding(content_type: str) -> str:
    """Which clients a request came from: the Python client (operator, bench) speaks JSON, the
    Go components (controller-manager) protobuf."""
    if content_type == "application/json":
        return "json"
    return "protobuf" if "protobuf" in content_type else content_type


@dataclass(frozen=True)
class Writes:
    """Write requests by kind and client encoding (every outcome: a refused write counts too),
    and the API server's seconds spent on each kind (durations carry no encoding)."""

    counts: Counter[tuple[Kind, str]]
    seconds: Counter[Kind]

    def __sub__(self, earlier: Writes) -> Writes:
        return Writes(self.counts - earlier.counts, self.seconds - earlier.seconds)

    def total(self) -> int:
        return sum(self.counts.values())

    def by_kind(self) -> Counter[Kind]:
        out: Counter[Kind] = Counter()
        for (kind, _), count in self.counts.items():
            out[kind] += count
        return out

    def by_encoding(self, name: str) -> int:
        return sum(count for (_, enc), count in self.counts.items() if enc == name)

    def without(self, kind: Kind, enc: str, count: int) -> Writes:
        """These writes less `count` of one kind, e.g. the bench's own; refuses to go below zero
        (the API server must have counted at least what the bench knows it sent)."""
        have = self.counts[kind, enc]
        if have < count:
            raise RuntimeError(f"the API server counted {have} {label(kind)} ({enc}), fewer than the {count} sent")
        counts = self.counts.copy()
        counts[kind, enc] -= count
        return Writes(+counts, self.seconds)


def scrape(api: client.ApiClient) -> Writes:
    request = api.param_serialize("GET", "/metrics", auth_settings=["BearerToken"])
    response = api.call_api(*request)
    data = response.read()
    counts: Counter[tuple[Kind, str]] = Counter()
    seconds: Counter[Kind] = Counter()
    for line in data.decode().splitlines():
        sample = _SAMPLE.match(line)
        if sample is None:
            continue
        labels = dict(_LABEL.findall(sample["labels"]))
        if labels.get("verb") not in WRITE_VERBS:
            continue
        kind = (labels["verb"], labels.get("resource", ""), labels.get("subresource", ""))
        if sample["metric"] == "apiserver_request_total":
            counts[kind, encoding(labels.get("contentType", ""))] += int(float(sample["value"]))
        else:
            # Float seconds in a Counter (typeshed types a Counter's counts as int).
            seconds[kind] += float(sample["value"])  # type: ignore[assignment]
    return Writes(counts, seconds)
