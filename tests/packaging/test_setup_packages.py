"""tests/cluster/packages.sh, the one step that installs the Debian packages of the test cluster
and the image build: with nothing to install it needs no root; where it cannot install what is
missing, it stops with one line naming the packages and the command that installs them."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

PACKAGES_SH = Path(__file__).resolve().parents[1] / "cluster" / "packages.sh"


def listed() -> list[str]:
    out = subprocess.run(["bash", str(PACKAGES_SH), "list"], capture_output=True, text=True, check=True).stdout
    return out.split()


def run_as_nobody(*, empty_dpkg: bool) -> subprocess.CompletedProcess[str]:
    """packages.sh as an unprivileged user (not root, and no sudo it may use), from a copy in a
    folder that user can read (the checkout and pytest's folders may not be). With `empty_dpkg`
    dpkg reads an empty database (DPKG_ADMINDIR): a machine with none of the packages."""
    with tempfile.TemporaryDirectory() as folder:
        Path(folder).chmod(0o755)
        script = Path(folder) / PACKAGES_SH.name
        script.write_text(PACKAGES_SH.read_text())
        env = dict(os.environ)
        if empty_dpkg:
            (Path(folder) / "status").write_text("")
            env["DPKG_ADMINDIR"] = folder
        return subprocess.run(
            ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "bash", str(script)],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )


def test_the_list_holds_what_the_node_the_images_and_the_build_run() -> None:
    packages = listed()
    assert len(packages) == len(set(packages))
    # node.py's runtime, network and DNS; images.py's base and engine; build.sh's compiler.
    for needed in ("containerd", "runc", "containernetworking-plugins", "iptables", "dnsmasq-base", "etcd-server",
                   "debootstrap", "docker.io", "golang-1.19-go"):  # fmt: skip
        assert needed in packages


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to the user nobody needs root")
def test_without_root_a_missing_package_stops_with_one_line_naming_it_and_the_fix() -> None:
    result = run_as_nobody(empty_dpkg=True)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("packages: missing containerd runc "), lines[0]
    assert f"sudo apt-get install -y --no-install-recommends {' '.join(listed())}" in lines[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to the user nobody needs root")
def test_with_everything_installed_it_needs_no_root() -> None:
    # make test has run this step as root already (and installed what was missing).
    result = run_as_nobody(empty_dpkg=False)
    assert (result.returncode, result.stderr) == (0, "")
