"""Start a worker from its environment: the contract's env half plus the live-table channel.

A warm spare (MULTIWORLD_SPARE set to its member's name) runs its member's program ahead of
need: `init_from_env` loads torch's communicator code, says through the channel that the spare
waits, and blocks until the live table names its pod, so everything the program did before
(imports, model loading) is already paid when the platform gives it a member's identity. It
keeps its own pod name; the table lists that name at the ranks it takes and says which member
pod it plays (`WorldManager.plays`). Nothing times the wait out: the platform deletes spares it
no longer needs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from multiworld.channels import open_channel
from multiworld.contract import ENV_SPARE, WorkerEnv
from multiworld.detect.config import DetectConfig
from multiworld.manager import WorldManager

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def init_from_env(
    environ: Mapping[str, str] | None = None,
    *,
    config: DetectConfig | None = None,
    device: str | torch.device | None = None,
    wait: bool = True,
) -> WorldManager:
    """Read MULTIWORLD_POD / MULTIWORLD_WORLDS / MULTIWORLD_TABLE, serve the metrics where
    MULTIWORLD_METRICS_PORT says (if set), open the channel the table's scheme names, join the
    start-up worlds in parallel (waiting for them unless wait=False; a world that cannot form
    is logged and reported, not raised) and follow the live table. A spare (MULTIWORLD_SPARE)
    first blocks until the table gives it an identity, whatever `wait` says; the worlds that
    identity brings are joined like start-up worlds.

    A program in several worlds passes wait=False and takes each world up on its own, as soon
    as that world forms (a task or thread per world, each starting with `wait_world(name)`;
    `world_names()` lists them): waiting for every world first keeps this process out of the
    worlds that formed while another waits for a peer, and their ops wait on it until their
    op timeout."""
    environ = os.environ if environ is None else environ
    env = WorkerEnv.from_env(environ)
    config = config if config is not None else DetectConfig.from_env(environ)
    if env.spare:
        # Torch loads before the spare says it waits: a spare is worth its head start.
        import multiworld.world.core  # noqa: F401
    channel = open_channel(env.table, env.pod)
    manager = WorldManager(
        pod=env.pod,
        config=config,
        channel=channel,
        device=device,
        instance={a.name: a.epoch for a in env.worlds},
        spare=bool(env.spare),
        metrics_port=env.metrics_port,
    )
    if env.spare:
        log.info("pod %s waits for an identity (%s=%s)", env.pod, ENV_SPARE, env.spare)
        joins = manager.wait_for_identity()
    else:
        # The live table may reach the manager first and already carry newer epochs: an
        # environment assignment older than what it gave is left out, not raised.
        joins = manager.start_joins(env.worlds, newest_only=True)
    if wait:
        for join in joins:
            join.done.wait()
    return manager
