"""The spec's caps: the upper bound of every number and duration in it, and the caps on its
size, each following from a limit of Linux, Kubernetes or the operator; and the worlds' store
ports, which a template may not declare. The models and the cross-field checks enforce them;
`channel_server` sizes its budgets by MAX_WORLDS_PER_POD, and both platforms take their store
ports from PORT_BASE and PORT_SPAN."""

from __future__ import annotations

# Upper bounds of every number and duration in the spec: beyond them a value means nothing
# useful, and they keep the planner's arithmetic on times and delays finite.
MAX_DURATION = "366d"
MAX_DURATION_LENGTH = 32
MAX_FACTOR = 100.0
MAX_RESTARTS = 10_000
MAX_SPARES = 64
# Caps that follow from measured limits, each at names of 63 characters (tests/spec/
# test_limits.py builds the largest spec they admit with the real code and holds every object
# written for it to its limit; `bench/scale.py --largest` reports the figures):
# - A pod's worlds: their assignments are one environment string of its container
#   (MULTIWORLD_WORLDS), which Linux caps at 128 KiB (MAX_ARG_STRLEN: past it the container
#   cannot start); its annotations (the operator's created-for stamp) and its worker's status
#   (one line of the worker channel) grow with them too, well within their limits. The
#   environment binds first; the cap keeps it well within its limit.
MAX_WORLDS_PER_POD = 200
# - Worlds and ranks: a MultiWorld's spec, metadata and status are one object, which etcd caps
#   at 1.5 MiB. The status at its largest (every world with a failure of MAX_FAILURE_MESSAGE
#   characters, every rank waiting with a reason of MAX_MESSAGE: planner/status.py) grows with
#   the worlds and with the ranks; it must fit beside a spec of MAX_SPEC_BYTES and 256 KiB of
#   annotations, with a fifth to spare.
MAX_WORLDS = 512
MAX_RANKS = 2048
# - Pods (replicas and warm spares of every member): one plan of the largest spec must take
#   under a second, and the operator planning it must stay within the chart's memory limit
#   (charts/multiworld-operator/values.yaml); the time of a first plan grows with pods times
#   ranks. As many as the ranks: every member pod is a rank, and warm spares fit in what is left.
MAX_PODS = MAX_RANKS
MAX_REPLICAS = MAX_PODS
MAX_MEMBERS = MAX_PODS
# - The spec as JSON: it shares the object with the status (above); and a client-side
#   `kubectl apply` keeps a copy of it in an annotation, which must fit in the 256 KiB.
MAX_SPEC_BYTES = 256 * 1024
# - A refusal lists at most MAX_PROBLEMS problems (then how many more), each cut to
#   MAX_PROBLEM_LENGTH characters: the condition SpecValid carries them in the status (Ready
#   too, for a spec that never was valid), which shares the object with the largest spec.
MAX_PROBLEMS = 32
MAX_PROBLEM_LENGTH = 320
# - How deeply the spec may nest (objects and lists, counted from the spec itself): a
#   PodTemplateSpec's deepest fields (an affinity term's match expression's values) are about
#   15 levels below a member's template. The API server stores JSON nested up to 10,000 levels
#   (kube/client/nesting.py), which every recursive reader of it (a JSON encoder, a deep copy)
#   would have to follow; the spec's checks walk it without recursion.
MAX_SPEC_DEPTH = 64

# The worlds' store ports (kube/objects/ports.py, local/store_ports.py): below the kernel's ephemeral
# ports (Linux: 32768+), so no socket gets one unasked (an outgoing connection, a listener on
# port 0) while rank 0 does not serve it. A template may not declare one: the NetworkPolicy
# opens declared ports to everyone, and these must stay open to the MultiWorld's own pods only.
PORT_BASE = 20000
PORT_SPAN = 10000
