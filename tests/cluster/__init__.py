"""The test cluster (control plane, node, images, the chart with Helm), run from the repository
root as `python3 -m tests.cluster.NAME`. Standard library only, but for operator_release.py and
device_plugin/ (grpcio: the nodes run it with the venv's Python when this one lacks it)."""
