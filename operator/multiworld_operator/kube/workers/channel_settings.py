"""Where the operator serves the worker channel, from its environment (the chart sets both):

- MULTIWORLD_CHANNEL_PORT: the port it listens on, on every address (default 7443; 0 picks one).
- MULTIWORLD_CHANNEL_URL: what its pods are told to connect to (MULTIWORLD_TABLE), e.g.
  `operator://multiworld-operator.multiworld.svc:7443` (the chart's Service). Default: this
  machine's own address and the port listened on, for an operator run outside the cluster.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field

ENV_CHANNEL_PORT = "MULTIWORLD_CHANNEL_PORT"
ENV_CHANNEL_URL = "MULTIWORLD_CHANNEL_URL"
DEFAULT_PORT = 7443


class ChannelSettings(BaseModel):
    model_config = ConfigDict(frozen=True)

    port: int = Field(default=DEFAULT_PORT, ge=0, le=65535)
    url: str = Field(default="", pattern=r"^(operator://[^/:]+:\d+)?$")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> ChannelSettings:
        """ValueError naming the variable when one is malformed."""
        values: dict[str, str] = {}
        for field, variable in (("port", ENV_CHANNEL_PORT), ("url", ENV_CHANNEL_URL)):
            if environ.get(variable):
                values[field] = environ[variable]
        try:
            return cls.model_validate(values)
        except ValueError as error:
            raise ValueError(f"{ENV_CHANNEL_PORT} or {ENV_CHANNEL_URL}: {error}") from error

    def url_for(self, listened: int) -> str:
        return self.url or f"operator://{host_address()}:{listened}"


def host_address() -> str:
    """This machine's address on its default route (a UDP socket's connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.254", 9))
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"
