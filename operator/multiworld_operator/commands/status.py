"""`multiworld status [NAME] [-n NAMESPACE] [--watch]`: a MultiWorld on a cluster, shown the way
`multiworld run`'s live view shows a local one.

With NAME: the MultiWorld's headline (phase, worlds running, restarts, pods updated), a row per
world (phase, epoch, ranks up, restarts, last failure, what a forming world waits for), its warm
spares, a running rollout and its conditions. Without: one line per MultiWorld of the namespace
(what `kubectl get mw` shows). `--watch` shows it anew on every change of the object. Credentials
and the default namespace come from the kubeconfig (KUBECONFIG, or `--kubeconfig`), as kubectl's
do. What is shown is the object's `status` as the operator wrote it, parsed by the same model.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, TextIO, cast

import urllib3
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from multiworld_operator.kube.client.nesting import allow_api_depth
from multiworld_operator.planner import StatusView
from multiworld_operator.spec.resource import API_GROUP, API_VERSION, PLURAL
from multiworld_operator.text_columns import aligned

# How long a watch request stays open before it is renewed (the API server ends it anyway).
WATCH_TIMEOUT_S = 300


class StatusCommandError(Exception):
    """What the user is told, one line, exit status 1."""


def age(since: datetime, now: datetime) -> str:
    """`kubectl`'s short age: 45s, 12m, 3h, 5d."""
    seconds = max(int((now - since).total_seconds()), 0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _status(obj: Mapping[str, Any]) -> StatusView:
    return StatusView.model_validate(obj.get("status") or {})


def _created(obj: Mapping[str, Any]) -> datetime:
    return datetime.fromisoformat(obj["metadata"]["creationTimestamp"].replace("Z", "+00:00"))


def list_lines(objects: Sequence[Mapping[str, Any]], now: datetime) -> list[str]:
    """One line per MultiWorld: kubectl's columns."""
    rows = [["NAME", "PHASE", "WORLDS", "RESTARTS", "UPDATED", "AGE"]]
    for obj in sorted(objects, key=lambda o: o["metadata"]["name"]):
        status = _status(obj)
        rows.append(
            [
                obj["metadata"]["name"],
                status.phase,
                status.worlds_ready,
                str(status.restarts),
                status.updated,
                age(_created(obj), now),
            ]
        )
    return aligned(rows)


def detail_lines(obj: Mapping[str, Any], now: datetime) -> list[str]:
    """One MultiWorld: its headline, a row per world (in the spec's order), spares, rollout and
    conditions."""
    status = _status(obj)
    meta = obj["metadata"]
    lines = [
        f"{meta['namespace']}/{meta['name']}: {status.phase}, worlds running {status.worlds_ready}, "
        f"restarts {status.restarts}, pods updated {status.updated}, age {age(_created(obj), now)}"
    ]
    if status.observed_generation is not None and status.observed_generation != meta.get("generation"):
        lines.append(f"(status of generation {status.observed_generation}; the spec is at {meta.get('generation')})")
    order = [w.get("name") for w in obj.get("spec", {}).get("worlds", [])]
    names = [n for n in order if n in status.worlds] + sorted(set(status.worlds) - set(order))
    rows = [["WORLD", "PHASE", "EPOCH", "RANKS UP", "RESTARTS", "LAST FAILURE"]]
    for name in names:
        world = status.worlds[name]
        failure = world.last_failure
        last = (
            f"{failure.reason} {failure.pod} (rank {failure.rank}, epoch {failure.epoch}) {age(failure.time, now)} ago"
            if failure
            else ""
        )
        rows.append(
            [name, world.phase, str(world.epoch), f"{world.ready_ranks}/{world.size}", str(world.restarts), last]
        )
    lines += aligned(rows)
    for name in names:
        world = status.worlds[name]
        if world.restart_at is not None:
            lines.append(f"{name}: restarts after its backoff, at {world.restart_at.isoformat()}")
        lines += [f"{name}: {pod} waits: {why}" for pod, why in sorted(world.waiting.items())]
    if status.spares:
        lines.append("spares (ready/wanted): " + ", ".join(f"{m} {n}" for m, n in sorted(status.spares.items())))
    if status.played_by:
        lines.append("played by spares: " + ", ".join(f"{p} by {s}" for p, s in sorted(status.played_by.items())))
    if status.rollout:
        lines.append("rollout (updated/all): " + ", ".join(f"{m} {n}" for m, n in sorted(status.rollout.items())))
    for c in status.conditions:
        lines.append(f"{c.type}={c.status} {c.reason}" + (f": {c.message}" if c.message else ""))
    return lines


def _namespace(given: str | None) -> str:
    if given:
        return given
    try:
        _, current = config.list_kube_config_contexts()
    except config.ConfigException:
        return "default"
    return str(current.get("context", {}).get("namespace") or "default")


def _api(kubeconfig: str | None) -> client.CustomObjectsApi:
    try:
        config.load_kube_config(config_file=kubeconfig)
    except (config.ConfigException, OSError) as exc:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            raise StatusCommandError(
                f"no cluster credentials in {_kubeconfig_read(kubeconfig)} ({_why(kubeconfig, exc)}): "
                "`multiworld status` shows "
                "MultiWorlds on a Kubernetes cluster, so point --kubeconfig or KUBECONFIG at one "
                "(`multiworld run FILE.yaml` runs a MultiWorld on this machine with no cluster)"
            ) from exc
    allow_api_depth()  # a status anyone with `update` on multiworlds/status wrote
    return client.CustomObjectsApi()


def _why(given: str | None, error: Exception) -> str:
    """Why the kubeconfig gave no credentials: no such file (the client's words say only that
    it found no configuration), or the client's reason."""
    _, paths = _kubeconfig_source(given)
    if not any(os.path.exists(os.path.expanduser(p)) for p in paths):
        return "no such file"
    return str(error)


def _kubeconfig_read(given: str | None) -> str:
    """The kubeconfig file(s) the client read, as the user named them."""
    return _kubeconfig_source(given)[0]


def _kubeconfig_source(given: str | None) -> tuple[str, list[str]]:
    """Where the client reads its kubeconfig, as kubectl picks it (--kubeconfig, else
    $KUBECONFIG, else the default file): its name for the user, and its file paths."""
    if given:
        return given, [given]
    if os.environ.get("KUBECONFIG"):
        listed = os.environ["KUBECONFIG"]
        return f"KUBECONFIG={listed}", [p for p in listed.split(os.pathsep) if p]
    default = os.path.expanduser(config.KUBE_CONFIG_DEFAULT_LOCATION)
    return default, [default]


def _api_error(exc: ApiException, what: str) -> StatusCommandError:
    if exc.status == 404:
        return StatusCommandError(f"{what}: not found")
    return StatusCommandError(f"{what}: the API server answered {exc.status} {exc.reason}")


def _snapshots(api: client.CustomObjectsApi, namespace: str, name: str | None, follow: bool) -> Iterator[Any]:
    """The MultiWorld (or the namespace's list) now, then after each change while `follow`."""
    what = f"multiworld {namespace}/{name}" if name else f"multiworlds in namespace {namespace}"
    args = (API_GROUP, API_VERSION, namespace, PLURAL)
    selector = f"metadata.name={name}" if name else None
    while True:  # once, or again whenever the watch's version expired
        try:
            listed = cast(dict[str, Any], api.list_namespaced_custom_object(*args, field_selector=selector))
        except ApiException as exc:
            raise _api_error(exc, what) from exc
        items = {o["metadata"]["name"]: o for o in listed["items"]}
        if name and name not in items:
            raise StatusCommandError(f"{what}: not found")
        yield items
        version = listed["metadata"]["resourceVersion"]
        try:
            while follow:
                for event in watch.Watch().stream(
                    api.list_namespaced_custom_object,
                    *args,
                    field_selector=selector,
                    resource_version=version,
                    timeout_seconds=WATCH_TIMEOUT_S,
                ):
                    obj = event["object"]
                    version = obj["metadata"]["resourceVersion"]
                    if event["type"] == "DELETED":
                        items.pop(obj["metadata"]["name"], None)
                        if name:
                            raise StatusCommandError(f"{what}: deleted")
                    else:
                        items[obj["metadata"]["name"]] = obj
                    yield items
        except ApiException as exc:
            if exc.status != 410:
                raise _api_error(exc, what) from exc
            continue
        return


def show(
    name: str | None,
    namespace: str | None,
    watch_changes: bool,
    kubeconfig: str | None = None,
    out: TextIO = sys.stdout,
) -> int:
    """Print the status (and, with `watch_changes`, again on every change); 0, or 1 with the
    error said on stderr."""
    # The client's retries are warnings of urllib3's: an unreachable server is said once, below.
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    try:
        ns = _namespace(namespace)
        for items in _snapshots(_api(kubeconfig), ns, name, watch_changes):
            now = datetime.now(UTC)
            if name:
                lines = detail_lines(items[name], now)
            elif items:
                lines = list_lines(list(items.values()), now)
            else:
                lines = [f"no MultiWorlds in namespace {ns}"]
            if watch_changes:
                lines = [f"--- {now.strftime('%H:%M:%S')}", *lines]
            out.write("\n".join(lines) + "\n")
            out.flush()
    except StatusCommandError as exc:
        sys.stderr.write(f"multiworld status: {exc}\n")
        return 1
    except urllib3.exceptions.HTTPError as exc:
        host = client.Configuration.get_default_copy().host
        sys.stderr.write(
            f"multiworld status: cannot reach the API server at {host} (from {_kubeconfig_read(kubeconfig)}): "
            f"{getattr(exc, 'reason', None) or exc}\n"
        )
        return 1
    except KeyboardInterrupt:
        return 0
    return 0
