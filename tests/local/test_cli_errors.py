"""`multiworld run` refuses bad input up front, naming the field or flag, starting nothing."""

import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.quick

MANIFEST = """\
apiVersion: multiworld.io/v1alpha1
kind: MultiWorld
metadata: {name: bad}
spec:
  template:
    spec:
      containers: [{name: worker, image: x, command: [python, -c, "pass"]}]
  members:
    - name: leader
    - name: w1
      replicas: 2
  worlds:
    - name: world1
      ranks: [leader, w1, w3]
    - name: world1
      ranks: [leader]
"""

GOOD = MANIFEST.replace(", w3]", "]").replace("    - name: world1\n      ranks: [leader]\n", "")


def run_cli(tmp_path: Path, text: str, *flags: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "mw.yaml"
    path.write_text(text)
    return subprocess.run(
        [sys.executable, "-m", "multiworld_operator.cli", "run", str(path), *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_every_spec_problem_is_listed_with_its_field(tmp_path):
    result = run_cli(tmp_path, MANIFEST)
    assert result.returncode == 2
    assert "spec.worlds[0].ranks[2]: member 'w3' is not declared" in result.stderr
    assert "spec.worlds[1]" in result.stderr  # the duplicate / too small world is named too
    assert "member logs" not in result.stderr  # nothing was started


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kill", "nobody", "--after", "1"], "no member named 'nobody'"),
        (["--kill", "w1:5", "--after", "1"], "has 2 pod(s)"),
        (["--kill", "w1"], "one --after SECONDS per --kill"),
        (["--until-recovered"], "--until-recovered: there is nothing to recover from without --kill or --suspend"),
        (["--until-recovered", "--kill", "w1", "--after", "1", "--chaos", "2"], "--chaos never ends"),
    ],
)
def test_bad_kill_flags_name_the_flag(tmp_path, flags, message):
    result = run_cli(tmp_path, GOOD, *flags)
    assert result.returncode == 2
    assert message in result.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--spares", "nobody=1"], "--spares nobody=1: no member named 'nobody'"),
        (["--spares", "w1=two"], "--spares w1=two: expected N or MEMBER=N"),
        (["--spares=-1"], "--spares -1: expected N or MEMBER=N"),
        (["--spares", "w1=65"], "--spares: spec.members[1].spares: Input should be less than or equal to 64"),
    ],
)
def test_bad_spares_flags_name_the_flag(tmp_path, flags, message):
    result = run_cli(tmp_path, GOOD, *flags)
    assert result.returncode == 2
    assert message in result.stderr, result.stderr
    assert "member logs" not in result.stderr


def test_missing_file_is_named(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "multiworld_operator.cli", "run", str(tmp_path / "nope.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "nope.yaml does not exist" in result.stderr


def test_a_template_without_a_command_is_refused(tmp_path):
    result = run_cli(tmp_path, GOOD.replace(', command: [python, -c, "pass"]', ""))
    assert result.returncode == 2
    assert "spec.template.spec.containers[0]: a command is required" in result.stderr


@pytest.mark.parametrize(
    ("command", "why"),
    [
        ("no-such-program-here", "not found on PATH"),
        ("./missing.sh", "no executable file at"),
    ],
)
def test_a_command_that_cannot_be_executed_is_refused_by_field(tmp_path, command, why):
    result = run_cli(tmp_path, GOOD.replace('command: [python, -c, "pass"]', f"command: [{command}]"))
    assert result.returncode == 2, result.stderr
    assert f"spec.template.spec.containers[0]: command '{command}' cannot be executed here ({why}" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_script_missing_from_the_workdir_is_refused_by_field(tmp_path):
    """Not run from some other folder: the script must be in the members' working directory."""
    result = run_cli(tmp_path, GOOD.replace('command: [python, -c, "pass"]', "command: [python, nowhere/main.py]"))
    assert result.returncode == 2, result.stderr
    assert "spec.template.spec.containers[0]: script 'nowhere/main.py' is not in " in result.stderr
    assert "member logs" not in result.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--duration", "abc"], "argument --duration: must be a number of seconds, got 'abc'"),
        (["--after", "soon", "--kill", "w1"], "argument --after: must be a number, got 'soon'"),
        (["--workdir", "/no/such/folder"], "--workdir /no/such/folder: no such directory"),
        (["--log-dir", "{tmp}/mw.yaml/logs"], "--log-dir {tmp}/mw.yaml/logs: cannot write there (Not a directory)"),
    ],
    ids=["duration", "after", "workdir", "log-dir"],
)
def test_each_bad_flag_exits_2_naming_it_without_a_traceback(tmp_path, flags, message):
    result = run_cli(tmp_path, GOOD, *(f.format(tmp=tmp_path) for f in flags))
    assert result.returncode == 2, result.stderr
    assert message.format(tmp=tmp_path) in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "member logs" not in result.stderr


def test_a_yaml_error_names_the_file_and_where(tmp_path):
    result = run_cli(tmp_path, "metadata: {name: x}\n  spec: [\n")
    assert result.returncode == 2, result.stderr
    assert f"{tmp_path / 'mw.yaml'}: not valid YAML at line 2, column 3" in result.stderr, result.stderr
    assert "<unicode string>" not in result.stderr


def test_version_is_the_installed_packages() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "multiworld_operator.cli", "--version"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and result.stdout.strip() == f"multiworld {version('multiworld')}"


def test_the_cli_runs_from_a_source_tree_that_is_not_installed(tmp_path: Path) -> None:
    """`python -m multiworld_operator.cli` with the sources on PYTHONPATH and no installed
    package (a GPU machine's own Python, say) answers --help and --version."""
    for package in ("operator", "worker"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'operator'}{os.pathsep}{tmp_path / 'worker'}"}
    for flag, expected in (("--version", "multiworld (not installed: run from a source tree)"), ("--help", "usage:")):
        # -S: no site-packages, where the venv's installed package lives.
        result = subprocess.run([sys.executable, "-S", "-m", "multiworld_operator.cli", flag], cwd=tmp_path,
                                env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert result.returncode == 0 and result.stdout.startswith(expected), result.stdout + result.stderr


def test_help_says_what_multiworld_is_for() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "multiworld_operator.cli", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0
    assert " ".join(result.stdout.split()).startswith(
        "usage: multiworld [-h] [--version] [-v] {run,status,operator,crd} ... Fault-isolated torch.distributed "
        "worlds, declared in a MultiWorld manifest: `multiworld run FILE.yaml` runs one on this machine, no cluster "
        "needed; `status`, `operator` and `crd` are for Kubernetes."
    ), result.stdout
    run_help = subprocess.run(
        [sys.executable, "-m", "multiworld_operator.cli", "run", "--help"], capture_output=True, text=True, timeout=60
    )
    assert "--duration SECONDS" in run_help.stdout


@pytest.mark.parametrize("command", [["status", "all-gather"], ["operator"]])
def test_status_and_operator_without_the_operator_extra_say_what_to_install(command: list[str]) -> None:
    """As in a `pip install '.[worker]'`: neither kopf nor the Kubernetes client can be imported."""
    blocked = "import sys; sys.modules.update(dict.fromkeys(['kopf', 'kubernetes', 'urllib3']))"
    result = subprocess.run(
        [sys.executable, "-c", f"{blocked}; from multiworld_operator.cli import main; sys.exit(main({command!r}))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert f"multiworld {command[0]}: this install has no " in result.stderr
    assert "pip install -c constraints.txt '.[operator]'" in result.stderr
