"""Rendezvous defaults shared by rank discovery and the launcher (no torch import here)."""

import socket

DEFAULT_ADDR = "127.0.0.1"
DEFAULT_PORT = 29500


def free_port() -> int:
    """A TCP port free on this host right now (the OS picks it; another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])
