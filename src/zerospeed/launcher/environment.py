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
I/O around it. The file's values are shell text as in DeepSpeed: under pdsh and ssh the remote shell
expands ``$VAR`` in them on each host (``LD_LIBRARY_PATH=/opt/nccl/lib:$LD_LIBRARY_PATH``), so
:func:`forwarded_environment` returns a :class:`ForwardedEnvironment` that names them (``expand``); the
launching shell's own values are already expanded and are passed on literally. Differences from DeepSpeed,
on purpose: blank and ``#`` lines are skipped, an ``export `` before the name is allowed, one pair of
matching quotes around a value is removed (``"eth0"`` or ``'eth0'`` is ``eth0``; a value in single quotes
is literal, never expanded, as in a shell), and a line that is not ``NAME=VALUE`` is an error naming
``file:line`` (DeepSpeed dies with a bare ``ValueError``, or exports a variable named ``export NAME``).
DeepSpeed's Nebula/AzureML names are not forwarded: zerospeed has no Nebula checkpoint service.
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
    "ForwardedEnvironment",
    "env_file_name",
    "env_file_paths",
    "forwarded_environment",
    "parse_env_file",
    "parse_env_lines",
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
# ``export`` before the name of an environment file's line, as a shell script would write it.
_EXPORT_PREFIX = re.compile(r"export\s+")


class ForwardedEnvironment(dict[str, str]):
    """The variables every host gets (a plain ``dict``: name -> value, in export order), plus ``expand``:
    the names whose value is shell text for the remote shell to expand (``$VAR``) on each host, as
    DeepSpeed's pdsh command does — the environment files' values, except those written in single
    quotes. The other values (the launching shell's, already expanded there) are literal. Copying it into
    a plain ``dict`` drops ``expand``: every value is then literal."""

    def __init__(self, values: Mapping[str, str] | None = None, *, expand: Iterable[str] = ()) -> None:
        super().__init__(values or {})
        self.expand: frozenset[str] = frozenset(expand)


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
    """``NAME=VALUE`` lines in file order (see :func:`parse_env_lines`), as a mapping."""
    return {name: value for name, value, _ in parse_env_lines(text, source=source)}


def parse_env_lines(text: str, *, source: str) -> tuple[tuple[str, str, bool], ...]:
    """``(name, value, literal)`` of each ``[export ]NAME=VALUE`` line in file order. Name and value are
    stripped of surrounding blanks (as DeepSpeed does); one pair of matching quotes around the value is
    removed (``"eth0"``, ``'eth0'`` -> ``eth0``), and ``literal`` is true for a single-quoted value (a
    shell would not expand it). The value is otherwise kept as written, for the remote shell. Blank lines
    and ``#`` comments are skipped; anything else is an error naming ``source:line``."""
    lines: list[tuple[str, str, bool]] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        prefix = _EXPORT_PREFIX.match(line)
        name, sep, value = line[prefix.end() if prefix else 0:].partition("=")
        name = name.strip()
        if not sep or not _NAME.fullmatch(name):
            raise LauncherError(
                f"{source}:{lineno}: expected 'NAME=VALUE' (or 'export NAME=VALUE') with NAME made of "
                f"letters, digits and '_' (not starting with a digit), got {raw.strip()!r}; fix the line or "
                "remove it"
            )
        value = value.strip()
        quoted = len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'"
        lines.append((name, value[1:-1] if quoted else value, quoted and value[0] == "'"))
    return tuple(lines)


def forwarded_environment(
    environ: Mapping[str, str],
    env_files: Sequence[tuple[str, str]],
    *,
    cwd: str,
    families: Sequence[str] = FORWARDED_FAMILIES,
) -> ForwardedEnvironment:
    """The variables every host of the job gets, in DeepSpeed's order: the launching environment's
    variables of the forwarded ``families`` (in ``environ``'s order, ``PYTHONPATH`` with ``cwd`` put
    first), then each environment file's lines in reading order (a later value replaces an earlier one in
    place). ``env_files`` are ``(path, text)`` pairs, as :func:`read_env_files` gives them. The result's
    ``expand`` names the values the remote shell expands: those the files' last word on a name gave,
    unless single-quoted (:class:`ForwardedEnvironment`).
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
    expand: set[str] = set()
    for path, text in env_files:
        for name, value, literal in parse_env_lines(text, source=path):
            exported[name] = value
            if literal:
                expand.discard(name)
            else:
                expand.add(name)
    return ForwardedEnvironment(exported, expand=expand)
