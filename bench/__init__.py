"""The benchmarks, each run from the repository root as `python -m bench.NAME` (their shared
parts are in tests.support)."""
