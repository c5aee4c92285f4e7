"""The operator's lines carry the MultiWorld they are about, bound once per reconcile loop and
per worker message, and the world where a line is about one (issue 35 item 7)."""

from __future__ import annotations

import asyncio

import pytest

from multiworld_operator.log_context import FORMAT, ContextFilter, about, multiworld_bound
from tests.support.log_capture import captured

pytestmark = pytest.mark.quick


def test_each_loop_names_its_own_multiworld_in_its_tasks_and_threads() -> None:
    capture = captured(f"{__name__}.operator", FORMAT.replace("%(asctime)s ", ""), ContextFilter())
    logger = capture.logger

    async def loop(name: str) -> None:
        with multiworld_bound("team", name):
            await asyncio.sleep(0)  # the two loops interleave
            logger.info("step of %s", name)
            await asyncio.create_task(asyncio.to_thread(logger.info, "a call in a thread"))
            logger.warning("world broken", extra=about("w1", 2))

    async def both() -> None:
        await asyncio.gather(loop("a"), loop("b"))
        logger.info("outside any loop")

    asyncio.run(both())
    lines = capture.lines()
    name = logger.name
    assert sorted(lines[:-1]) == sorted(
        [
            f"INFO {name}: step of a [multiworld=team/a]",
            f"INFO {name}: a call in a thread [multiworld=team/a]",
            f"WARNING {name}: world broken [multiworld=team/a world=w1 epoch=2]",
            f"INFO {name}: step of b [multiworld=team/b]",
            f"INFO {name}: a call in a thread [multiworld=team/b]",
            f"WARNING {name}: world broken [multiworld=team/b world=w1 epoch=2]",
        ]
    )
    assert lines[-1] == f"INFO {name}: outside any loop"
