# For the type checker: conftest.py loads tests/cluster/images.py by path and registers it as
# multiworld_test_images (tests/ is not a package), which the tests import by that name.
from images import *  # noqa: F403 - all that module's names
