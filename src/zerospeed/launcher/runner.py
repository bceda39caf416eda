"""``deepspeed.launcher.runner``: the names frameworks import from DeepSpeed's launcher module.

``accelerate launch --use_deepspeed`` imports ``DEEPSPEED_ENVIRONMENT_NAME`` (the file of ``KEY=value``
lines DeepSpeed exports to every node of a multi-node job) before it writes that file; ``main`` is
DeepSpeed's ``deepspeed`` console command, here zerospeed's launcher (the same options, one host or
many). The launcher reads that file from the home folder and the current folder, and forwards the
variable families of ``EXPORT_ENVS`` (plus NCCL and ZEROSPEED_) to every host, as DeepSpeed does
(:mod:`zerospeed.launcher.environment`).
"""

from __future__ import annotations

import os
from typing import Sequence

from zerospeed.launcher.cli import main as _cli_main
from zerospeed.launcher.environment import DEEPSPEED_ENV_FILE_DEFAULT, DS_ENV_FILE_VARIABLE
from zerospeed.launcher.environment import EXPORT_ENVS as _EXPORT_ENVS
from zerospeed.launcher.plan import DEFAULT_HOSTFILE as DLTS_HOSTFILE  # DeepSpeed's default hostfile

#: DeepSpeed's name for the per-job environment file (``DS_ENV_FILE`` overrides it, as in DeepSpeed).
DEEPSPEED_ENVIRONMENT_NAME = os.getenv(DS_ENV_FILE_VARIABLE, DEEPSPEED_ENV_FILE_DEFAULT)
#: Where DeepSpeed looks for that file, in reading order (home, then the current folder).
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]
#: Prefixes of variables DeepSpeed exports to remote nodes (a list, as DeepSpeed's).
EXPORT_ENVS = list(_EXPORT_ENVS)


def main(args: Sequence[str] | None = None) -> int:
    """DeepSpeed's ``deepspeed`` command: launch with zerospeed's launcher (``zerospeed --help``)."""
    return _cli_main(args)


__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "DEEPSPEED_ENVIRONMENT_PATHS", "DLTS_HOSTFILE", "EXPORT_ENVS", "main"]
