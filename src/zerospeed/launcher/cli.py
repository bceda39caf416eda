"""The ``zerospeed`` command (also ``python -m zerospeed``).

``zerospeed <subcommand> ...`` dispatches through a small table keyed by the first token;
anything else is the launcher: ``zerospeed [launcher options] script.py [script args]``. Launcher
options must come before the script; everything after it belongs to the script, verbatim.

User mistakes become one ``zerospeed: error: ...`` line on stderr and exit code 2, found before torch
is imported (importing it takes seconds on a busy machine): the arguments, the script and the hostfile are
checked first, and CUDA devices are counted only when the plan needs the count.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import shutil
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import NoReturn

from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.plan import (
    DEFAULT_MASTER_ADDR,
    LaunchPlan,
    LaunchRequest,
    Program,
    check_request,
    resolve_plan,
)

__all__ = ["build_launch_parser", "launch_main", "main", "plan_from_args", "split_script", "subcommands",
           "version_line"]

PROG = "zerospeed"
USAGE_ERROR = 2

Subcommand = Callable[[list[str]], int]


def subcommands() -> Mapping[str, Subcommand]:
    """Subcommands by name: ``convert`` (a checkpoint to safetensors), ``report`` (what this install runs),
    ``plot`` (a CSV monitor run as a PNG), ``plan`` (per-rank peak memory of a config before running it).

    A script that happens to share a subcommand's name can still be launched as ``./name``.
    """
    return MappingProxyType({"convert": _convert, "report": _report, "plot": _plot, "plan": _plan})


# One line per subcommand for ``zerospeed --help``, in the order shown.
_SUBCOMMAND_SUMMARIES = (
    ("convert", "a checkpoint (any world size, ZeRO stage) to safetensors"),
    ("report", "what this installation runs: versions, backend, kernels"),
    ("plot", "a CSV monitor run's loss, lr, throughput and memory as a PNG"),
    ("plan", "a config's per-rank peak memory, before running it"),
)


def version_line() -> str:
    """``zerospeed --version``: zerospeed's, torch's and Python's versions, without importing torch.

    torch's version is read from its installed metadata, so the answer is instant (DeepSpeed's
    ``ds_report`` imports torch for it). ``zerospeed report`` gives the full picture.
    """
    import zerospeed

    try:
        torch_version = f"torch {importlib.metadata.version('torch')}"
    except importlib.metadata.PackageNotFoundError:
        torch_version = "torch not installed"
    return f"{PROG} {zerospeed.__version__} ({torch_version}, Python {platform.python_version()})"


def _plot(argv: list[str]) -> int:
    """``zerospeed plot RUN_DIR``: matplotlib is imported on use."""
    from zerospeed.monitor.plot import main as plot_main

    return plot_main(argv)


def _report(argv: list[str]) -> int:
    from zerospeed.report import main as report_main

    return report_main(argv)


def _plan(argv: list[str]) -> int:
    """``zerospeed plan``: imported on use, like ``convert``."""
    from zerospeed.plan.cli import plan_main

    return plan_main(argv)


def _convert(argv: list[str]) -> int:
    """``zerospeed convert``: imported on use, so launching stays free of torch imports."""
    from zerospeed.checkpoint.consolidate import convert_main

    return convert_main(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    table = subcommands()
    if args and args[0] in table:
        return table[args[0]](args[1:])
    return launch_main(args)


def launch_main(argv: Sequence[str]) -> int:
    """Parse launcher options, resolve the plan and run it (the runner, and torch, load after the plan)."""
    try:
        plan = plan_from_args(argv)
        from zerospeed.launcher.runners import run

        return run(plan)
    except LauncherError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except _HelpShown as shown:
        return shown.code


class _HelpShown(Exception):
    """``--help`` was printed; carries the exit code argparse wanted instead of exiting."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so ``main()`` returns and errors stay one line."""

    def error(self, message: str) -> NoReturn:
        raise LauncherError(f"{message} (see '{PROG} --help')")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            print(message, file=sys.stderr, end="")
        raise _HelpShown(status)


# Launcher options that take a value; all others are flags. Used to find where the script starts.
_VALUE_OPTIONS = frozenset({
    "--num_procs", "--num-procs", "--nproc_per_node", "--nproc-per-node", "--num_gpus", "--num-gpus",
    "--num_nodes", "--num-nodes", "--master_addr", "--master-addr", "--master_port",
    "--master-port", "-H", "--hostfile", "-i", "--include", "-e", "--exclude",
})
_USAGE = (f"{PROG} [options] script [script args ...]\n"
          f"       {PROG} {{{','.join(name for name, _ in _SUBCOMMAND_SUMMARIES)}}} ...")


def build_launch_parser() -> argparse.ArgumentParser:
    """The launcher's options (DeepSpeed's underscore names, with dashed aliases); the script and
    its arguments are split off by :func:`split_script` and never seen by argparse."""
    parser = _Parser(
        prog=PROG,
        usage=_USAGE,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_paragraph(
            "Launch a training script on one machine, one process per rank, DeepSpeed-style. Launcher "
            "options go before the script (a .py file; a module with -m; an executable with --no_python); "
            "everything after the script is passed to it unchanged."),
        epilog="\n\n".join((
            "subcommands (zerospeed <subcommand> --help for each):\n" + "\n".join(
                f"  {name:<10}{summary}" for name, summary in _SUBCOMMAND_SUMMARIES),
            _paragraph(
                "Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT "
                "(and OMP_NUM_THREADS=1 if unset and more than one rank). If any rank fails, the others are "
                "stopped and the launcher exits non-zero."),
        )),
    )
    parser.add_argument("--version", action="version", version=version_line(),
                        help="print zerospeed's, torch's and Python's versions and exit")
    count = parser.add_mutually_exclusive_group()
    count.add_argument("--num_procs", "--num-procs", "--nproc_per_node", "--nproc-per-node",
                       dest="num_procs", type=int, metavar="N",
                       help="ranks to start on this node (default: CUDA device count, else 1)")
    count.add_argument("--num_gpus", "--num-gpus", dest="num_procs", type=int, metavar="N",
                       help="DeepSpeed's name for --num_procs")
    parser.add_argument("--num_nodes", "--num-nodes", type=int, metavar="K",
                        help="use the first K hosts of the hostfile (only K=1 is implemented)")
    parser.add_argument("--master_addr", "--master-addr", default=DEFAULT_MASTER_ADDR, metavar="A",
                        help=f"address of rank 0's rendezvous store (default: {DEFAULT_MASTER_ADDR})")
    parser.add_argument("--master_port", "--master-port", type=int, metavar="P",
                        help="rendezvous port (default: 29500, or a free port if 29500 is busy; "
                        "0 = any free port)")
    parser.add_argument("-H", "--hostfile", metavar="F",
                        help="MPI-style hostfile ('<host> slots=<n>' per line); default: this "
                        "machine only, as 'localhost'")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("-i", "--include", metavar="S",
                       help="hosts/slots to use, e.g. 'worker-0@worker-1:0,2' or 'localhost:1,3'")
    which.add_argument("-e", "--exclude", metavar="S",
                       help="hosts/slots to leave out, same syntax as --include")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("-m", "--module", action="store_true",
                      help="run the script as a Python module (python -m)")
    kind.add_argument("--no_python", "--no-python", action="store_true",
                      help="run the script as an executable, not through Python")
    parser.add_argument("--append_local_rank", "--append-local-rank", action="store_true",
                        help="append --local_rank=<n> to the script's arguments (DeepSpeed always "
                        "does; we only do it on request)")
    return parser


def _paragraph(text: str) -> str:
    """``text`` wrapped for the raw help formatter (which keeps the subcommand table's lines)."""
    return textwrap.fill(text, width=max(shutil.get_terminal_size().columns - 2, 40))


def split_script(argv: Sequence[str]) -> tuple[list[str], str | None, list[str]]:
    """Split ``argv`` into (launcher options, script, script args) at the first non-option token.

    Done by hand rather than with argparse's REMAINDER, which drops a ``--`` that directly follows
    the script; the script's arguments must reach it byte for byte. A ``--`` before the script
    ends the launcher options.
    """
    index = 0
    while index < len(argv):
        token = argv[index]
        if token == "--":
            index += 1
            break
        if not token.startswith("-") or token == "-":
            break
        takes_value = token in _VALUE_OPTIONS
        index += 2 if takes_value else 1
    else:
        return list(argv), None, []
    if index >= len(argv):
        return list(argv[: index]), None, []
    return list(argv[:index]), argv[index], list(argv[index + 1:])


def plan_from_args(argv: Sequence[str], *, environ: Mapping[str, str] | None = None) -> LaunchPlan:
    """Parse ``argv`` and resolve it against this machine (hostfile, CUDA devices).

    Everything that needs no device count is checked first (:func:`check_request` once, then the
    hostfile, the plan itself when the pool's size is known, and --include/--exclude's syntax when it is
    not); torch is imported to count CUDA devices only when the plan depends on the count (no
    --num_procs and no hostfile, or --include/--exclude picking devices), so a usage error never waits
    for torch.
    """
    from zerospeed.launcher.hostfile import LOCALHOST, check_filter, read_hostfile

    environ = os.environ if environ is None else environ
    options, script, script_args = split_script(argv)
    ns = build_launch_parser().parse_args([opt for opt in options if opt != "--"])
    if script is None:
        raise LauncherError(f"missing the script to run; usage: {PROG} [options] script.py [args]")
    program = Program(
        script=script,
        args=tuple(script_args),
        module=ns.module,
        no_python=ns.no_python,
        append_local_rank=ns.append_local_rank,
    )
    _check_program(program)
    request = LaunchRequest(
        program=program,
        num_procs=ns.num_procs,
        num_nodes=ns.num_nodes,
        include=ns.include,
        exclude=ns.exclude,
        hostfile=ns.hostfile,
        master_addr=ns.master_addr,
        master_port=ns.master_port,
    )
    check_request(request)
    hostfile = read_hostfile(ns.hostfile) if ns.hostfile else None
    if hostfile is not None or request.num_procs is not None:
        # The pool's size is known without CUDA: resolve (and so validate) the plan before any import
        # of torch. Only device selection (--include/--exclude) still needs to know whether CUDA exists.
        plan = resolve_plan(
            request,
            hostfile_resources=hostfile,
            default_local_slots=1,
            cuda_available=False,
            inherited_visible_devices=environ.get("CUDA_VISIBLE_DEVICES"),
            checked=True,
        )
        if not (request.include or request.exclude):
            return plan
    else:
        # This machine's pool ('localhost') is sized by the CUDA count: refuse a malformed filter first.
        check_filter(request.include, request.exclude, [LOCALHOST])
    cuda_count = _cuda_device_count()
    return resolve_plan(
        request,
        hostfile_resources=hostfile,
        default_local_slots=max(cuda_count, 1),
        cuda_available=cuda_count > 0,
        inherited_visible_devices=environ.get("CUDA_VISIBLE_DEVICES"),
        checked=True,
    )


def _check_program(program: Program) -> None:
    """Fail before starting N processes that would all die with the same 'file not found'."""
    if program.module:
        return
    if program.no_python:
        if os.path.isfile(program.script) or shutil.which(program.script):
            return
        raise LauncherError(f"executable {program.script!r} not found (with --no_python)")
    if os.path.isdir(program.script):
        _check_directory_script(program.script)
        return
    if not os.path.isfile(program.script):
        hint = " (did you mean --module?)" if not program.script.endswith(".py") else ""
        raise LauncherError(f"script {program.script!r} not found{hint}")


def _check_directory_script(path: str) -> None:
    """Python runs a directory through its ``__main__.py``; any other directory is refused with the
    scripts found inside it, so the user sees what to pass instead."""
    if os.path.isfile(os.path.join(path, "__main__.py")):
        return
    scripts = sorted(name for name in os.listdir(path) if name.endswith(".py") and not name.startswith("_"))
    if scripts:
        shown = ", ".join(repr(os.path.join(path, name)) for name in scripts[:3])
        more = f" (and {len(scripts) - 3} more)" if len(scripts) > 3 else ""
        inside = f"pass one of the scripts inside it: {shown}{more}"
    else:
        inside = "pass the .py file to run"
    raise LauncherError(
        f"script {path!r} is a directory, not a file (and has no __main__.py); {inside}, or run a package "
        "with --module"
    )


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
