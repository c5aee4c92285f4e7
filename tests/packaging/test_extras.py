"""The extras against the code: the project's wheel, installed with one extra into a clean
virtualenv (no system site-packages, always `-c constraints.txt`), brings what that extra's
code imports and calls; the operator's brings no torch; the wheel declares the ranges below,
and the operator's extra still works at their lower bounds."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[2]
CONSTRAINTS = REPO / "constraints.txt"
# What the Dockerfile's wheel stage copies.
WHEEL_INPUTS = ("pyproject.toml", "README.md", "worker", "operator")

# Lower bounds: torch as verified (2.13 CPU, 2.11 NCCL); kubernetes 36, the first client whose
# API methods take `_content_type`; kopf 1.45, the first with settings.watching.label_selectors;
# cryptography 42, as tested (the webhook's certificate).
DECLARED: dict[str, dict[str, str]] = {
    "worker": {"torch": ">=2.11,<2.14"},
    "operator": {"kopf": ">=1.45", "kubernetes": ">=36", "cryptography": ">=42"},
}

# The worker needs no Kubernetes client: its channel is plain TCP to the operator.
WORKER_CHECK = """
import multiworld, multiworld.channels.stream, torch
try:
    import kubernetes
except ModuleNotFoundError:
    pass
else:
    raise SystemExit(f"kubernetes is installed with the worker extra: {kubernetes.__file__}")
print(multiworld.__file__)
"""
# What the operator needs of kubernetes. The call goes to a closed port: a client that does not
# take `_content_type` fails before the network.
OPERATOR_CHECK = """
import kubernetes
cfg = kubernetes.client.Configuration(host="http://127.0.0.1:9")
cfg.retries = False
custom = kubernetes.client.CustomObjectsApi(kubernetes.client.ApiClient(cfg))
try:
    custom.patch_namespaced_custom_object_status("g", "v1", "ns", "things", "n", {},
        _content_type="application/merge-patch+json", _preload_content=False, _request_timeout=2)
except TypeError as error:
    raise SystemExit(f"kubernetes {kubernetes.__version__}: {error}")
except Exception:
    pass
import kopf, multiworld_operator, multiworld_operator.kube.handlers, multiworld_operator.kube.main
kopf.OperatorSettings().watching.label_selectors
from datetime import UTC, datetime
from multiworld_operator.kube.admission.certificate import self_signed
assert b"BEGIN CERTIFICATE" in self_signed(["webhook.ns.svc", "127.0.0.1"], datetime.now(UTC))[0]
try:
    import torch
except ModuleNotFoundError:
    pass
else:
    raise SystemExit(f"torch is installed: {torch.__file__}")
print(multiworld_operator.__file__)
"""
REQUIRES = "import importlib.metadata, json; print(json.dumps(importlib.metadata.requires('multiworld')))"


def run(cmd: list[str | Path], cwd: Path, tail: int = 4000) -> str:
    """Run `cmd`; on failure, fail the test with the command and the tail of its output."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    if proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}: {' '.join(map(str, cmd))}\n...{proc.stdout[-tail:]}", pytrace=False)
    return proc.stdout


@dataclass(frozen=True)
class Venv:
    extra: str
    root: Path

    def run(self, *args: str | Path) -> str:
        # From the venv's own directory, so no checkout is on sys.path.
        return run([*args], cwd=self.root)

    def python(self, code: str) -> str:
        return self.run(self.root / "bin" / "python", "-c", code)


def lower_bounds(extra: str) -> list[str]:
    """`name==lowest` for each range DECLARED for `extra`."""
    return [
        f"{name}=={spec.version}"
        for name, specs in DECLARED[extra].items()
        for spec in SpecifierSet(specs)
        if spec.operator == ">="
    ]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built from a copy of its sources (no build/ or egg-info here)."""
    src = tmp_path_factory.mktemp("src")
    for name in WHEEL_INPUTS:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(path, src / name)
    out = tmp_path_factory.mktemp("wheels")
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", out, src], cwd=src)
    (built,) = out.glob("multiworld-*.whl")
    return built


@pytest.fixture(scope="module", params=["worker", "operator", "operator-lowest"])
def venv(request: pytest.FixtureRequest, wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """A fresh virtualenv holding the wheel with one extra (-lowest: at its lower bounds)."""
    case: str = request.param
    extra = case.removesuffix("-lowest")
    root = tmp_path_factory.mktemp(case)
    constraints: list[str | Path] = ["-c", CONSTRAINTS]
    if case != extra:
        (root / "lowest.txt").write_text("\n".join(lower_bounds(extra)) + "\n")
        constraints += ["-c", root / "lowest.txt"]
    venv = Venv(extra, root / "venv")
    started = time.monotonic()
    run([sys.executable, "-m", "venv", venv.root], cwd=root)
    venv.run(venv.root / "bin" / "python", "-m", "pip", "install", "--quiet", *constraints, f"{wheel}[{extra}]")
    print(f"\n[{case}] venv + install: {time.monotonic() - started:.0f}s")
    return venv


def test_extra_declares_its_ranges(venv: Venv) -> None:
    got: dict[str, SpecifierSet] = {}
    for line in json.loads(venv.python(REQUIRES)):
        req = Requirement(line)
        if (
            req.marker is not None
            and req.marker.evaluate({"extra": venv.extra})
            and not req.marker.evaluate({"extra": ""})
        ):
            got[req.name] = req.specifier
    want = {name: SpecifierSet(spec) for name, spec in DECLARED[venv.extra].items()}
    assert {name: got.get(name) for name in want} == want


def test_extra_brings_what_the_code_imports(venv: Venv) -> None:
    # The modules come from the installed wheel, not from the checkout.
    assert str(venv.root) in venv.python(WORKER_CHECK if venv.extra == "worker" else OPERATOR_CHECK)
    if venv.extra == "operator":
        assert "usage:" in venv.run(venv.root / "bin" / "multiworld", "operator", "--help")
