"""A tenant stores a MultiWorld nested as deep as the API server allows (issue 32: what the
operator reads back from any object must cost bounded memory and time). The templates and the
status keep unknown fields, and the API server stores JSON nested up to 10,000 levels, past
Python's recursion limit: before, one such MultiWorld made kopf's watch fail as it listed the
MultiWorlds, and the operator exited, again at every restart, so no MultiWorld of any tenant was
served.

Here the tenant, with its own credentials and no webhook in the way, creates a MultiWorld whose
template holds a value nested 9,900 deep, and writes a status nested as deep onto its other,
running MultiWorld. The operator keeps running, refuses the deep spec naming its field
(SpecValid=False, no pod made for it) and recovers the other MultiWorld's failure as usual;
`multiworld status` lists both.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tests.cluster.cluster import Cluster
from tests.support.operator_support import (
    GROUP,
    PLURAL,
    VERSION,
    Kubelet,
    KubeNamespace,
    cluster_release,
    refusals,
    two_worlds,
    wait_for,
)
from tests.support.tenant import CHART_LIMIT_MIB, deep_enough, nested, operator_process, peak_rss_mib, tenant_api

pytestmark = pytest.mark.kube

DEPTH = 9_900


def spec_valid(kube: KubeNamespace, name: str) -> dict[str, Any] | None:
    conditions = {c["type"]: c for c in kube.status(name).get("conditions") or []}
    return conditions.get("SpecValid")


def test_a_multiworld_nested_as_deep_as_the_api_server_allows_stops_nothing(
    kube_cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    kubeconfig = cluster_release(kube_cluster).operator_kubeconfig
    log_path = tmp_path / "operator.log"
    with kube_cluster.api_client() as api, Kubelet(api, namespace) as kubelet:
        kube = KubeNamespace(api, namespace)
        tenant = client.CustomObjectsApi(tenant_api(kube_cluster, api, namespace))
        with operator_process(kubeconfig, namespace, log_path) as operator:
            kube.create(two_worlds("other"))
            kube.wait_running("other", epochs={"wa": 1, "wb": 1})

            deep = two_worlds("deep")
            deep["spec"]["template"]["junk"] = nested(DEPTH)
            # From here on every read of `other` brings its status back too.
            with deep_enough():
                tenant.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, deep)
                tenant.patch_namespaced_custom_object_status(
                    GROUP, VERSION, namespace, PLURAL, "other", {"status": {"junk": nested(DEPTH)}}
                )

                refused = wait_for("deep's SpecValid False", lambda: spec_valid(kube, "deep"))
                assert refused["status"] == "False", refused
                assert "spec.template.junk" in refused["message"], refused
                assert "nested more than 64 levels deep" in refused["message"], refused
                assert not kube.uids("deep"), "a pod was made for a spec that is refused"

                # `multiworld status` lists both (it reads what the tenant wrote too).
                shown = subprocess.run(
                    [sys.executable, "-m", "multiworld_operator.cli", "status", "-n", namespace],
                    capture_output=True, text=True, timeout=60, check=False,
                    env={**os.environ, "KUBECONFIG": str(kube_cluster.kubeconfig)},
                )  # fmt: skip
                assert shown.returncode == 0, shown.stderr[-3000:]
                assert [line.split()[0] for line in shown.stdout.splitlines()[1:]] == ["deep", "other"], shown.stdout

                kubelet.fail("other-a-0")
                kube.wait_running("other", epochs={"wa": 2, "wb": 1})
                assert operator.poll() is None, log_path.read_text(errors="replace")[-3000:]
            peak = peak_rss_mib(operator)
        log = log_path.read_text(errors="replace")
        assert "RecursionError" not in log, log[-3000:]
        assert not refusals(log), log[-3000:]
        assert peak < CHART_LIMIT_MIB / 2, (peak, log[-3000:])
