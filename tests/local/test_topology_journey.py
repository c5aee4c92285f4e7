"""The property journey on a small fixed budget: hypothesis draws a topology (chains, rings,
stars, worlds sharing several members; replicas and warm spares) and a fault sequence (kills,
freezes, a warm spare killed, a member's template edited, a suspend), runs it with
`multiworld run` and checks the invariants of tests/support/journey.py. Seeded, so every run
draws the same examples; a failure is shrunk and names its topology and faults.
bench/journeys.py runs more examples, on the full ranges, and prints the figures.
"""

from __future__ import annotations

import zlib

from hypothesis import HealthCheck, given, note, seed, settings, strategies as st

from tests.support.journey import Journey, faults, topologies


@seed(33)
@settings(
    max_examples=2,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_every_topology_recovers_from_its_faults_and_rolls_out(tmp_path_factory, data) -> None:
    topology = data.draw(topologies(max_members=4, max_replicas=2, max_pods=5), label="topology")
    sequence = data.draw(faults(len(topology.replicas), max_faults=2), label="faults")
    workdir = tmp_path_factory.mktemp("journey")
    journey = Journey(topology, sequence, workdir, name=f"j-{zlib.crc32(str(workdir).encode()):08x}")
    note(journey.describe())
    journey.run()
