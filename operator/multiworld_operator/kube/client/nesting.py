"""How deeply nested an object the API server may hand the operator, and the interpreter made
able to parse it.

The API server stores JSON nested up to API_MAX_DEPTH levels (deeper is refused: "exceeded max
depth"), and a MultiWorld's templates and status keep unknown fields, so a tenant may store one
that deep. Python's JSON parser counts each level against the interpreter's recursion limit
(1000 by default): one such MultiWorld made kopf's watch of every MultiWorld fail as it listed
them, and the operator exit, at every restart. The spec refuses nesting past MAX_SPEC_DEPTH
(spec/limits.py), so no template that deep is ever used; this only lets it be read.
"""

from __future__ import annotations

import sys
import threading

API_MAX_DEPTH = 10_000
# What a level may cost: one for the JSON parser or encoder, two for copy.deepcopy (a call and
# its list or dict copier); plus what the process's own calls use around them.
_RECURSION_PER_LEVEL = 3
_RECURSION_BASE = 2_000
# The C stack those levels take (about 0.2 KiB each: 2 MiB is enough, measured), with room;
# reserved, not resident, until used. Threads started from here on get it.
THREAD_STACK_BYTES = 16 * 1024 * 1024


def allow_api_depth() -> None:
    """Let this process parse, copy and encode anything the API server may send. Call it before
    the threads that will read are started (the event loop's executor makes its threads
    lazily); the main thread's stack is the process's stack limit (8 MiB by default)."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), _RECURSION_BASE + _RECURSION_PER_LEVEL * API_MAX_DEPTH))
    threading.stack_size(THREAD_STACK_BYTES)
