"""The one exception type the launcher treats as "the user asked for something we cannot do".

The CLI turns a :class:`LauncherError` into a single ``zerospeed: error: ...`` line on stderr and
exit code 2; anything else is a bug in zerospeed and keeps its traceback.
"""

from __future__ import annotations


class LauncherError(ValueError):
    """A user-facing launcher problem (bad option, hostfile, include string, missing script)."""


class HostfileError(LauncherError):
    """A hostfile that cannot be parsed; the message names the file, the line and the fix."""


class ResourceFilterError(LauncherError):
    """An ``--include`` / ``--exclude`` string that does not match the available hosts and slots."""


class MultiNodeNotImplementedError(LauncherError):
    """The resolved resources need more than one node; only single-node launch exists so far."""
