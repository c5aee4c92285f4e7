"""The chart installed with real Helm (helm-python-sdk) running our dev images: what `make
operator` runs against the `make cluster` node, and what the node tests install. The same as

    helm install multiworld charts/multiworld-operator --namespace multiworld --create-namespace \\
        --set image.repository=multiworld/operator --set image.tag=dev --set image.pullPolicy=Never \\
        --set 'workers.namespaces={default}'

Usage (from the repository root, with the venv's Python):
    python -m tests.cluster.operator_release [--kubeconfig .cluster/kubeconfig]
           [--namespace multiworld] [--release multiworld] [--workers-namespace default ...]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import helm_python as helm
from kubernetes import client, config
from kubernetes.client.rest import ApiException

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "charts" / "multiworld-operator"
OPERATOR_IMAGE = {"repository": "multiworld/operator", "tag": "dev", "pullPolicy": "Never"}
HELM_TIMEOUT_S = 180


def install(
    kubeconfig: Path,
    namespace: str,
    release: str,
    worker_namespaces: Sequence[str],
    *,
    watch_only_those: bool = False,
    replicas: int | None = None,
    node: str | None = None,
    wait: bool = False,
) -> dict[str, Any]:
    """Create the namespaces that are missing, then `helm install` the chart: the operator's
    Deployment (image multiworld/operator:dev, never pulled; `replicas`, else the chart's) in
    `namespace`, the worker ServiceAccount in each of `worker_namespaces`; the operator watches
    every namespace, or with `watch_only_those` only those (so that several releases share a
    cluster); with `node`, on that node only (the chart's nodeSelector); with `wait`, as
    `helm install --wait`: back once every resource is ready (the Deployment's replicas too)."""
    with config.new_client_from_config(config_file=str(kubeconfig)) as api:
        core = client.CoreV1Api(api)
        for name in (namespace, *worker_namespaces):
            try:
                core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
            except ApiException as error:
                if error.status != 409:
                    raise
    values: dict[str, Any] = {"image": OPERATOR_IMAGE, "workers": {"namespaces": list(worker_namespaces)}}
    if watch_only_those:
        values["watchNamespaces"] = list(worker_namespaces)
    if replicas is not None:
        values["replicas"] = replicas
    if node is not None:
        values["nodeSelector"] = {"kubernetes.io/hostname": node}
    with helm.Config(kubeconfig_path=str(kubeconfig), namespace=namespace) as helm_config:
        installed: dict[str, Any] = helm_config.install(
            CHART_DIR, release, values, timeout=HELM_TIMEOUT_S, wait="watcher" if wait else None
        )
    if installed["status"] != "deployed":
        raise RuntimeError(f"helm install of {release} ended {installed['status']}: {installed}")
    return installed


def uninstall(kubeconfig: Path, namespace: str, release: str) -> None:
    """`helm uninstall`: the release's objects go (its namespaces stay)."""
    with helm.Config(kubeconfig_path=str(kubeconfig), namespace=namespace) as helm_config:
        helm_config.uninstall(release, timeout=HELM_TIMEOUT_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="operator_release.py", description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", type=Path, default=REPO / ".cluster" / "kubeconfig")
    parser.add_argument("--namespace", default="multiworld", help="the operator's namespace (default multiworld)")
    parser.add_argument("--release", default="multiworld")
    parser.add_argument(
        "--workers-namespace",
        action="append",
        dest="workers",
        help="where MultiWorlds will be applied (repeatable; default: default)",
    )
    args = parser.parse_args(argv)
    installed = install(args.kubeconfig, args.namespace, args.release, args.workers or ["default"])
    print(f"release {args.release} {installed['status']} in namespace {args.namespace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
