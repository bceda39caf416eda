"""Which variables of the launching shell a multi-node job carries to every host, as DeepSpeed decides it.

DeepSpeed's runner forwards two things to the remote nodes: the variables of its own environment whose
names start with one of its exported families (``EXPORT_ENVS``: MLFLOW, PYTHON, MV2, UCX, plus the
accelerator's, NCCL for CUDA), and the ``KEY=VALUE`` lines of a ``.deepspeed_env`` file (name from
``DS_ENV_FILE``) found in the home folder and then in the current folder (the later file wins a key, the
order of first appearance is kept). It also prepends the launch folder to ``PYTHONPATH`` before the
export, so the script's own modules import on every host. zerospeed forwards the same, plus its own
``ZEROSPEED_`` variables.

The decision is a pure function of the environment and the file texts (:func:`forwarded_environment`),
so it is unit-tested without processes; :func:`env_file_paths` and :func:`read_env_files` are the thin
I/O around it. Differences from DeepSpeed, on purpose: blank and ``#`` lines are skipped and a line that
is not ``NAME=VALUE`` is an error naming ``file:line`` (DeepSpeed dies with a bare ``ValueError``), and
values are passed on literally (DeepSpeed wraps values with shell characters in ``"..."``, which breaks
values holding a quote; our commands quote with :func:`shlex.quote`). DeepSpeed's Nebula/AzureML names
are not forwarded: zerospeed has no Nebula checkpoint service.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from zerospeed.launcher.errors import LauncherError

__all__ = [
    "DEEPSPEED_ENV_FILE_DEFAULT",
    "DS_ENV_FILE_VARIABLE",
    "EXCLUDE_ENVS",
    "EXPORT_ENVS",
    "FORWARDED_FAMILIES",
    "env_file_name",
    "env_file_paths",
    "forwarded_environment",
    "parse_env_file",
    "read_env_files",
]

#: DeepSpeed's runner ``EXPORT_ENVS``: prefixes of the launching shell's variables sent to every node.
EXPORT_ENVS = ("MLFLOW", "PYTHON", "MV2", "UCX")
#: What zerospeed forwards: DeepSpeed's families, the CUDA accelerator's ``export_envs()`` (NCCL) and ours.
FORWARDED_FAMILIES = (*EXPORT_ENVS, "NCCL", "ZEROSPEED_")
#: DeepSpeed's ``EXCLUDE_ENVS``: on AISC compute each node sets these itself, so they are not forwarded
#: when the marker variable is present.
EXCLUDE_ENVS: Mapping[str, tuple[str, ...]] = {"AISC_JOB_NAME": ("NCCL_IB_HCA", "UCX_NET_DEVICES")}
DS_ENV_FILE_VARIABLE = "DS_ENV_FILE"
DEEPSPEED_ENV_FILE_DEFAULT = ".deepspeed_env"

# A name a POSIX shell can ``export`` (and Open MPI, MPICH and Slurm can pass).
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def env_file_name(environ: Mapping[str, str]) -> str:
    """The environment file's name: ``$DS_ENV_FILE`` or ``.deepspeed_env`` (DeepSpeed reads the variable
    once at import; we read it per launch, from the environment we were given)."""
    return environ.get(DS_ENV_FILE_VARIABLE) or DEEPSPEED_ENV_FILE_DEFAULT


def env_file_paths(environ: Mapping[str, str], *, home: str, cwd: str) -> tuple[str, ...]:
    """Where DeepSpeed looks for the file, in reading order: the home folder, then the current folder.

    An absolute ``DS_ENV_FILE`` names one file (``os.path.join`` drops the folder, as in DeepSpeed, which
    then reads that file twice; we read it once).
    """
    name = env_file_name(environ)
    paths: list[str] = []
    for folder in (home, cwd):
        path = os.path.join(folder, name)
        if path not in paths:
            paths.append(path)
    return tuple(paths)


def read_env_files(paths: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """``(path, text)`` of each path that is a file (a missing file is not an error, as in DeepSpeed)."""
    found: list[tuple[str, str]] = []
    for path in paths:
        file = Path(path)
        if not file.is_file():
            continue
        try:
            found.append((path, file.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError) as exc:
            raise LauncherError(f"cannot read the environment file {path!r} ({exc}); fix or remove it") from None
    return tuple(found)


def parse_env_file(text: str, *, source: str) -> dict[str, str]:
    """``NAME=VALUE`` lines in file order; name and value are stripped of surrounding blanks (as DeepSpeed
    does), the value is otherwise literal (quotes included). Blank lines and ``#`` comments are skipped."""
    variables: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        name = name.strip()
        if not sep or not _NAME.fullmatch(name):
            raise LauncherError(
                f"{source}:{lineno}: expected 'NAME=VALUE' with NAME made of letters, digits and '_' (not "
                f"starting with a digit), got {raw.strip()!r}; fix the line or remove it"
            )
        variables[name] = value.strip()
    return variables


def forwarded_environment(
    environ: Mapping[str, str],
    env_files: Sequence[tuple[str, str]],
    *,
    cwd: str,
    families: Sequence[str] = FORWARDED_FAMILIES,
) -> dict[str, str]:
    """The variables every host of the job gets, in DeepSpeed's order: the launching environment's
    variables of the forwarded ``families`` (in ``environ``'s order, ``PYTHONPATH`` with ``cwd`` put
    first), then each environment file's lines in reading order (a later value replaces an earlier one in
    place). ``env_files`` are ``(path, text)`` pairs, as :func:`read_env_files` gives them.
    """
    source = dict(environ)
    source["PYTHONPATH"] = cwd + (":" + environ["PYTHONPATH"] if environ.get("PYTHONPATH") else "")
    excluded = {name for marker, names in EXCLUDE_ENVS.items() if marker in environ for name in names}
    exported: dict[str, str] = {}
    for name, value in source.items():
        if name in excluded or not _NAME.fullmatch(name):
            continue  # a name no shell could export (or one each AISC node sets itself)
        if any(name.startswith(family) for family in families):
            exported[name] = value
    for path, text in env_files:
        exported.update(parse_env_file(text, source=path))
    return exported
