"""What the tests and the benches share, one copy of each, imported by its full name
(`from tests.support.members import Member`) from the repository root, where pytest and
`python -m bench.NAME` start.

- members: member processes (JSON events on stdout, commands on stdin); worker_support: the
  worker tests' members and the local runner's channel server;
- planner_sim: an in-memory platform around the pure planner; limits_support: the largest spec
  and what is written for it; journey: `multiworld run` over random topologies and faults;
- operator_support, webhook_support, node_support, worker_link: the operator on the test API
  server, its webhook, the chart on the real node, a worker's channel;
- operator_metrics, prometheus, dashboard: the operator's metrics and the chart's dashboard;
- chart_support: the chart rendered; examples_harness, examples_expected: the example programs
  run and what they must print;
- bench_common, operator_scene, kubelet_stand_in, apiserver_requests: the benches' flags, tables
  and targets, and the operator benches' scene;
- import_graph: the import check of `make check`.

The test cluster is `tests.cluster`. Nothing here imports torch at module level but the worker
and examples helpers: a bench's coordinating process never needs it.
"""
