"""Free TCP ports for tests that start launchers or stores on localhost."""

import socket


def free_port() -> int:
    """A port p with p + 1 free too (the launchers meet on the rendezvous port + 1)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
