"""The Dockerfile, checked without a Docker engine: its targets, its build context, its users,
its entrypoint against the installed console scripts, and its wheel stage run for real."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import pytest

from tests.support.chart_support import FULLNAME, RELEASE_NAMESPACE, REPO, Rendered, example_pod_templates

DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args_of(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def workdir(self, stages: dict[str, Stage]) -> PurePosixPath:
        own = self.args_of("WORKDIR")
        if own:
            return PurePosixPath(own[-1])
        return stages[self.base].workdir(stages) if self.base in stages else PurePosixPath("/")


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: dict[str, Stage]

    def copies(self, stage: Stage) -> list[tuple[str | None, list[str], str]]:
        """(--from stage or None, sources, destination) of each COPY of a stage."""
        found = []
        for args in stage.args_of("COPY"):
            words = shlex.split(args)
            flags = dict(w[2:].split("=", 1) for w in words if w.startswith("--"))
            paths = [w for w in words if not w.startswith("--")]
            found.append((flags.get("from"), paths[:-1], paths[-1]))
        return found

    def resolved_base(self, stage: Stage) -> str:
        while stage.base in self.stages:
            stage = self.stages[stage.base]
        return re.sub(r"\$\{(\w+)\}", lambda m: self.global_args[m.group(1)], stage.base)


def parse_dockerfile(text: str) -> Dockerfile:
    logical: list[str] = []
    pending = ""
    for line in text.splitlines():
        if line.strip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        logical.append(pending.strip())
        pending = ""
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in logical:
        keyword, args = line.split(None, 1)
        keyword = keyword.upper()
        if keyword == "FROM":
            base, _, name = args.partition(" AS ")
            current = Stage(name=name.strip(), base=base.strip())
            stages[current.name] = current
        elif current is None:
            assert keyword == "ARG", f"only ARG may precede FROM, got {keyword}"
            key, _, default = args.partition("=")
            global_args[key] = default
        else:
            current.instructions.append((keyword, args))
    return Dockerfile(global_args=global_args, stages=stages)


def _glob_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            out += {"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i]))
            i += 1
    return re.compile(out)


def dockerignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    """(re-include?, pattern) per line of .dockerignore, in order."""
    rules = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            rules.append((line.startswith("!"), _glob_regex(line.lstrip("!").strip("/"))))
    return rules


def in_context(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent folders decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    included = True
    for reinclude, pattern in rules:
        if any(pattern.fullmatch(prefix) for prefix in prefixes):
            included = reinclude
    return included


def context_files(source: str) -> list[str]:
    """Files of the build context under a COPY source, as relative paths."""
    rules = dockerignore_rules()
    root = REPO / source
    candidates = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
    relative = [p.relative_to(REPO).as_posix() for p in candidates]
    return sorted(path for path in relative if in_context(path, rules))


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return parse_dockerfile(DOCKERFILE.read_text())


def test_declares_operator_and_worker_targets_on_slim_python(dockerfile: Dockerfile) -> None:
    for target in ("operator", "worker"):
        assert target in dockerfile.stages
        assert dockerfile.resolved_base(dockerfile.stages[target]) == "python:3.11-slim"


def test_every_copy_source_is_in_the_build_context(dockerfile: Dockerfile) -> None:
    names = list(dockerfile.stages)
    for position, stage in enumerate(dockerfile.stages.values()):
        for from_stage, sources, _ in dockerfile.copies(stage):
            if from_stage is not None:
                assert from_stage in names[:position], f"{stage.name} copies from unknown stage {from_stage}"
                continue
            for source in sources:
                assert (REPO / source).exists(), f"COPY source {source} is not in the repository"
                assert context_files(source), f"COPY source {source} is excluded by .dockerignore"


@pytest.mark.parametrize(
    ("path", "included"),
    [
        ("worker/multiworld/contract.py", True),
        ("operator/multiworld_operator/cli.py", True),
        ("pyproject.toml", True),
        ("constraints.txt", True),
        ("examples/common.py", True),
        (".venv/bin/python", False),
        (".git/HEAD", False),
        ("tests/chart/test_dockerfile.py", False),
        ("charts/multiworld-operator/Chart.yaml", False),
        ("worker/multiworld/__pycache__/contract.cpython-311.pyc", False),
        ("multiworld.egg-info/PKG-INFO", False),
        ("operator/multiworld.egg-info/PKG-INFO", False),
    ],
)
def test_dockerignore_keeps_only_what_the_images_need(path: str, included: bool) -> None:
    assert in_context(path, dockerignore_rules()) is included


def final_user(stage: Stage) -> str:
    users = stage.args_of("USER")
    assert users, f"stage {stage.name} sets no USER: it would run as root"
    return users[-1]


@pytest.mark.parametrize("target", ["operator", "worker"])
def test_images_run_as_the_non_root_uid_the_chart_expects(
    dockerfile: Dockerfile, render: Callable[..., Rendered], target: str
) -> None:
    uid, gid = (int(part) for part in final_user(dockerfile.stages[target]).split(":"))
    assert uid != 0 and gid != 0
    pod = render().one("Deployment", FULLNAME, RELEASE_NAMESPACE)["spec"]["template"]["spec"]
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (uid, gid)
    runtime_setup = " ".join(dockerfile.stages["runtime"].args_of("RUN"))
    assert f"useradd --uid {uid} --gid {gid}" in runtime_setup


@pytest.mark.parametrize("values", [{}, {"watchNamespaces": ["team-a", "team-b"]}], ids=["all", "namespaced"])
def test_operator_entrypoint_is_the_console_script_and_accepts_the_chart_args(
    dockerfile: Dockerfile, render: Callable[..., Rendered], values: dict[str, list[str]]
) -> None:
    (entrypoint,) = dockerfile.stages["operator"].args_of("ENTRYPOINT")
    argv = json.loads(entrypoint)
    (script,) = importlib.metadata.entry_points(group="console_scripts", name=argv[0])
    assert callable(script.load())
    cli = importlib.import_module(script.module)
    pod = render(values).one("Deployment", FULLNAME, RELEASE_NAMESPACE)["spec"]["template"]["spec"]
    parsed = cli.build_parser().parse_args(argv[1:] + pod["containers"][0]["args"])
    assert parsed.command == "operator"
    assert parsed.liveness == "http://0.0.0.0:8080/healthz"
    assert parsed.namespace == values.get("watchNamespaces", [])
    assert (parsed.webhook_port, parsed.webhook_configuration) == (9443, FULLNAME)
    assert parsed.webhook_host == f"{FULLNAME}-webhook.{RELEASE_NAMESPACE}.svc"


# What the operator image runs, in an interpreter where `import torch` fails (that image has none).
_WITHOUT_TORCH = """
import sys
sys.modules["torch"] = None
import multiworld_operator.kube.main, multiworld_operator.kube.handlers, multiworld_operator.local.runner
from multiworld_operator.cli import main
sys.exit(main(["crd"]))
"""


def test_operator_code_and_entrypoint_run_without_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TORCH], capture_output=True, text=True, timeout=120, cwd=REPO, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "kind: CustomResourceDefinition" in result.stdout


def pip_installs(stage: Stage) -> list[str]:
    return [args for args in stage.args_of("RUN") if "pip install" in args]


def test_operator_image_installs_the_operator_extra_only(dockerfile: Dockerfile) -> None:
    (install,) = pip_installs(dockerfile.stages["operator"])
    assert "[operator]" in install
    assert "[worker]" not in install and "torch" not in install


def test_worker_image_installs_torch_under_the_constraints_from_a_chosen_index(dockerfile: Dockerfile) -> None:
    worker = dockerfile.stages["worker"]
    (install,) = pip_installs(worker)
    assert "[worker]" in install
    copied = {dest: sources for from_stage, sources, dest in dockerfile.copies(worker) if from_stage is None}
    constraints = [dest for dest, sources in copied.items() if sources == ["constraints.txt"]]
    assert constraints, "the worker stage does not copy constraints.txt"
    assert f"-c {constraints[0]}" in install
    index_arg = next(args for args in worker.args_of("ARG") if args.startswith("TORCH_INDEX_URL="))
    assert index_arg.endswith("download.pytorch.org/whl/cpu")
    assert "${TORCH_INDEX_URL}" in install


def test_worker_image_has_the_examples_in_its_working_directory(dockerfile: Dockerfile) -> None:
    worker = dockerfile.stages["worker"]
    destinations = [
        worker.workdir(dockerfile.stages) / dest
        for from_stage, sources, dest in dockerfile.copies(worker)
        if from_stage is None and sources == ["examples"]
    ]
    assert destinations == [worker.workdir(dockerfile.stages) / "examples"]


def test_example_manifests_run_scripts_the_worker_image_holds(dockerfile: Dockerfile) -> None:
    worker = dockerfile.stages["worker"]
    workdir = worker.workdir(dockerfile.stages)
    copied = {str(workdir / dest): sources for from_stage, sources, dest in dockerfile.copies(worker) if not from_stage}
    commands = [
        container["command"]
        for _, template in example_pod_templates()
        for container in template["spec"]["containers"]
        if "command" in container
    ]
    assert commands, "no example manifest names a command"
    for command in commands:
        assert command[0] == "python"
        script = str(workdir / command[1])
        (folder,) = [dest for dest in copied if script.startswith(dest + "/")]
        (source,) = copied[folder]
        assert f"{source}/{script[len(folder) + 1 :]}" in context_files(source), command


def test_wheel_stage_builds_one_wheel_with_both_packages(dockerfile: Dockerfile, tmp_path: Path) -> None:
    """Replays the wheel stage: its COPYs from the filtered context into its WORKDIR, then its
    `pip wheel` command as written (with build isolation, so pip fetches the build backend
    pyproject.toml asks for, as in the image), only with the wheel folder moved under tmp_path."""
    stage = dockerfile.stages["wheel"]
    workdir = tmp_path / "src"
    for _, sources, dest in dockerfile.copies(stage):
        for source in sources:
            for path in context_files(source):
                # A folder's contents land in the destination; a file lands inside it.
                inside = Path(path).relative_to(source) if (REPO / source).is_dir() else Path(path).name
                target = workdir / dest / inside
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / path, target)
    (run,) = stage.args_of("RUN")
    argv = shlex.split(run)
    assert argv[:2] == ["pip", "wheel"] and "--no-deps" in argv
    wheels = tmp_path / "wheels"
    argv[argv.index("--wheel-dir") + 1] = str(wheels)
    built = subprocess.run([sys.executable, "-m", *argv], cwd=workdir, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (wheel,) = wheels.glob("multiworld-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(info).decode()
        scripts = archive.read(info.replace("METADATA", "entry_points.txt")).decode()
    # Every module of both source folders is in the wheel (a folder without __init__.py is not).
    for folder in ("worker", "operator"):
        modules = [Path(p).relative_to(folder).as_posix() for p in context_files(folder) if p.endswith(".py")]
        missing = sorted(set(modules) - set(names))
        assert modules and not missing, f"{folder}/ modules missing from the wheel: {missing}"
    assert re.search(r"^multiworld = multiworld_operator\.cli:main$", scripts, re.M)
    requires = re.findall(r"^Requires-Dist: (.*)$", metadata, re.M)
    operator_extra = [r for r in requires if 'extra == "operator"' in r]
    worker_extra = [r for r in requires if 'extra == "worker"' in r]
    assert operator_extra and not [r for r in operator_extra if r.startswith("torch")]
    assert [r for r in worker_extra if r.startswith("torch")]
    assert not [r for r in requires if "extra" not in r and r.startswith("torch")]
