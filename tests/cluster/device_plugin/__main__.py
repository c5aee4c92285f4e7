import sys

from tests.cluster.device_plugin.plugin import main

sys.exit(main())
