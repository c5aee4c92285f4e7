"""docs/library.md against the code: `dir(multiworld)` is `__all__`; every public name and every
public member of WorldManager, World and Work is in the reference, with a docstring and the
arguments the code has; nothing the page names is missing or called the wrong way; and the
page's complete program runs as written (real processes, gloo over loopback)."""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import multiworld as mw
from multiworld.contract import WorldAssignment
from tests.support.worker_support import free_ports

REPO = Path(__file__).resolve().parents[2]
LIBRARY_MD = REPO / "docs" / "library.md"
README = REPO / "README.md"
# How the page names what it documents: `mw.X` for the module, then an instance of each class.
PREFIXES: dict[str, Any] = {"mw": mw, "mgr": mw.WorldManager, "world": mw.World, "work": mw.Work}
FAST = mw.DetectConfig(heartbeat_interval=0.05, dead_after=1.5, join_timeout=30, op_timeout=30)
PROGRAM_WAIT_S = 90.0


def section(text: str, heading: str) -> str:
    """The text under `heading` (a line of its own) up to the next heading of its level or above."""
    level = heading.split(" ", 1)[0]
    start = text.index(f"\n{heading}\n") + len(heading) + 2
    ends = [m.start() for m in re.finditer(r"\n(#+) ", text[start:]) if len(m.group(1)) <= len(level)]
    return text[start : start + ends[0]] if ends else text[start:]


def without_code_blocks(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.DOTALL)


def code_spans(text: str) -> list[str]:
    """The inline code spans of `text` (one may run over a line break), fenced blocks left out."""
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", without_code_blocks(text))]


REFERENCE = section(LIBRARY_MD.read_text(), "## Reference")
# `mgr.join(assignment, *, config=None, device=None) -> World`: a documented signature.
SIGNATURE = re.compile(r"^(?P<prefix>\w+)\.(?P<name>\w+)\((?P<args>[^()]*)\)(?: -> .+)?$")


@pytest.fixture(scope="module")
def instances() -> Iterator[dict[str, Any]]:
    """A real manager, world and work: what a program holds (the pair of worlds in this process)."""
    (port,) = free_ports(1)
    managers = [mw.WorldManager(pod=f"p{rank}", config=FAST) for rank in (0, 1)]
    assignments = [WorldAssignment(name="w", rank=rank, size=2, host="127.0.0.1", port=port) for rank in (0, 1)]

    async def join_both() -> list[mw.World]:
        return await asyncio.gather(*(m.join_async(a) for m, a in zip(managers, assignments, strict=True)))

    worlds = asyncio.run(join_both())
    works = [world.barrier(async_op=True) for world in worlds]
    assert all(work is not None and work.wait(30) for work in works)
    yield {"mw": mw, "mgr": managers[0], "world": worlds[0], "work": works[0]}
    for manager in managers:
        manager.close()


def member(instances: dict[str, Any], prefix: str, name: str) -> Any:
    """What `prefix.name` is, looked up without running it (a property is not called; the
    module's lazy names are looked up)."""
    try:
        if prefix == "mw":
            return getattr(mw, name)
        return inspect.getattr_static(instances[prefix], name)
    except AttributeError:
        pytest.fail(f"docs/library.md names `{prefix}.{name}`, which does not exist")


def is_method(value: Any) -> bool:
    return inspect.isfunction(value) or inspect.isclass(value) or isinstance(value, (classmethod, staticmethod))


def test_dir_lists_the_public_names_and_loads_nothing() -> None:
    probe = (
        "import sys, multiworld\n"
        "names = dir(multiworld)\n"
        "print(names == sorted(multiworld.__all__), 'init_from_env' in names, "
        "sorted({'Any', 'TYPE_CHECKING', 'logging', 'importlib'} & set(names)), "
        "'multiworld.manager' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True", "[]", "False"], out


def test_every_public_name_is_in_the_reference_with_a_docstring() -> None:
    entries = {m.group(1) for m in re.finditer(r"^- `mw\.(\w+)", REFERENCE, flags=re.MULTILINE)}
    documented = {name for name in mw.__all__ if f"`mw.{name}" in REFERENCE}
    assert set(mw.__all__) - documented == set(), "names in __all__ missing from docs/library.md's reference"
    assert entries - set(mw.__all__) == set(), "reference entries that are not public names"
    for name in mw.__all__:
        value = getattr(mw, name)
        assert inspect.getdoc(value) and value.__doc__, f"mw.{name} has no docstring"


@pytest.mark.parametrize("prefix", ["mgr", "world", "work"])
def test_every_public_member_is_in_the_reference_with_a_docstring(instances: dict[str, Any], prefix: str) -> None:
    obj = instances[prefix]
    attributes = set(vars(obj)) if hasattr(obj, "__dict__") else set()
    public = {name for name in set(dir(type(obj))) | attributes if not name.startswith("_")}
    mentioned = {m.group(1) for m in re.finditer(rf"\b{prefix}\.(\w+)", " ".join(code_spans(REFERENCE)))}
    assert public - mentioned == set(), f"public members of {type(obj).__name__} missing from the reference"
    for name in public - attributes:
        value = inspect.getattr_static(obj, name)
        if is_method(value) or isinstance(value, property):
            assert inspect.getdoc(getattr(type(obj), name)), f"{prefix}.{name} has no docstring"


def test_what_the_pages_name_exists_and_is_called_only_if_callable(instances: dict[str, Any]) -> None:
    """`mgr.plays` is a property: a page that wrote `mgr.plays()` would crash the program that
    follows it. Code blocks included."""
    for page in (LIBRARY_MD, README):
        for prefix, name, call in re.findall(r"\b(mw|mgr|world|work)\.(\w+)(\(?)", page.read_text()):
            value = member(instances, prefix, name)
            if call:
                assert is_method(value), f"{page.name} calls `{prefix}.{name}(...)`, which is not callable"


def documented_signatures() -> list[tuple[str, str, str]]:
    found = []
    for span in code_spans(REFERENCE):
        match = SIGNATURE.match(span)
        if match and match["prefix"] in PREFIXES:
            found.append((match["prefix"], match["name"], match["args"]))
    return found


def test_the_reference_writes_every_signature_as_the_code_has_it(instances: dict[str, Any]) -> None:
    signatures = documented_signatures()
    assert len(signatures) > 40, signatures  # the parser found the entries
    namespace = {"ReduceOp": mw.ReduceOp}
    for prefix, name, args in signatures:
        where = f"docs/library.md `{prefix}.{name}({args})`"
        assert is_method(member(instances, prefix, name)), f"{where}: not callable"
        target = getattr(PREFIXES[prefix], name)
        params = [p for p in inspect.signature(target).parameters.values() if p.name != "self"]
        written = [a.strip() for a in args.split(",") if a.strip()]
        keyword_only = written.index("*") if "*" in written else None
        written = [a for a in written if a != "*"]
        assert [a.split("=")[0] for a in written] == [p.name for p in params], where
        if keyword_only is not None:
            kinds = [p.kind is inspect.Parameter.KEYWORD_ONLY for p in params]
            assert kinds == [i >= keyword_only for i in range(len(params))], where
        else:
            assert all(p.kind is not inspect.Parameter.KEYWORD_ONLY for p in params), where
        for text, param in zip(written, params, strict=True):
            _, has_default, default = text.partition("=")
            assert bool(has_default) == (param.default is not inspect.Parameter.empty), f"{where}: {param.name}"
            if not has_default or default == "...":  # `...`: computed when made (a time)
                continue
            actual = param.default
            if repr(actual) == "<factory>":  # a pydantic field's default_factory
                actual = target.model_fields[param.name].get_default(call_default_factory=True)
            assert eval(default, namespace) == actual, f"{where}: {param.name} defaults to {actual!r}"


def test_world_names_lists_a_world_still_being_joined() -> None:
    """`worlds()` has only the joined worlds; `world_names()` the ones being joined too."""
    (port,) = free_ports(1)
    manager = mw.WorldManager(pod="p0", config=FAST)
    try:
        (join,) = manager.start_joins([WorldAssignment(name="pending", rank=0, size=2, host="127.0.0.1", port=port)])
        assert not join.done.is_set()
        assert manager.worlds() == {}
        assert manager.world_names() == ["pending"]
        manager.leave("pending")
        assert manager.world_names() == []
    finally:
        manager.close()


# ---- the complete program, run as written ---------------------------------------------------


class Process:
    """One process of the program, with the MultiWorld environment of a pod (no live table);
    what it prints goes to a file beside the program."""

    def __init__(self, program: Path, pod: str, worlds: list[WorldAssignment]) -> None:
        env = {"MULTIWORLD_POD": pod, "MULTIWORLD_WORLDS": json.dumps([a.model_dump() for a in worlds])}
        base = {k: v for k, v in os.environ.items() if not k.startswith("MULTIWORLD_")}
        self.pod = pod
        self.log = program.with_name(f"{pod}.log")
        with self.log.open("w") as out:
            self.popen = subprocess.Popen(
                [sys.executable, str(program)], env={**base, **env}, stdout=out, stderr=subprocess.STDOUT
            )

    def output(self) -> str:
        return self.log.read_text()

    def wait_for(self, pattern: str) -> None:
        deadline = time.monotonic() + PROGRAM_WAIT_S
        while not re.search(pattern, self.output()):
            assert time.monotonic() < deadline, f"{self.pod} never printed {pattern!r}:\n{self.output()}"
            time.sleep(0.1)

    def wait_exit(self) -> int:
        return self.popen.wait(PROGRAM_WAIT_S)


def the_program(tmp_path: Path, **constants: float) -> Path:
    """The page's complete program, with its constants set as given."""
    text = section(LIBRARY_MD.read_text(), "## A complete program")
    (code,) = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    ast.parse(code)
    for name, value in constants.items():
        code, count = re.subn(rf"^{name} = .*$", f"{name} = {value!r}", code, count=1, flags=re.MULTILINE)
        assert count == 1, f"the program sets no {name}"
    path = tmp_path / "main.py"
    path.write_text(code)
    return path


@pytest.fixture
def processes() -> Iterator[list[Process]]:
    started: list[Process] = []
    yield started
    for process in started:
        if process.popen.poll() is None:
            process.popen.kill()
            process.popen.wait()


def test_the_complete_program_runs_a_leader_in_two_worlds(tmp_path: Path, processes: list[Process]) -> None:
    program = the_program(tmp_path, STEPS=5)
    port1, port2 = free_ports(2)
    world1 = dict(name="world1", size=2, host="127.0.0.1", port=port1)
    world2 = dict(name="world2", size=2, host="127.0.0.1", port=port2)
    processes.extend(
        [
            Process(program, "leader", [WorldAssignment(rank=0, **world1), WorldAssignment(rank=0, **world2)]),
            Process(program, "a", [WorldAssignment(rank=1, **world1)]),
            Process(program, "b", [WorldAssignment(rank=1, **world2)]),
        ]
    )
    assert [p.wait_exit() for p in processes] == [0, 0, 0], "\n\n".join(p.output() for p in processes)
    leader = processes[0].output()
    for world in ("world1", "world2"):
        assert f"{world} epoch 1 rank 0/2: step 5, sum 3" in leader, leader
        assert f"{world}: done" in leader, leader
    assert "world1 epoch 1 rank 1/2: step 5, sum 3" in processes[1].output()


def test_the_complete_program_gives_up_a_world_whose_peers_are_gone(tmp_path: Path, processes: list[Process]) -> None:
    """Without a platform to bring it back, a broken world gets no newer epoch: the program's
    wait for one times out and it ends, instead of waiting forever."""
    program = the_program(tmp_path, STEPS=10**9, GIVE_UP_S=2.0)
    (port,) = free_ports(1)
    world1 = dict(name="world1", size=2, host="127.0.0.1", port=port)
    processes.extend([Process(program, f"p{rank}", [WorldAssignment(rank=rank, **world1)]) for rank in (0, 1)])
    processes[1].wait_for(r"world1 epoch 1 rank 1/2: step \d+")
    processes[1].popen.send_signal(signal.SIGKILL)
    started = time.monotonic()
    assert processes[0].wait_exit() == 0, processes[0].output()
    assert time.monotonic() - started < 30
    survivor = processes[0].output()
    assert re.search(r"world1 broke at epoch 1: ", survivor), survivor
    assert "world1: no epoch after 1 within 2 s: giving it up" in survivor, survivor
