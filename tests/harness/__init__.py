"""What the tests and the benches share, one copy of each: member processes (`members`) and the
test cluster's modules (`kube`).

A package found by name: pytest puts tests/ on sys.path (`pythonpath` in pyproject.toml), and so
does bench/_common.py for the benches. No torch and no pytest here: a bench's coordinating
process never needs them.
"""
