"""The ``zerospeed`` launcher: hostfiles, resource selection and starting the ranks.

Importing this package does not import torch; only launching does.
"""

from zerospeed.launcher.errors import (
    HostfileError,
    LauncherError,
    MultiNodeNotImplementedError,
    ResourceFilterError,
)
from zerospeed.launcher.hostfile import parse_hostfile, parse_inclusion_exclusion, read_hostfile
from zerospeed.launcher.plan import LaunchPlan, LaunchRequest, Program, resolve_plan

__all__ = [
    "HostfileError",
    "LaunchPlan",
    "LaunchRequest",
    "LauncherError",
    "MultiNodeNotImplementedError",
    "Program",
    "ResourceFilterError",
    "parse_hostfile",
    "parse_inclusion_exclusion",
    "read_hostfile",
    "resolve_plan",
]
