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
import dataclasses
import importlib.metadata
import os
import platform
import shlex
import shutil
import sys
import textwrap
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import NoReturn

from zerospeed.launcher.commands import (
    ELASTIC_LAUNCHERS,
    LAUNCHERS,
    RemoteLaunch,
    check_elastic_launcher,
    launches,
    preflight_launches,
    probe_command,
    runner_executable,
    stop_commands,
)
from zerospeed.launcher.environment import env_file_paths, forwarded_environment, read_env_files
from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.plan import (
    DEFAULT_HOSTFILE,
    DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT,
    JobOptions,
    LaunchMode,
    LaunchPlan,
    LaunchRequest,
    Program,
    check_request,
    check_without_hostfile,
    job_spec,
    resolve_plan,
    stable_job_id,
)

__all__ = ["RunnerOptions", "build_launch_parser", "job_exports", "launch_main", "main", "parse_launch",
           "plan_from_args", "split_script", "subcommands", "version_line"]

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
    """Parse launcher options, resolve the plan and run it (the runner, and torch, load after the plan):
    on this machine (:func:`runners.run`), as this host's node agent (``--no_ssh``, or one host with
    options only the agent applies), or on every host through a runner (:func:`_run_multinode`)."""
    try:
        plan, runner_options = parse_launch(argv)
        if plan.mode is LaunchMode.RUNNER:
            return _run_multinode(plan, runner_options, environ=os.environ, cwd=os.getcwd())
        if plan.mode is LaunchMode.NODE:
            return _run_node(plan, environ=os.environ, cwd=os.getcwd())
        from zerospeed.launcher.runners import run

        return run(plan)
    except LauncherError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except _HelpShown as shown:
        return shown.code


def job_exports(environ: Mapping[str, str], cwd: str) -> dict[str, str]:
    """The variables every host gets (:func:`environment.forwarded_environment`), with the
    ``.deepspeed_env`` files read from the home folder and ``cwd``."""
    paths = env_file_paths(environ, home=os.path.expanduser("~"), cwd=cwd)
    return forwarded_environment(environ, read_env_files(paths), cwd=cwd)


def _run_multinode(plan: LaunchPlan, runner_options: RunnerOptions, *, environ: Mapping[str, str],
                   cwd: str) -> int:
    """Build the job (a fresh id), what the runner executes on every host (:mod:`commands`: the agents,
    the pre-flight probes, the stop commands, the elastic reachability probe) and hand them to
    :func:`multinode.run_job`. Pre-flight goes as a function of ``check_master``: run_job knows only at
    run time whether it listens on the master port (the master is this machine), and only then may the
    hosts be asked to connect to it."""
    runner, note = runner_options.runner(shutil.which)
    if note:
        print(note, file=sys.stderr)
    executable = runner_executable(runner, shutil.which)
    spec = job_spec(plan, job_id=uuid.uuid4().hex[:12])
    args, port = runner_options.launcher_args, runner_options.ssh_port
    exports = job_exports(environ, cwd)
    agents = launches(spec, runner, launcher_args=args, ssh_port=port, exports=exports, cwd=cwd,
                      python=sys.executable, executable=executable, local_environ=environ,
                      save_pid=os.getpid() if spec.save_pid else None)

    def preflight(check_master: bool) -> tuple[RemoteLaunch, ...]:
        return preflight_launches(spec, runner, launcher_args=args, ssh_port=port, exports=exports, cwd=cwd,
                                  python=sys.executable, executable=executable, local_environ=environ,
                                  check_master=check_master)

    def probe(host: str) -> RemoteLaunch:
        return probe_command(runner, host, launcher_args=args, ssh_port=port, executable=executable,
                             local_environ=environ)

    stops = stop_commands(spec, runner, launcher_args=args, ssh_port=port, executable=executable,
                          local_environ=environ, exports=exports)

    from zerospeed.launcher.multinode import run_job

    return run_job(spec, runner=runner, launches=agents, preflight=preflight, stop=stops,
                   probe=probe if runner in ELASTIC_LAUNCHERS else None,
                   no_ssh_check=runner_options.no_ssh_check)


def _run_node(plan: LaunchPlan, *, environ: Mapping[str, str], cwd: str) -> int:
    """Run this host's node agent in this process: ``--no_ssh`` (every host runs the same command with
    its own --node_rank; the job id is derived from the plan, so all hosts agree on it, and the
    ``.deepspeed_env`` variables reach the ranks as the agent's worker environment), or a single host
    with an option only the agent applies (a fresh id; the port chosen as for any single-node launch)."""
    if plan.node_rank is not None:
        spec = job_spec(plan, job_id=stable_job_id(plan))
        spec = dataclasses.replace(spec, worker_env=job_exports(environ, cwd))
        node_rank = plan.node_rank
    else:
        from zerospeed.launcher.runners import choose_master_port

        port = choose_master_port(plan.master_port, log=sys.stderr)
        spec = job_spec(plan, job_id=uuid.uuid4().hex[:12], master_port=port)
        node_rank = 0

    from zerospeed.launcher.node import main as node_main

    save_pid = [f"--save_pid={os.getpid()}"] if spec.save_pid else []
    return node_main([f"--job={spec.encode()}", f"--node_rank={node_rank}", *save_pid])


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


# Launcher options that take a value; all others are flags. Used to find where the script starts, so it
# must list every spelling of every value option of build_launch_parser (a test checks it does).
_VALUE_OPTIONS = frozenset({
    "--num_procs", "--num-procs", "--nproc_per_node", "--nproc-per-node", "--num_gpus", "--num-gpus",
    "--num_accelerators", "--num-accelerators",
    "--num_nodes", "--num-nodes", "--master_addr", "--master-addr", "--master_port",
    "--master-port", "-H", "--hostfile", "-i", "--include", "-e", "--exclude",
    "--launcher", "--launcher_args", "--launcher-args", "--node_rank", "--node-rank", "--ssh_port", "--ssh-port",
    "--enable_each_rank_log", "--enable-each-rank-log", "--bind_core_list", "--bind-core-list",
    "--min_elastic_nodes", "--min-elastic-nodes", "--max_elastic_nodes", "--max-elastic-nodes",
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
            "Launch a training script, one process per rank, on this machine or on the hosts of a hostfile, "
            "DeepSpeed-style. Launcher options go before the script (a .py file; a module with -m; an "
            "executable with --no_python); everything after the script is passed to it unchanged."),
        epilog="\n\n".join((
            "subcommands (zerospeed <subcommand> --help for each):\n" + "\n".join(
                f"  {name:<10}{summary}" for name, summary in _SUBCOMMAND_SUMMARIES),
            _paragraph(
                "Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT "
                "(and OMP_NUM_THREADS=1 if unset and more than one rank). If any rank fails, the others are "
                "stopped and the launcher exits non-zero."),
            _paragraph(
                "Several hosts: list them in a hostfile ('<host> slots=<n>' per line; /job/hostfile is used "
                "when it exists and -H is not given). One node agent starts on every selected host through "
                "--launcher; the variables named MLFLOW*, PYTHON*, MV2*, UCX*, NCCL*, ZEROSPEED_* and the "
                "NAME=VALUE lines of ~/.deepspeed_env and ./.deepspeed_env (or $DS_ENV_FILE) reach every "
                "rank."),
        )),
    )
    parser.add_argument("--version", action="version", version=version_line(),
                        help="print zerospeed's, torch's and Python's versions and exit")
    count = parser.add_mutually_exclusive_group()
    count.add_argument("--num_procs", "--num-procs", "--nproc_per_node", "--nproc-per-node",
                       dest="num_procs", type=int, metavar="N",
                       help="ranks per host: the first N slots of each (default: all slots; without a "
                       "hostfile: the CUDA device count, else 1)")
    count.add_argument("--num_gpus", "--num-gpus", "--num_accelerators", "--num-accelerators",
                       dest="num_procs", type=int, metavar="N", help="DeepSpeed's name for --num_procs")
    parser.add_argument("--num_nodes", "--num-nodes", type=int, metavar="K",
                        help="use the first K hosts of the hostfile")
    parser.add_argument("--master_addr", "--master-addr", metavar="A",
                        help=f"address of rank 0's rendezvous store (default: {DEFAULT_MASTER_ADDR} on one "
                        "machine, the first selected host on several)")
    parser.add_argument("--master_port", "--master-port", type=int, metavar="P",
                        help=f"rendezvous port (default: {DEFAULT_MASTER_PORT}; on one machine a free port "
                        "if it is busy, and 0 = any free port)")
    parser.add_argument("-H", "--hostfile", metavar="F",
                        help=f"MPI-style hostfile ('<host> slots=<n>' per line); default: {DEFAULT_HOSTFILE} "
                        "if it exists, else this machine only, as 'localhost'")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("-i", "--include", metavar="S",
                       help="hosts/slots to use, e.g. 'worker-0@worker-1:0,2' or 'localhost:1,3'")
    which.add_argument("-e", "--exclude", metavar="S",
                       help="hosts/slots to leave out, same syntax as --include")
    parser.add_argument("--launcher", default=None, metavar="NAME",
                        help=f"how the hosts are started: {', '.join(LAUNCHERS)} (default: pdsh, or ssh "
                        "when pdsh is not installed)")
    parser.add_argument("--launcher_args", "--launcher-args", default="", metavar="ARGS",
                        help="extra arguments for the launcher, one quoted string (write "
                        "--launcher_args=--single-option for one that starts with '-')")
    parser.add_argument("--ssh_port", "--ssh-port", type=int, metavar="P", help="ssh port of the hosts")
    parser.add_argument("--no_ssh_check", "--no-ssh-check", action="store_true",
                        help="skip the pre-flight checks of the hosts before the ranks start")
    parser.add_argument("--force_multi", "--force-multi", action="store_true",
                        help="start the job through --launcher even when it has one host (e.g. a remote one)")
    parser.add_argument("--no_ssh", "--no-ssh", action="store_true",
                        help="start only this host's ranks; run the same command on every host, each "
                        "with its --node_rank")
    parser.add_argument("--node_rank", "--node-rank", type=int, metavar="K",
                        help="this host's position among the selected hosts (0-based; with --no_ssh)")
    parser.add_argument("--elastic_training", "--elastic-training", action="store_true",
                        help="keep training when hosts leave or come back (needs --master_addr; --launcher "
                        "pdsh or ssh, or --no_ssh)")
    parser.add_argument("--min_elastic_nodes", "--min-elastic-nodes", type=int, metavar="K",
                        help="fewest hosts an elastic job runs on (default: 1)")
    parser.add_argument("--max_elastic_nodes", "--max-elastic-nodes", type=int, metavar="K",
                        help="most hosts an elastic job runs on (default: the selected hosts)")
    parser.add_argument("--save_pid", "--save-pid", action="store_true",
                        help="write each node agent's process id to a file (DeepSpeed's --save_pid)")
    parser.add_argument("--enable_each_rank_log", "--enable-each-rank-log", metavar="DIR",
                        help="write each rank's stdout and stderr to its own file in DIR")
    parser.add_argument("--bind_cores_to_rank", "--bind-cores-to-rank", action="store_true",
                        help="bind each rank to its own share of the host's CPU cores")
    parser.add_argument("--bind_core_list", "--bind-core-list", metavar="CORES",
                        help="the cores to share out with --bind_cores_to_rank, e.g. '0-3,8' (default: all)")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("-m", "--module", action="store_true",
                      help="run the script as a Python module (python -m)")
    kind.add_argument("--no_python", "--no-python", action="store_true",
                      help="run the script as an executable, not through Python")
    local_rank = parser.add_mutually_exclusive_group()
    local_rank.add_argument("--append_local_rank", "--append-local-rank", action="store_true",
                            help="append --local_rank=<n> to the script's arguments (DeepSpeed always "
                            "does; we only do it on request)")
    local_rank.add_argument("--no_local_rank", "--no-local-rank", action="store_true",
                            help="do not append --local_rank (the default here; accepted for DeepSpeed)")
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


@dataclass(frozen=True)
class RunnerOptions:
    """How a multi-node plan's hosts are started (they do not change which hosts or slots run):
    ``launcher`` as given (``None``: the default, pdsh or else ssh), its extra arguments, the ssh port
    and whether pre-flight checks run."""

    launcher: str | None = None
    launcher_args: tuple[str, ...] = ()
    ssh_port: int | None = None
    no_ssh_check: bool = False

    def runner(self, which: Callable[[str], str | None]) -> tuple[str, str | None]:
        """The runner to use and a one-line note when it is not the one asked for: pdsh is the default,
        and without pdsh on PATH the hosts are started with plain ssh. An explicit ``--launcher pdsh``
        without pdsh stays an error (:func:`runner_executable` names the package)."""
        if self.launcher is not None:
            return self.launcher, None
        if which("pdsh") is None:
            return "ssh", f"{PROG}: pdsh is not installed (not on PATH); starting the hosts with ssh instead"
        return "pdsh", None


def plan_from_args(argv: Sequence[str], *, environ: Mapping[str, str] | None = None,
                   default_hostfile: str = DEFAULT_HOSTFILE) -> LaunchPlan:
    """Parse ``argv`` and resolve it against this machine (hostfile, CUDA devices).

    Everything that needs no device count is checked first (:func:`check_request` once, then the
    hostfile, the plan itself when the pool's size is known, and --include/--exclude's syntax when it is
    not); torch is imported to count CUDA devices only when the plan depends on the count (no
    --num_procs and no hostfile, or --include/--exclude picking devices of a single-node plan), so a usage
    error never waits for torch. ``default_hostfile`` is DeepSpeed's ``/job/hostfile``: read when it
    exists and no ``--hostfile`` is given.
    """
    return parse_launch(argv, environ=environ, default_hostfile=default_hostfile)[0]


def parse_launch(argv: Sequence[str], *, environ: Mapping[str, str] | None = None,
                 default_hostfile: str = DEFAULT_HOSTFILE) -> tuple[LaunchPlan, RunnerOptions]:
    """:func:`plan_from_args`, plus the options that say how a multi-node plan's hosts are started."""
    from zerospeed.launcher.hostfile import LOCALHOST, check_filter, read_hostfile

    environ = os.environ if environ is None else environ
    options, script, script_args = split_script(argv)
    ns = build_launch_parser().parse_args([opt for opt in options if opt != "--"])
    runner_options = _runner_options(ns)
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
    hostfile_path = ns.hostfile
    if hostfile_path is None and os.path.isfile(default_hostfile):
        hostfile_path = default_hostfile  # DeepSpeed's default; when absent, this machine only
    request = LaunchRequest(
        program=program,
        num_procs=ns.num_procs,
        num_nodes=ns.num_nodes,
        include=ns.include,
        exclude=ns.exclude,
        hostfile=hostfile_path,
        master_addr=ns.master_addr,
        master_port=ns.master_port,
        force_multi=ns.force_multi,
        no_ssh=ns.no_ssh,
        node_rank=ns.node_rank,
        elastic_training=ns.elastic_training,
        min_elastic_nodes=ns.min_elastic_nodes,
        max_elastic_nodes=ns.max_elastic_nodes,
        options=JobOptions(
            bind_cores_to_rank=ns.bind_cores_to_rank,
            bind_core_list=ns.bind_core_list,
            each_rank_log_dir=None if ns.enable_each_rank_log in (None, "None") else ns.enable_each_rank_log,
            save_pid=ns.save_pid,
        ),
    )
    check_request(request)
    hostfile = read_hostfile(hostfile_path) if hostfile_path else None
    if hostfile is not None or request.num_procs is not None:
        # The pool's size is known without CUDA: resolve (and so validate) the plan before any import
        # of torch. Only device selection (--include/--exclude) still needs to know whether CUDA exists,
        # and only on one host: on several, each node agent maps its own slots.
        plan = resolve_plan(
            request,
            hostfile_resources=hostfile,
            default_local_slots=1,
            cuda_available=False,
            inherited_visible_devices=environ.get("CUDA_VISIBLE_DEVICES"),
            checked=True,
        )
        if not (request.include or request.exclude) or plan.mode is not LaunchMode.LOCAL:
            _check_elastic_launcher(plan, runner_options)
            return plan, runner_options
    else:
        # This machine's pool ('localhost') is sized by the CUDA count: refuse a malformed filter first.
        check_without_hostfile(request)
        check_filter(request.include, request.exclude, [LOCALHOST])
    cuda_count = _cuda_device_count()
    plan = resolve_plan(
        request,
        hostfile_resources=hostfile,
        default_local_slots=max(cuda_count, 1),
        cuda_available=cuda_count > 0,
        inherited_visible_devices=environ.get("CUDA_VISIBLE_DEVICES"),
        checked=True,
    )
    _check_elastic_launcher(plan, runner_options)
    return plan, runner_options


def _check_elastic_launcher(plan: LaunchPlan, runner_options: RunnerOptions) -> None:
    """An elastic job started through a runner needs pdsh or ssh (:func:`commands.check_elastic_launcher`);
    refused here, before anything starts. ``--no_ssh`` and one-host jobs never use ``--launcher``."""
    if plan.mode is LaunchMode.RUNNER and plan.elastic_nodes is not None and runner_options.launcher is not None:
        check_elastic_launcher(runner_options.launcher, elastic=True)


def _runner_options(ns: argparse.Namespace) -> RunnerOptions:
    """``--launcher`` (case-insensitive, as DeepSpeed lowers it) and ``--launcher_args`` (split as a shell
    would, as DeepSpeed does), checked before anything else runs."""
    launcher = ns.launcher.lower() if ns.launcher is not None else None
    if launcher is not None and launcher not in LAUNCHERS:
        unsupported = " (DeepSpeed's impi and mvapich runners are not supported)" if launcher in (
            "impi", "mvapich") else ""
        raise LauncherError(f"--launcher {ns.launcher!r} is not a launcher{unsupported}; choose one of "
                            f"{', '.join(LAUNCHERS)}")
    try:
        launcher_args = tuple(shlex.split(ns.launcher_args))
    except ValueError as exc:
        raise LauncherError(f"--launcher_args {ns.launcher_args!r} cannot be split into arguments ({exc}); "
                            "check its quotes") from None
    if ns.ssh_port is not None and not 1 <= ns.ssh_port <= 65535:
        raise LauncherError(f"--ssh_port must be in 1..65535, got {ns.ssh_port}")
    return RunnerOptions(launcher=launcher, launcher_args=launcher_args, ssh_port=ns.ssh_port,
                         no_ssh_check=ns.no_ssh_check)


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
