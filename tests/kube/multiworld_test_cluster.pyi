# For the type checker: conftest.py loads tests/cluster/cluster.py by path and registers it as
# multiworld_test_cluster (tests/ is not a package), which the tests import by that name.
from cluster import *  # noqa: F403 - all that module's names
