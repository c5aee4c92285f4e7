"""The tests, one package from the repository root: pytest imports each test module by its dotted
name (`tests.worker.test_manager`), the shared helpers are `tests.support`, the test cluster
`tests.cluster`, and the benches (`bench.*`) import both. Nothing here is imported by its path,
so no two modules of the tree share a name. Import nothing here: tests/cluster/ runs under any
Python (`python3 -m tests.cluster.cluster up`), without the venv."""
