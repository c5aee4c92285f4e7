"""The Kubernetes platform: MultiWorld custom resources become pods, a headless Service and a
NetworkPolicy; the world table goes to the workers over the worker channel.

The planner decides everything; this package only observes (the MultiWorld, its pods, what
their workers said over the channel) and executes (pod deletes and creates, the table, the
status subresource, Events).

- `bodies`: the pod, Service and NetworkPolicy bodies, labels, annotations, rendezvous hosts (pure).
- `ports`: a rendezvous port per world, stable across spec edits (pure).
- `observe`: pods as the API returns them -> the planner's Observation parts (pure).
- `pod_cache`: a MultiWorld's pods as last seen, kept current by the watch and our own writes (pure).
- `planner_memory`: the planner's whole status, kept in a ConfigMap across operator restarts (pure).
- `refusal`: the status an invalid spec or a failed step gets (pure).
- `errors`: what a step fails with, how a failure reads, and names taken by objects not ours (pure).
- `api_basics`: the request timeout, merge patches, Event bodies, the retry backoff and the API's
  error text (no kubernetes import).
- `api`: the few API calls the operator makes, async, with timeouts, and `gather_bounded`, which
  keeps a step's requests in flight a few at a time.
- `configmap_writer`: the memory's ConfigMap written at the resourceVersion last seen.
- `memory_store`: the planner's memory read once and stored whenever it changed.
- `networking`: the headless Service and the NetworkPolicy made to exist as the spec wants, and
  made so again when the watch shows them changed.
- `channel_settings`: where the worker channel listens and what pods are told (from the env).
- `world_key`: the key every world's secret derives from (`..world_secrets`), one for every
  replica and across restarts, in a Secret the chart makes empty and the first replica fills.
- `worker_identity`: which pod a worker channel connection speaks for (its token, a TokenReview).
- `worker_inbox`: what one MultiWorld's workers said: their status, and the reports that count (pure).
- `lost_hosts`: the pod instances lost with their hosts (their worker's channel went unanswered):
  ended for the planner, their nodes kept out of new pods a while (pure).
- `status_writer`: the status subresource: the planner's view, a refusal, a failed step.
- `events`: the Events on a MultiWorld, best effort, a recurring refusal posted once.
- `metrics`: the Prometheus metrics (`--metrics-port`): the statuses read at scrape time, and
  what steps count (failures, recoveries, step durations, API errors); `metrics_server` serves
  them (a loop of its own, bounded connections, a render a second), over TLS to the tokens
  `metrics_access` allows (a TokenReview and a SubjectAccessReview, the answers kept a while).
- `reconcile`: one MultiWorld's reconcile step: observe, plan, execute, store.
- `controller`: one reconcile loop per MultiWorld, woken by watch events, while this replica leads.
- `leadership`: leader election on a Lease: which replica acts, and the leader label on its pod.
- `handlers`: the kopf handlers (they only wake loops); `main.run_operator` runs kopf.
- `admission`: the validating admission webhook (an invalid spec refused at `kubectl apply`,
  named as SpecValid names it), registered when the operator serves a webhook port;
  `webhook_tls`: its server, the certificate it serves and the caBundle it keeps; `webhook_secret`:
  that certificate, one for every replica, in a Secret the first replica makes, renewed by any;
  `raced_secret`: the calls on such a Secret, in which a replica that loses a race is told so.
- `status_command`: `multiworld status`, a MultiWorld as a user reads it from the kubeconfig
  (a command of the CLI, not part of the operator).
"""
