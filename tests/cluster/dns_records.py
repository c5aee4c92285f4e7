"""Cluster DNS records for the test node, the way kube-dns was built: dnsmasq fed from the API.

Polls Services and Endpoints and writes kube-dns-style records to one hosts file that dnsmasq
(`--hostsdir`) re-reads by inotify:

- `<svc>.<ns>.svc.<domain>` -> the ClusterIP, or every endpoint address of a headless Service;
- `<hostname>.<svc>.<ns>.svc.<domain>` -> an endpoint whose pod set `spec.hostname` and
  `spec.subdomain` (the endpoints controller copies the hostname onto the address).

Standard library only, so `cluster.py up` can start it from any Python:

    python tests/cluster/dns_records.py --kubeconfig .cluster/kubeconfig --out .cluster/node/dns/hosts
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import ssl
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("multiworld.test_dns")

POLL_S = 0.25


class Api:
    """GETs as the kubeconfig's user (the token kubeconfig that cluster.py writes)."""

    def __init__(self, kubeconfig: Path) -> None:
        config = json.loads(kubeconfig.read_text())
        cluster = config["clusters"][0]["cluster"]
        self.server = cluster["server"]
        self.context = ssl.create_default_context(cafile=cluster["certificate-authority"])
        self.token = config["users"][0]["user"]["token"]

    def get(self, path: str) -> dict[str, Any]:
        request = urllib.request.Request(self.server + path, headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(request, context=self.context, timeout=10) as response:
            return json.load(response)


def records(services: dict[str, Any], endpoints: dict[str, Any], domain: str) -> Iterator[tuple[str, str]]:
    """(address, name) pairs for every Service and every named endpoint of a headless Service."""
    by_service = {(item["metadata"]["namespace"], item["metadata"]["name"]): item for item in endpoints["items"]}
    for service in services["items"]:
        namespace, name = service["metadata"]["namespace"], service["metadata"]["name"]
        fqdn = f"{name}.{namespace}.svc.{domain}"
        cluster_ip = service["spec"].get("clusterIP")
        if cluster_ip and cluster_ip != "None":
            yield cluster_ip, fqdn
            continue
        for subset in by_service.get((namespace, name), {}).get("subsets") or []:
            for address in (subset.get("addresses") or []) + (subset.get("notReadyAddresses") or []):
                yield address["ip"], fqdn
                if address.get("hostname"):
                    yield address["ip"], f"{address['hostname']}.{fqdn}"


def write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)


def serve(api: Api, out: Path, domain: str) -> None:
    written = None
    while True:
        try:
            text = "".join(
                f"{ip} {name}\n"
                for ip, name in sorted(set(records(api.get("/api/v1/services"), api.get("/api/v1/endpoints"), domain)))
            )
        except OSError as error:  # the API server restarting or stopping: try again
            log.warning("listing services failed: %s", error)
        else:
            if text != written:
                write_atomically(out, text)
                written = text
        time.sleep(POLL_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dns_records.py", description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="the hosts file dnsmasq reads")
    parser.add_argument("--domain", default="cluster.local")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="dns-records: %(message)s")
    serve(Api(args.kubeconfig), args.out, args.domain)
    return 0


if __name__ == "__main__":
    sys.exit(main())
