import sys

import flashcp.titan  # noqa: F401  (TorchTitan shims first)
from flashcp.titan.probe.cli import main

sys.exit(main())
