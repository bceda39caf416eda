"""Pre-flight: what each host of a multi-node job says about itself before any rank starts.

The runner runs ``python -m zerospeed.launcher.preflight --job=<token> [--node_host=H | --node_rank=N]
[--check_master]`` on every host through the same runner as the job (pdsh, ssh, mpirun, srun), with
a short timeout. Each prints ONE line::

    ZEROSPEED_PREFLIGHT {"host": ..., "hostname": ..., "python": "3.11.7", "torch": "2.13.0+cpu", ...}

(see :func:`answer` for the fields) and exits 0 whenever it could answer, even when the answer is bad
news: the runner decides. It does not import torch (its version comes from the package metadata), so
an answer takes a fraction of a second. The runner collects the lines (:func:`parse_answers`; pdsh's
``host: `` prefixes are fine) and :func:`compare`\\ s them with its own :func:`answer`: every problem
is one message naming the host and the fix, and the job is refused before any rank starts.

The master-port check (``--check_master``) is a runner's option, not part of the job: it is asked for
while the runner itself listens on the master port (the master host being the launching host), and
each host then tries a TCP connection to ``master_addr:master_port`` for :data:`CONNECT_TIMEOUT_S`.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import os
import platform
import shutil
import socket
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from typing import Any

import zerospeed
from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.job import JobSpec, node_rank_of
from zerospeed.launcher.plan import Program

__all__ = ["CONNECT_TIMEOUT_S", "MARKER", "answer", "compare", "is_local_address", "main", "parse_answers",
           "program_exists"]

MARKER = "ZEROSPEED_PREFLIGHT"
# Seconds a host may take to connect to the master port before it counts as unreachable from there.
CONNECT_TIMEOUT_S = 3.0


def program_exists(program: Program, cwd: str) -> bool:
    """Whether what every rank runs is there, resolved as the job will resolve it from ``cwd``: a
    script path, a ``--module`` found on ``[cwd, *sys.path]`` (``python -m`` puts the folder first;
    found by the import machinery's path finder, without importing anything), or a ``--no_python``
    executable (a path, or a name on ``PATH``)."""
    if program.no_python:
        if os.sep in program.script:
            path = os.path.join(cwd, program.script)
            return os.path.isfile(path) and os.access(path, os.X_OK)
        return shutil.which(program.script) is not None
    if program.module:
        return _module_exists(program.script, [cwd, *sys.path])
    return os.path.isfile(os.path.join(cwd, program.script))


def _module_exists(name: str, path: list[str]) -> bool:
    search: list[str] | None = path
    spec = None
    parts = name.split(".")
    for depth in range(len(parts)):
        if search is None:  # the parent is a module, not a package
            return False
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:depth + 1]), search)
        if spec is None:
            return False
        locations = spec.submodule_search_locations
        search = list(locations) if locations is not None else None
    return spec is not None


def _torch_version() -> str | None:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def _master_reachable(addr: str, port: int, timeout: float) -> str | None:
    """``None`` when a TCP connection to ``addr:port`` opened within ``timeout``; else why not."""
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return None
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__


def is_local_address(addr: str) -> bool:
    """Whether ``addr`` names this machine: a socket binds (port 0, nothing listens, no traffic) to one
    of the addresses it resolves to. A name that does not resolve is not local."""
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((sockaddr[0], 0, *sockaddr[2:]))
        except OSError:
            continue
        return True
    return False


def answer(spec: JobSpec | None, *, host: str | None, cwd: str, check_master: bool = False,
           job_error: str | None = None, connect_timeout: float = CONNECT_TIMEOUT_S,
           node_rank: int | None = None) -> dict[str, Any]:
    """This host's pre-flight facts: ``host`` (its name in the job), ``hostname``, ``python``
    (``major.minor.micro``), ``torch`` (``None`` when absent), ``zerospeed``, ``cwd``, ``program``
    and ``program_exists``, ``master`` (``addr:port`` when checked) with ``master_error`` (``None``:
    reachable), and ``job_error`` when the job could not be read (a different zerospeed, most likely).

    Node 0 (``node_rank == 0``) also says whether ``master_addr`` is one of its own addresses
    (``master_addr`` and ``master_is_local``): torch's agent on node 0 serves rank 0's store on
    ``master_addr:master_port``, so an address of another machine leaves every agent waiting."""
    facts: dict[str, Any] = {
        "host": host,
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "torch": _torch_version(),
        "zerospeed": zerospeed.__version__,
        "cwd": cwd,
        "job_error": job_error,
    }
    if spec is not None:
        facts["program"] = spec.program.script
        facts["program_exists"] = program_exists(spec.program, cwd)
        if node_rank == 0:
            facts["master_addr"] = spec.master_addr
            facts["master_is_local"] = is_local_address(spec.master_addr)
        if check_master:
            facts["master"] = f"{spec.master_addr}:{spec.master_port}"
            facts["master_error"] = _master_reachable(spec.master_addr, spec.master_port, connect_timeout)
    return facts


def parse_answers(output: str) -> dict[str, dict[str, Any]]:
    """The answers in a runner's combined output, by ``host``. Lines may carry a runner's prefix
    (pdsh's ``host: ``); a line that does not parse is skipped (that host then counts as silent)."""
    answers: dict[str, dict[str, Any]] = {}
    for line in output.splitlines():
        start = line.find(MARKER + " ")
        if start < 0:
            continue
        try:
            facts = json.loads(line[start + len(MARKER) + 1:])
        except ValueError:
            continue
        if isinstance(facts, dict) and isinstance(facts.get("host"), str):
            answers[facts["host"]] = facts
    return answers


def _minor(version: object) -> str:
    return ".".join(str(version).split(".")[:2])


def compare(answers: Mapping[str, Mapping[str, Any] | None], local: Mapping[str, Any], *,
            hosts: Sequence[str] | None = None) -> list[str]:
    """Every reason not to start, one message per problem, each naming the host and the fix.

    ``answers`` maps host -> its answer (``None`` or missing: it never answered); ``local`` is the
    launching host's own :func:`answer`; ``hosts`` are the job's hosts in order (default: the keys of
    ``answers``). Python must agree in ``major.minor`` (pickled objects and bytecode cross hosts),
    torch and zerospeed exactly (collectives and checkpoint formats must match).
    """
    problems: list[str] = []
    for host in (list(answers) if hosts is None else hosts):
        facts = answers.get(host)
        if facts is None:
            problems.append(f"host {host}: no pre-flight answer (unreachable, or no python with zerospeed "
                            f"there); check that the runner reaches {host} without a password prompt and "
                            "that zerospeed is installed there")
            continue
        if facts.get("job_error"):
            problems.append(f"host {host}: cannot read the job ({facts['job_error']}); install zerospeed "
                            f"{local.get('zerospeed')} there")
        if _minor(facts.get("python")) != _minor(local.get("python")):
            problems.append(f"host {host}: Python {facts.get('python')} but the launching host runs Python "
                            f"{local.get('python')}; use the same Python {_minor(local.get('python'))} on "
                            "every host")
        for package in ("torch", "zerospeed"):
            theirs, ours = facts.get(package), local.get(package)
            if theirs != ours:
                found = "no " + package if theirs is None else f"{package} {theirs}"
                problems.append(f"host {host}: {found} but the launching host has {package} {ours}; "
                                f"install {package}=={ours} on {host}")
        if facts.get("program_exists") is False:
            problems.append(f"host {host}: {facts.get('program')!r} does not exist in {facts.get('cwd')} "
                            "there (every host runs the job from the launching folder); copy it to that "
                            "path or use a shared file system")
        if facts.get("master") is not None and facts.get("master_error") is not None:
            problems.append(f"host {host}: cannot connect to the master port {facts['master']} "
                            f"({facts['master_error']}); open that port between the hosts or pass "
                            "--master_addr/--master_port that every host reaches")
        if facts.get("master_is_local") is False:
            problems.append(f"host {host} runs rank 0's store but --master_addr {facts.get('master_addr')} is "
                            f"not one of its addresses; pass --master_addr {host} (or omit it)")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    """Print this host's answer line; 0 whenever it could answer, 2 when it could not even tell
    which host it is."""
    parser = argparse.ArgumentParser(prog="python -m zerospeed.launcher.preflight", allow_abbrev=False)
    parser.add_argument("--job", required=True)
    parser.add_argument("--node_host", default=None)
    parser.add_argument("--node_rank", type=int, default=None)
    parser.add_argument("--check_master", action="store_true",
                        help="also try a TCP connection to the job's master_addr:master_port")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    spec: JobSpec | None = None
    host = args.node_host
    node_rank: int | None = None
    job_error = None
    try:
        spec = JobSpec.decode(args.job)
        node_rank = node_rank_of(spec, explicit=args.node_rank, host=args.node_host, environ=os.environ)
        host = spec.hosts[node_rank]
    except LauncherError as exc:
        if spec is None:
            job_error = str(exc)
        elif host is None:
            print(f"zerospeed: error: {exc}", file=sys.stderr, flush=True)
            return 2
    if host is None:
        print(f"zerospeed: error: cannot read the job ({job_error}) and no --node_host names this host",
              file=sys.stderr, flush=True)
        return 2
    facts = answer(spec, host=host, cwd=os.getcwd(), check_master=args.check_master, job_error=job_error,
                   node_rank=node_rank)
    print(f"{MARKER} {json.dumps(facts, sort_keys=True)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
