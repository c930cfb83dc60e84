"""`python -m flashcp.titan.launch`: see `flashcp.titan.launch.node`."""

import signal
import sys

from flashcp.titan.launch.node import main

if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C before the ranks started: nothing to save, no traceback
        sys.exit(128 + signal.SIGINT)
