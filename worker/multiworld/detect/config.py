"""The settings of failure detection (`DetectConfig`), and the layers they tune (no torch):

1. Op errors: a failed op breaks its world at once (see world/core.py).
2. Heartbeats per pair of processes, not per world (detector.py): rank 0 of a world (its store
   host) judges the other members' processes, and they judge it, through a small store the
   host's detector serves. A process whose counter stops moving for `dead_after` is dead in
   every world of that host it is in (measured on the judge's own clock, which does not count
   the judge's own pauses, and confirmed by a second read: silence.py).
3. The abort key: the first member to reach a verdict writes it to the world's store and to
   its host's beat store, where the others read it on their next tick, so one verdict reaches
   every member within a tick.
4. A stall watch: a store call to a frozen store host never returns (TCPStore clients have no
   timeout for that), so the detector's own thread, which does no remote I/O, notices a link
   stuck in a call for `dead_after` and breaks the worlds of that host.
5. The communicator's own op timeout (`op_timeout`) as the last backstop.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

ENV_HEARTBEAT_INTERVAL = "MULTIWORLD_HEARTBEAT_INTERVAL"
ENV_DEAD_AFTER = "MULTIWORLD_DEAD_AFTER"
ENV_OP_TIMEOUT = "MULTIWORLD_OP_TIMEOUT"
ENV_JOIN_TIMEOUT = "MULTIWORLD_JOIN_TIMEOUT"

_ENV_FIELDS = {
    ENV_HEARTBEAT_INTERVAL: "heartbeat_interval",
    ENV_DEAD_AFTER: "dead_after",
    ENV_OP_TIMEOUT: "op_timeout",
    ENV_JOIN_TIMEOUT: "join_timeout",
}


class DetectConfig(BaseModel):
    """Detection and timeout settings, in seconds. Defaults: a crashed peer of a busy world is
    seen through the op error (tens of ms); an idle, crashed or frozen peer (or a node that
    lost its power or its network) after `dead_after` of silence and at most a tick more: in
    0.4 to 0.5 s (bench/failover.py). docs/figures.md gives what the default and others did
    here, with the cores saturated by other processes and without; docs/library.md says when
    to set it larger."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Time between heartbeat ticks; also how long a caller blocked in a broken world's op
    # stays blocked after the verdict, so that live peers read the verdict first.
    heartbeat_interval: float = Field(default=0.1, gt=0)
    # A peer whose heartbeat has not moved for this long is dead; a store call stuck this long
    # means the store host is gone (measured on the judge's own clock: silence.py).
    dead_after: float = Field(default=0.4, gt=0)
    # The communicator's own per-op timeout: a backstop for what the heartbeat cannot see.
    op_timeout: float = Field(default=120.0, gt=0)
    # How long a rendezvous waits for all members.
    join_timeout: float = Field(default=300.0, gt=0)
    # False: worlds joined with this config run no heartbeat (nor stall watch); an idle peer's
    # death is then seen only through op errors and `op_timeout`.
    heartbeat: bool = True

    @model_validator(mode="after")
    def _dead_after_spans_ticks(self) -> DetectConfig:
        if self.dead_after <= 2 * self.heartbeat_interval:
            raise ValueError(
                f"dead_after ({self.dead_after}s) must be more than twice heartbeat_interval "
                f"({self.heartbeat_interval}s), or a single late tick would kill a healthy peer"
            )
        return self

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> DetectConfig:
        """Defaults, overridden by MULTIWORLD_HEARTBEAT_INTERVAL, MULTIWORLD_DEAD_AFTER,
        MULTIWORLD_OP_TIMEOUT and MULTIWORLD_JOIN_TIMEOUT where set."""
        environ = os.environ if environ is None else environ
        values: dict[str, float] = {}
        for env_name, field in _ENV_FIELDS.items():
            raw = environ.get(env_name, "").strip()
            if not raw:
                continue
            try:
                values[field] = float(raw)
            except ValueError:
                raise ValueError(f"{env_name}={raw!r} is not a number of seconds") from None
        try:
            return cls(**values)
        except ValidationError as exc:
            names = {field: env for env, field in _ENV_FIELDS.items()}
            fields = [names.get(str(err["loc"][0]), "") for err in exc.errors() if err["loc"]]
            hint = f" (from {', '.join(f for f in fields if f)})" if any(fields) else ""
            raise ValueError(f"invalid detection settings{hint}: {exc}") from None
