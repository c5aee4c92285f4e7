"""Each world's secret at each epoch (operator/multiworld_operator/world_secrets.py) and where
the contract puts it: pure, no processes. tests/local/test_store_secrets.py shows what it
keeps out of a running world's store."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError

from multiworld.contract import ENV_WORLDS, WorkerEnv, WorldAssignment, WorldEntry, WorldTable, store_prefix
from multiworld_operator.kube.workers.world_key import ENV_WORLD_KEY_SECRET, world_key
from multiworld_operator.planner import CreatePod
from multiworld_operator.world_secrets import KEY_BYTES, SECRET_HEX, WorldSecrets, new_key

KEY = bytes(range(KEY_BYTES))


def entry(name: str, epoch: int, pods: list[str]) -> WorldEntry:
    return WorldEntry(name=name, epoch=epoch, host="h", port=29500, pods=pods)


def test_one_epoch_of_one_world_has_one_secret_under_one_key() -> None:
    """A restarted operator, or another replica with the same key, hands the same secret; any
    other world, epoch, MultiWorld or key gets another."""
    secret = WorldSecrets(KEY, "ns/mw/uid").secret("w", 3)
    assert len(secret) == SECRET_HEX and int(secret, 16) >= 0
    assert WorldSecrets(bytes(KEY), "ns/mw/uid").secret("w", 3) == secret
    others = {
        WorldSecrets(KEY, "ns/mw/uid").secret("w", 4),
        WorldSecrets(KEY, "ns/mw/uid").secret("v", 3),
        WorldSecrets(KEY, "ns/mw/other-uid").secret("w", 3),
        WorldSecrets(new_key(), "ns/mw/uid").secret("w", 3),
    }
    assert secret not in others and len(others) == 4
    with pytest.raises(ValueError, match="at least"):
        WorldSecrets(b"short", "ns/mw/uid")


def test_a_pods_env_and_its_table_agree_on_every_secret() -> None:
    """The start-up assignments of a pod made for an epoch equal what the table of that epoch
    gives it (a worker compares them: a differing secret would be a changed world)."""
    secrets = WorldSecrets(KEY, "mw")
    table = secrets.table(WorldTable(revision=4, worlds=[entry("a", 2, ["p0", "p1"]), entry("b", 1, ["p1", "p2"])]))
    assert [w.secret for w in table.worlds] == [secrets.secret("a", 2), secrets.secret("b", 1)]
    planned = WorldTable(revision=4, worlds=[entry("a", 2, ["p0", "p1"]), entry("b", 1, ["p1", "p2"])])
    create = CreatePod(
        pod="p1",
        member="m",
        ordinal=1,
        created_for={"a": 2, "b": 1},
        worlds=list(planned.assignments_for("p1").values()),
        template={},
    )
    env = secrets.create(create).worker_env("local://127.0.0.1:1").to_env()
    from_env = {a.name: a for a in WorkerEnv.from_env(env).worlds}
    assert from_env == table.assignments_for("p1")
    assert all(a.secret for a in from_env.values())


def test_the_secret_is_in_every_key_prefix_and_nowhere_else() -> None:
    secret = "0123456789abcdef" * 2
    a = WorldAssignment(name="w", rank=0, size=2, host="h", port=1, epoch=3, secret=secret)
    assert a.store_prefix == store_prefix("w", 3, secret) == f"w/3/{secret}/"
    assert secret not in repr(a)  # logs name worlds by their repr
    # No secret (pymultiworld's initialize_world, a hand-made env): the keys as they were.
    assert WorldAssignment(name="w", rank=0, size=2, host="h", port=1, epoch=3).store_prefix == "w/3/"


def test_an_env_without_secrets_reads_and_writes_as_before() -> None:
    plain = WorkerEnv(pod="p", worlds=[WorldAssignment(name="w", rank=0, size=2, host="h", port=1)])
    assert "secret" not in json.loads(plain.to_env()[ENV_WORLDS])[0]
    assert WorkerEnv.from_env(plain.to_env()) == plain


@pytest.mark.parametrize("secret", ["short", "0123456789ABCDEF" * 2, "0123456789abcdef/" * 2, "g" * 32])
def test_a_secret_is_hex_digits_and_long_enough(secret: str) -> None:
    with pytest.raises(ValidationError):
        WorldAssignment(name="w", rank=0, size=2, host="h", port=1, secret=secret)


def test_an_operator_without_a_world_key_secret_named_has_a_key_of_its_own() -> None:
    """(tests/kube/test_world_key.py: the Secret every replica reads.)"""
    first, second = asyncio.run(world_key({})), asyncio.run(world_key({}))
    assert len(first) == KEY_BYTES and first != second
    with pytest.raises(ValueError, match="POD_NAMESPACE"):
        asyncio.run(world_key({ENV_WORLD_KEY_SECRET: "named"}))
