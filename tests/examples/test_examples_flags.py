"""The examples' flags: worlds from --worldinfo, and a clear error naming the flag otherwise."""

from __future__ import annotations

import pytest
from tests.support.examples_harness import load_common

common = load_common()


def assignments(argv: list[str]):
    parser = common.build_parser(None)
    return common.assignments_from_flags(parser.parse_args(argv), parser)


def test_worldinfo_gives_one_world_per_flag() -> None:
    worlds = assignments(
        ["--worldinfo", "1,0", "--worldinfo", "2,0", "--addr", "10.0.0.7", "--port", "30000", "--backend", "gloo"]
    )
    assert [(w.name, w.rank, w.size, w.host, w.port, w.epoch, w.backend) for w in worlds] == [
        ("world1", 0, 3, "10.0.0.7", 30001, 1, "gloo"),
        ("world2", 0, 3, "10.0.0.7", 30002, 1, "gloo"),
    ]


def test_worldsize_sets_the_size_of_every_world() -> None:
    (world,) = assignments(["--worldinfo", "3,1", "--worldsize", "2"])
    assert (world.name, world.rank, world.size) == ("world3", 1, 2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--worldinfo", "1"], "--worldinfo: expected WORLD,RANK"),
        (["--worldinfo", "a,b"], "--worldinfo: expected WORLD,RANK"),
        (["--worldinfo", "0,1"], "--worldinfo: the world index must be >= 1"),
        (["--worldinfo", "1,3"], "--worldinfo 1,3: rank must be below --worldsize 3"),
        (["--worldinfo", "1,0", "--worldinfo", "1,1"], "--worldinfo: a world index appears twice"),
        (["--worldinfo", "1,0", "--worldsize", "1"], "--worldsize: must be >= 2"),
        (["--worldinfo", "1,0", "--steps", "0"], "--steps: must be >= 1"),
        (["--worldinfo", "1,0", "--interval", "-1"], "--interval: must be >= 0"),
        (["--worldinfo", "1,0", "--port", "70000"], "--port: must be a TCP port"),
        (["--worldinfo", "9,0", "--port", "65530"], "--port 65530 + world index 9 is not a TCP port"),
        (["--worldinfo", "1,0", "--backend", "mpi"], "--backend: invalid choice"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        assignments(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_without_worldinfo_the_environment_must_name_the_worlds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("MULTIWORLD_POD", "MULTIWORLD_WORLDS", "MULTIWORLD_TABLE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exited:
        common.source_from_env(common.build_parser(None))
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "no --worldinfo given" in err and "MULTIWORLD_POD" in err


def test_example_tensors_are_small_integers_fixed_by_world_rank_and_step() -> None:
    cpu = common.torch.device("cpu")
    first = common.example_tensor("world1", 2, 5, cpu)
    assert first.tolist() == common.example_tensor("world1", 2, 5, cpu).tolist()
    assert first.shape == (common.TENSOR_LENGTH,)
    assert all(1 <= value <= 6 and value == int(value) for value in first.tolist())
    others = {
        tuple(common.example_tensor(w, r, s, cpu).tolist())
        for w, r, s in [("world2", 2, 5), ("world1", 1, 5), ("world1", 2, 6)]
    }
    assert tuple(first.tolist()) not in others
