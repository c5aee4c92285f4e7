"""The property journey on a longer budget: hypothesis draws `--examples` topologies on the full
ranges (2-6 members, 2-5 worlds, members in up to 3 worlds, replicas 1-3, warm spares; chains,
rings, stars, worlds sharing several members) with up to 3 faults each (kills, freezes, a warm
spare killed, a member's template edited, a suspend), runs each with `multiworld run` and checks
the invariants of tests/support/journey.py (a failure is shrunk, and names its topology and
faults).

Figures per example: how long the worlds took to form at the start (the baseline: process
starts and joins, the same work a recovery does) and how long after the last fault every world
was Running with every rank and the rollout done. Target: the slowest settle within a tenth of
failurePolicy.joinTimeout (300 s), so that no wait the product causes comes near it.

    python -m bench.journeys [--examples N] [--seed S] [--quick] [--json]
"""

from __future__ import annotations

import sys
import tempfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, seed, settings, strategies as st

from tests.support.bench_common import Spread, Target, fmt_s, json_line, machine_load, parser, report, table
from tests.support.journey import Journey, faults, topologies

JOIN_TIMEOUT_S = 300.0


def run(examples: int, seed_value: int, quick: bool) -> list[tuple[str, dict[str, float]]]:
    done: list[tuple[str, dict[str, float]]] = []
    limits = {"max_members": 3, "max_replicas": 1, "max_pods": 3} if quick else {}

    @seed(seed_value)
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def journey(data: st.DataObject) -> None:
        topology = data.draw(topologies(**limits), label="topology")
        sequence = data.draw(faults(len(topology.replicas), max_faults=1 if quick else 3), label="faults")
        with tempfile.TemporaryDirectory(prefix="journey-") as workdir:
            one = Journey(topology, sequence, Path(workdir), name=f"jb-{zlib.crc32(workdir.encode()):08x}")
            print(f"  {one.describe()}", flush=True)
            one.run()
            done.append((one.describe(), one.figures))

    journey()
    return done


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    p.setting("--examples", int, full=10, quick=1, help="how many drawn journeys")
    p.add_argument("--seed", type=int, default=33, help="hypothesis seed (default 33)")
    args = p.parse_args(argv)
    load = machine_load()
    print(f"journeys (seed {args.seed}):", flush=True)
    done = run(args.examples, args.seed, args.quick)
    starts = [figures["start_s"] for _, figures in done]
    settles = [figures["settle_s"] for _, figures in done]
    rows = [[str(i + 1), fmt_s(f["start_s"]), fmt_s(f["settle_s"])] for i, (_, f) in enumerate(done)]
    worst = max(settles)
    report(
        "property journeys: random topologies and faults with multiworld run",
        load,
        [table(["journey", "start (baseline)", "settle after the last fault"], rows)],
        [Target("slowest settle after the last fault", worst, JOIN_TIMEOUT_S / 10, " s")],
    )
    if args.json:
        results: dict[str, Any] = {
            "journeys": len(done),
            "start_s": Spread.of(starts).as_dict(),
            "settle_s": Spread.of(settles).as_dict(),
        }
        json_line(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
