"""Start a worker from its environment: the contract's env half plus the live-table channel."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from multiworld.channels import open_channel
from multiworld.contract import WorkerEnv
from multiworld.detect import DetectConfig
from multiworld.manager import WorldManager

if TYPE_CHECKING:
    import torch


def init_from_env(
    environ: Mapping[str, str] | None = None,
    *,
    config: DetectConfig | None = None,
    device: str | torch.device | None = None,
    wait: bool = True,
) -> WorldManager:
    """Read MULTIWORLD_POD / MULTIWORLD_WORLDS / MULTIWORLD_TABLE, open the channel its scheme
    names, join the start-up worlds in parallel (waiting for them unless wait=False; a world
    that cannot form is logged and reported, not raised) and follow the live table."""
    environ = os.environ if environ is None else environ
    env = WorkerEnv.from_env(environ)
    config = config if config is not None else DetectConfig.from_env(environ)
    channel = open_channel(env.table, env.pod)
    manager = WorldManager(pod=env.pod, config=config, channel=channel, device=device,
                           instance={a.name: a.epoch for a in env.worlds})
    # The live table may reach the manager first and already carry newer epochs: an environment
    # assignment older than what it gave is left out, not raised.
    joins = manager._start_joins(env.worlds, newest_only=True)
    if wait:
        for join in joins:
            join.done.wait()
    return manager
