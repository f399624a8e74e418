"""python -m hpcserve.endpoint.dataplane: the data plane's process (plane.main)."""

import sys

from hpcserve.endpoint.dataplane.plane import main

sys.exit(main())
