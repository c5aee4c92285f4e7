"""The admission webhook with the real kubectl: the chart installed with real Helm, `multiworld
operator` started with its Deployment's args and only its ServiceAccount's token (it makes its
certificate and writes its CA into the chart's webhook configuration), the configuration
pointed at this host (tests/support/webhook_support.py). An invalid spec is refused at `kubectl apply` with
every mistake named as `multiworld run` names it; a valid one is admitted; with the operator
down, failurePolicy decides: Ignore admits (and the operator, back, marks the object
SpecValid=False), Fail refuses."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import helm_python as helm
import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from multiworld_operator import cli
from multiworld_operator.kube import main as operator_main
from multiworld_operator.kube.admission.webhook import Webhook
from multiworld_operator.kube.workers.channel_settings import ENV_CHANNEL_PORT
from multiworld_operator.spec.limits import MAX_SPEC_DEPTH
from tests.cluster import cluster as cluster_module
from tests.cluster.cluster import Cluster
from tests.support.operator_support import (
    CHART_DIR,
    GROUP,
    HELM_TIMEOUT_S,
    PLURAL,
    VERSION,
    WAIT_S,
    refusals,
    stop_operator,
    two_worlds,
)
from tests.support.tenant import deep_enough, nested
from tests.support.webhook_support import ca_bundle, serve_from_this_host, wait_listening

pytestmark = pytest.mark.kube

WEBHOOK = "spec.multiworld.io"
# A spec and a status that leave the object within the API server's limit (1.5 MiB), with
# kubectl's copy of the spec in an annotation (at most 256 KiB in all).
SPEC_PADDING_BYTES = 120_000
STATUS_JUNK_BYTES = 1_000_000


def four_mistakes() -> dict[str, Any]:
    """A MultiWorld the CRD's schema admits, with four mistakes only the spec's validation sees."""
    manifest = two_worlds("9-lives")  # metadata.name: a Service name must start with a letter
    spec = manifest["spec"]
    spec["members"].append({"name": "a", "replicas": 1})  # spec.members[3].name: declared twice
    spec["worlds"][0]["ranks"].append("ghost")  # spec.worlds[0].ranks[2]: not declared
    spec["worlds"][1]["name"] = spec["worlds"][0]["name"]  # spec.worlds[1].name: declared twice
    return manifest


FOUR_FIELDS = ["metadata.name", "spec.members[3].name", "spec.worlds[0].ranks[2]", "spec.worlds[1].name"]


@dataclass
class Release:
    """The chart installed, watching `namespace`, its webhook pointed at this host."""

    cluster: Cluster
    api: client.ApiClient
    namespace: str
    fullname: str
    folder: Path

    @contextmanager
    def operator(self) -> Iterator[None]:
        """`multiworld operator` as the Deployment starts it, as the chart's ServiceAccount; up
        once its webhook listens. On exit: stopped, and none of its requests was refused."""
        read = client.AppsV1Api(self.api).read_namespaced_deployment(self.fullname, self.namespace)
        (container,) = self.api.sanitize_for_serialization(read)["spec"]["template"]["spec"]["containers"]
        kubeconfig = self.cluster.serviceaccount_kubeconfig(self.namespace, self.fullname)
        plain = {e["name"]: e["value"] for e in container["env"] if "value" in e}  # the downward API's: none here
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), **plain, ENV_CHANNEL_PORT: "0"}
        env["POD_NAMESPACE"] = self.namespace  # the release's, where the world key's Secret is (world_key.py)
        entrypoint = [str(Path(sys.executable).parent / "multiworld"), "operator"]
        log_path = self.folder / f"operator-{uuid.uuid4().hex[:6]}.log"
        port = int(container["args"][container["args"].index("--webhook-port") + 1])
        with open(log_path, "wb") as log_file:
            command = [*entrypoint, *container["args"]]
            process = subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            wait_listening(port)
            assert ca_bundle(self.api, self.fullname)
            yield
        finally:
            stop_operator(process)
        log = log_path.read_text(errors="replace")
        assert not refusals(log), log[-3000:]

    def apply(self, manifest: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        """`kubectl apply -f` of the manifest, as a user types it."""
        path = self.folder / f"{manifest['metadata']['name']}-{uuid.uuid4().hex[:6]}.yaml"
        path.write_text(yaml.safe_dump(manifest))
        return self.kubectl("apply", "-f", str(path))

    def kubectl(self, *args: str) -> subprocess.CompletedProcess[str]:
        """The real kubectl as the admin, in the release's namespace."""
        binary = cluster_module.find_node_binaries().kubectl
        command = [str(binary), f"--kubeconfig={self.cluster.kubeconfig}", "-n", self.namespace, *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)

    def get(self, name: str) -> dict[str, Any] | None:
        try:
            found = client.CustomObjectsApi(self.api).get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, name
            )
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        return cast("dict[str, Any]", found)  # the custom objects API returns the object as JSON


@contextmanager
def release(kube_cluster: Cluster, namespace: str, failure_policy: str, folder: Path) -> Iterator[Release]:
    name = f"mw-{uuid.uuid4().hex[:6]}"
    webhook_port = cluster_module.free_port()
    values: dict[str, Any] = {
        "watchNamespaces": [namespace],
        "healthPort": cluster_module.free_port(),
        "webhook": {"failurePolicy": failure_policy, "port": webhook_port},
    }
    with (
        kube_cluster.api_client() as api,
        helm.Config(kubeconfig_path=str(kube_cluster.kubeconfig), namespace=namespace) as config,
    ):
        installed = config.install(CHART_DIR, name, values, timeout=HELM_TIMEOUT_S)
        assert installed["status"] == "deployed", installed
        fullname = f"{name}-multiworld-operator"
        try:
            serve_from_this_host(api, fullname, webhook_port, [namespace])
            yield Release(kube_cluster, api, namespace, fullname, folder)
        finally:
            config.uninstall(name, timeout=HELM_TIMEOUT_S)


def run_problems(manifest_path: Path) -> list[str]:
    """The problems `multiworld run` names for the manifest (one per line, indented)."""
    run = subprocess.run(
        [str(Path(sys.executable).parent / "multiworld"), "run", str(manifest_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 2, run.stderr
    return [line.strip() for line in run.stderr.splitlines() if line.startswith("  ")]


def test_apply_of_four_mistakes_is_refused_naming_each_as_multiworld_run_does(
    kube_cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    manifest = four_mistakes()
    path = tmp_path / "four-mistakes.yaml"
    path.write_text(yaml.safe_dump(manifest))
    problems = run_problems(path)
    assert [p.split(":")[0] for p in problems] == FOUR_FIELDS, problems
    with release(kube_cluster, namespace, "Fail", tmp_path) as mw, mw.operator():
        refused = mw.apply(manifest)
        assert refused.returncode != 0, refused.stdout
        assert f'admission webhook "{WEBHOOK}" denied the request: invalid spec: ' in refused.stderr
        for problem in problems:
            assert problem in refused.stderr
        assert mw.get(manifest["metadata"]["name"]) is None


def test_apply_of_a_valid_spec_is_admitted_and_an_edit_with_a_mistake_refused(
    kube_cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    manifest = two_worlds("good")
    with release(kube_cluster, namespace, "Fail", tmp_path) as mw, mw.operator():
        admitted = mw.apply(manifest)
        assert admitted.returncode == 0, admitted.stderr
        assert "created" in admitted.stdout
        assert mw.get("good") is not None
        manifest["spec"]["worlds"][1]["ranks"].append("ghost")
        refused = mw.apply(manifest)
        assert refused.returncode != 0, refused.stdout
        assert "spec.worlds[1].ranks[2]: member 'ghost' is not declared" in refused.stderr
        stored = mw.get("good")
        assert stored is not None and "ghost" not in stored["spec"]["worlds"][1]["ranks"]


def test_a_spec_nested_as_deep_as_the_api_server_allows_is_refused_naming_its_field(
    kube_cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """The webhook reads an AdmissionReview nested 9,900 deep (past Python's default recursion
    limit) and refuses it by the spec's nesting cap, naming the field; the operator goes on."""
    manifest = two_worlds("deep")
    manifest["spec"]["template"]["junk"] = nested(9_900)
    with release(kube_cluster, namespace, "Fail", tmp_path) as mw, mw.operator(), deep_enough():
        custom = client.CustomObjectsApi(mw.api)
        with pytest.raises(ApiException) as refused:
            custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest)
        assert refused.value.status == 422, refused.value.body
        assert "spec.template.junk" in str(refused.value.body), refused.value.body
        assert f"nested more than {MAX_SPEC_DEPTH} levels deep" in str(refused.value.body), refused.value.body
        assert mw.get("deep") is None
        admitted = mw.apply(two_worlds("after"))
        assert admitted.returncode == 0, admitted.stderr


def test_with_the_operator_down_ignore_admits_and_spec_valid_names_the_mistakes(
    kube_cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    manifest = four_mistakes()
    name = manifest["metadata"]["name"]
    with release(kube_cluster, namespace, "Ignore", tmp_path) as mw:
        with mw.operator():
            pass
        admitted = mw.apply(manifest)  # nothing listens: the API server cannot call the webhook
        assert admitted.returncode == 0, admitted.stderr
        with mw.operator():
            # Back, the operator marks it: the same problems, in the status.
            condition = cluster_module.wait_for(
                "SpecValid=False",
                lambda: next(
                    (
                        c
                        for c in ((mw.get(name) or {}).get("status") or {}).get("conditions") or []
                        if c["type"] == "SpecValid" and c["status"] == "False"
                    ),
                    None,
                ),
                WAIT_S,
            )
            for field in FOUR_FIELDS:
                assert f"{field}:" in condition["message"]
            # An update that leaves the spec as it was is admitted: the object stays editable.
            labelled = mw.kubectl("label", "mw", name, "a=b")
            assert labelled.returncode == 0, labelled.stderr


def test_with_the_operator_down_fail_refuses(kube_cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    with release(kube_cluster, namespace, "Fail", tmp_path) as mw:
        with mw.operator():
            pass
        refused = mw.apply(two_worlds("good"))
        assert refused.returncode != 0, refused.stdout
        assert f'failed calling webhook "{WEBHOOK}"' in refused.stderr
        assert mw.get("good") is None


def test_operator_flags_serve_the_webhook_only_when_given(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    started: list[tuple[Webhook | None, int | None, bool]] = []

    def run_operator(
        namespaces: list[str],
        liveness: object = None,
        webhook: Webhook | None = None,
        lease: object = None,
        metrics_port: int | None = None,
        metrics_secure: bool = True,
    ) -> int:
        started.append((webhook, metrics_port, metrics_secure))
        return 0

    monkeypatch.setattr(operator_main, "run_operator", run_operator)
    assert cli.main(["operator"]) == 0
    flags = ["--webhook-port", "9443", "--webhook-host", "w.ns.svc", "--webhook-configuration", "mw"]
    assert cli.main(["operator", *flags, "--metrics-port", "8000"]) == 0
    assert cli.main(["operator", "--metrics-port", "8000", "--no-metrics-secure"]) == 0
    assert started == [(None, None, True), (Webhook(9443, "w.ns.svc", "mw"), 8000, True), (None, 8000, False)]
    with pytest.raises(SystemExit) as refused:
        cli.main(["operator", "--webhook-port", "9443"])
    assert refused.value.code == 2
    assert "--webhook-port needs --webhook-host and --webhook-configuration" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        cli.main(["operator", "--metrics-port", "0"])
    assert refused.value.code == 2
    assert "--metrics-port: must be a port between 1 and 65535, got 0" in capsys.readouterr().err


def test_an_update_of_a_multiworld_as_large_as_the_api_server_stores_is_admitted(
    kube_cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """The API server sends an update's review with the object twice (as it is and as it was):
    a MultiWorld of a large spec whose status fills the object's room (anyone with `update` on
    multiworlds/status may write it; the largest accepted spec's own status is 745 KiB) makes
    a review of about 2.5 MiB. A label on it is admitted (the spec unchanged), and so is an
    edit of its spec."""
    manifest = two_worlds("large")
    manifest["spec"]["template"]["metadata"] = {"annotations": {"padding": "x" * SPEC_PADDING_BYTES}}
    with release(kube_cluster, namespace, "Fail", tmp_path) as mw, mw.operator():
        admitted = mw.apply(manifest)
        assert admitted.returncode == 0, admitted.stderr
        custom = client.CustomObjectsApi(mw.api)
        junk = {"junk": "y" * STATUS_JUNK_BYTES}
        custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, "large", {"status": junk})
        labelled = mw.kubectl("label", "mw", "large", "a=b")
        assert labelled.returncode == 0, labelled.stderr
        manifest["spec"]["worlds"][1]["failurePolicy"] = {"maxRestarts": 3}
        edited = mw.apply(manifest)
        assert edited.returncode == 0, edited.stderr
