"""The Kubernetes platform: MultiWorld custom resources become pods, a headless Service and a
NetworkPolicy; the world table goes to the workers over the worker channel.

The planner decides everything; this package only observes (the MultiWorld, its pods, what
their workers said over the channel) and executes (pod deletes and creates, the table, the
status subresource, Events).

The loop, here: `handlers` (the kopf handlers; they only wake loops), `main` (`run_operator`
runs kopf), `leadership` (leader election on a Lease: which replica acts, and the leader label on
its pod), `controller` (one reconcile loop per MultiWorld, woken by watch events, while this
replica leads) and `reconcile` (one MultiWorld's step: observe, plan, execute, store).

What a step uses, a package each (each `__init__` says what its modules do):
- `client/`: the API calls, with timeouts, and what they share.
- `objects/`: the pod, Service and NetworkPolicy bodies; pods as observed and cached.
- `memory/`: the planner's memory across operator restarts, in a ConfigMap.
- `reporting/`: the status subresource, Events, and what a refused spec or a failed step shows.
- `workers/`: the worker channel's side here: identity, what workers said, lost hosts, the worlds' key.
- `metrics/`: the Prometheus metrics, their server and who may read them.
- `admission/`: the validating admission webhook, its TLS and its certificate.
"""
