"""``deepspeed.launcher.runner``: the names frameworks import from DeepSpeed's launcher module.

``accelerate launch --use_deepspeed`` imports ``DEEPSPEED_ENVIRONMENT_NAME`` (the file of ``KEY=value``
lines DeepSpeed exports to every node of a multi-node job) before it writes that file; ``main`` is
DeepSpeed's ``deepspeed`` console command, here zerospeed's launcher (same options, one node).
zerospeed's launcher runs a single node, so it reads no such file: the variables of the launching
shell reach every rank as they are.
"""

from __future__ import annotations

import os
from typing import Sequence

from zerospeed.launcher.cli import main as _cli_main

#: DeepSpeed's name for the per-job environment file (``DS_ENV_FILE`` overrides it, as in DeepSpeed).
DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
#: Prefixes of variables DeepSpeed exports to remote nodes (kept for scripts that extend the list).
EXPORT_ENVS = ("MLFLOW", "PYTHON", "MV2", "UCX")


def main(args: Sequence[str] | None = None) -> int:
    """DeepSpeed's ``deepspeed`` command: launch with zerospeed's launcher (``zerospeed --help``)."""
    return _cli_main(args)


__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "EXPORT_ENVS", "main"]
