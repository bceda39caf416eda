"""Accelerated inference (issue 20)."""
