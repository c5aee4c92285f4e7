"""A world's host as a pod looks it up: a name beside the pod's own is asked for absolutely, so a
record that does not exist yet is never asked of the cluster DNS's upstream."""

from __future__ import annotations

import pytest

from multiworld.world import host_names

OWN = "mw-leader-0.mw.team-a.svc.cluster.local"


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        # The operator's name for rank 0's pod: the MultiWorld's headless Service in this namespace.
        ("mw-w1-0.mw", "mw-w1-0.mw.team-a.svc.cluster.local."),
        # A parent of the pod's domain, as a LeaderWorkerSet names its leader.
        ("mw-w1-0.mw.team-a", "mw-w1-0.mw.team-a.svc.cluster.local."),
        ("mw-w1-0.mw.team-a.svc.cluster.local", "mw-w1-0.mw.team-a.svc.cluster.local."),
        # Another MultiWorld's Service, another namespace: the pod's own name says nothing of them.
        ("other-0.other", "other-0.other"),
        ("mw-w1-0.mw2", "mw-w1-0.mw2"),
        ("mw-w1-0.mw.team-b", "mw-w1-0.mw.team-b"),
        # Already absolute, no domain, an address.
        ("mw-w1-0.mw.team-a.svc.cluster.local.", "mw-w1-0.mw.team-a.svc.cluster.local."),
        ("localhost", "localhost"),
        ("127.0.0.1", "127.0.0.1"),
        ("10.244.1.7", "10.244.1.7"),
        ("::1", "::1"),
        ("fd00::7", "fd00::7"),
    ],
)
def test_a_name_beside_the_pods_own_is_made_absolute(host: str, expected: str) -> None:
    assert host_names.absolute(host, OWN) == expected


def test_a_machine_whose_name_has_no_domain_leaves_every_host_alone() -> None:
    assert host_names.absolute("mw-w1-0.mw", "laptop") == "mw-w1-0.mw"
    assert host_names.absolute("mw-w1-0.mw", "laptop.") == "mw-w1-0.mw"
