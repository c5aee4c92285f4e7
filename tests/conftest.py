"""The suite's order, and the builds the tests that need an API server wait for.

Every test that needs no API server (`kube`) and takes no bench's timings (`quiet`) runs first:
`make test` builds the test cluster's binaries and our images beside them
(tests/support/builds.py), and each `kube` or `quiet` test waits for those builds before its
fixtures start. Then those that need a session cluster (the control plane's, then the node's),
and last those that power off or cut off a node (`node_fault`).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.builds import BuildsFailed, wait_for_builds

# The session's clusters (tests/kube/conftest.py), in the order they start: a test needing the
# first runs before those needing the second.
_CLUSTERS = ("kube_cluster", "kube_node")


def _waits_for_builds(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(marker) is not None for marker in ("kube", "quiet"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that wait for no build first; then those that need a session cluster, after all
    the others (the control plane's, then the node's), in their order otherwise: a session
    cluster lives until the session ends, and its daemons and draining pods would load the
    machine under every later test (timing failure detection among them). Those that power off
    or cut off a node (`node_fault`) run last: a healed node runs its next pods slowly for
    minutes (the other node journeys took up to three times as long after one)."""

    def order(item: pytest.Item) -> tuple[bool, int, bool]:
        names = getattr(item, "fixturenames", ())
        started = max((rank + 1 for rank, name in enumerate(_CLUSTERS) if name in names), default=0)
        return _waits_for_builds(item), started, item.get_closest_marker("node_fault") is not None

    items.sort(key=order)


_BUILDS_FAILED = pytest.StashKey[str]()


# Outside every other wrapper (pytest-timeout's timer among them): the wait is not the test's.
@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    if _waits_for_builds(item):
        reporter = item.config.pluginmanager.get_plugin("terminalreporter")

        def say(line: str) -> None:
            if reporter is not None:
                reporter.ensure_newline()
                reporter.write_line(line)

        try:
            wait_for_builds(say)
        except BuildsFailed as error:
            item.stash[_BUILDS_FAILED] = str(error)
    yield


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test whose builds failed errors before its fixtures start, saying why."""
    failed = item.stash.get(_BUILDS_FAILED, None)
    if failed is not None:
        pytest.fail(failed, pytrace=False)
