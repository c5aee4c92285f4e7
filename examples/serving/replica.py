"""A replica: answers the requests of its one world's router with the model, in order, until
the router says stop. When its world breaks, it goes on in the rebuilt world where the world
table rebuilds it; with worlds given on the command line it has nothing left and exits 1."""

from __future__ import annotations

import asyncio

import common
import wire
from model import TinyResNet, build_model, infer

from multiworld import World, WorldBrokenError


def answer_until_stopped(world: World, model: TinyResNet) -> None:
    """Serve requests in `world` until the router's stop. Blocking ops, on a thread of their
    own: a replica does one thing at a time, and a blocking op costs no hand-over between
    threads (a world that breaks ends the op it waits in)."""
    device = common.world_device(world)
    header = wire.empty_header(device)
    images = wire.empty_images(device)
    logits = wire.empty_logits(device)
    while True:
        world.recv(header, src=wire.ROUTER)
        if int(header[1]) == wire.STOP:
            break
        world.recv(images, src=wire.ROUTER)
        logits = infer(model, images)
        world.send(header, dst=wire.ROUTER)
        world.send(logits, dst=wire.ROUTER)
    world.send(header, dst=wire.ROUTER)  # the stop, acknowledged
    world.send(logits, dst=wire.ROUTER)


async def run_replica(source: common.WorldSource, seed: int) -> int:
    """The replica of the source's one world; returns the exit status."""
    (name,) = source.names()
    try:
        try:
            world: World | None = await source.first(name)
        except common.mw.MultiWorldError as exc:
            common.say(f"{name} failed to join: {exc}")
            return 1
        model = build_model(seed, common.world_device(world))
        while world is not None:
            common.say(f"replica of {name} serving at epoch {world.epoch}")
            try:
                await asyncio.to_thread(answer_until_stopped, world, model)
                await common.leave_together(world)
            except WorldBrokenError as exc:
                common.say(f"{name} broke: {exc.reason}")
                world = await source.after_break(name, exc.epoch)
                continue
            source.finished(name)
            common.say(f"replica of {name} stopped by the router")
            return 0
        if source.removed(name):
            common.say(f"{name} ended: removed from the world table")
            return 0
        return 1
    finally:
        source.close()
