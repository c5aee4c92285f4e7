"""The Kubernetes platform: MultiWorld custom resources become pods and a headless Service.

The planner decides everything; this package only observes (the MultiWorld, its pods and
their annotations) and executes (pod deletes and creates, the status subresource, Events).

- `bodies`: the pod and Service bodies, labels, annotations, rendezvous hosts (pure).
- `ports`: a rendezvous port per world, stable across spec edits (pure).
- `observe`: pods as the API returns them -> the planner's Observation parts (pure).
- `refusal`: the status an invalid spec gets (pure).
- `api`: the few API calls the operator makes, async, with timeouts.
- `reconcile`: one MultiWorld's reconcile step: observe, plan, execute, store status.
- `controller`: one reconcile loop per MultiWorld, woken by watch events.
- `handlers`: the kopf handlers (they only wake loops); `main.run_operator` runs kopf.
"""
