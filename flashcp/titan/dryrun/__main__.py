"""`python -m flashcp.titan.dryrun`: see `flashcp.titan.dryrun.run`."""

import sys

from flashcp.titan.dryrun.run import main

if __name__ == "__main__":
    sys.exit(main())
