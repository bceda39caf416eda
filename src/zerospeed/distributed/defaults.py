"""Rendezvous defaults shared by rank discovery and the launcher (no torch import here)."""

DEFAULT_ADDR = "127.0.0.1"
DEFAULT_PORT = 29500
