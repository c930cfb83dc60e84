"""`python -m flashcp.titan.dryrun`: see `flashcp.titan.dryrun.cli`."""

import sys

from flashcp.titan.dryrun.cli import main

if __name__ == "__main__":
    sys.exit(main())
