"""`python -m flashcp.titan.config --check JOB [--world-size N]` / `--keys [SECTION ...]`."""

import sys

from flashcp.titan.config import main

sys.exit(main())
