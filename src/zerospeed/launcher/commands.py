"""What each multi-node runner executes, as pure values: the contract between the plan and the processes.

Every runner starts ONE node agent per host (``python -u -m zerospeed.launcher.node --job=<token>``, see
:mod:`zerospeed.launcher.job`); the agent starts that host's ranks. This module only builds the command
lines (:class:`RemoteLaunch`), so each can be unit-tested exactly; :mod:`zerospeed.launcher.multinode`
runs them. How each runner tells the agent which host it is on (its node rank):

- ``pdsh``: one ``pdsh -S -f 1024 -R ssh -w h0,h1 <remote shell>`` for all hosts, the remote shell
  ending in ``--node_host=%h`` (pdsh substitutes the host name it reached; its own ``%n`` follows pdsh's
  host order, which pdsh may sort). ``%`` in our own text is written ``%%``, as pdsh wants. An elastic
  job's agents start as one ``pdsh -w <host>`` per host instead: the runner must see each host's agent
  end on its own (a lost host) and start it again alone when the host is back.
- ``ssh``: one ``ssh [options] [-p port] host <remote shell>`` per host, ending in ``--node_rank=k``.
- ``openmpi``: one ``mpirun`` with one application context per host (``-n 1 --host h`` ...
  ``--node_rank=k``, joined by ``:``): Open MPI maps the launching node first whatever the ``--host``
  order (open-mpi/ompi#13199), so its ``OMPI_COMM_WORLD_RANK`` is not a node rank we can trust.
- ``mpich`` (hydra): ``mpirun -n <hosts> -ppn 1 -hosts h0,h1`` (hydra places rank i on the i-th host);
  the agent reads ``PMI_RANK``.
- ``slurm``: ``srun --nodes=N --ntasks=N --ntasks-per-node=1 --nodelist=h0,h1`` running
  ``sh -c 'exec ... --node_host="$SLURMD_NODENAME"'``: Slurm numbers ``SLURM_NODEID`` in its own node
  order, not the hostfile's, so the agent looks its Slurm node name up in the job's hosts instead. The
  hostfile must therefore name the hosts exactly as Slurm does (``sinfo -N -h -o %N``, the short node
  names): a host written as an FQDN or an IP address while Slurm says ``node01`` is not found by its
  agent, which stops before any rank starts.
- ``no_ssh``: nothing; the user runs ``zerospeed --no_ssh --node_rank=k`` on every host.

Elastic training runs only under pdsh, ssh and ``--no_ssh`` (:func:`check_elastic_launcher`): one
``mpirun`` or ``srun`` for all hosts ends as a whole when one host is lost, taking the survivors with it.
Only the pdsh and ssh agents get ``--watch_stdin`` (the runner's pipe reaches each of them through its own
ssh): Open MPI's and MPICH's ``mpirun`` forward stdin to their first process only (the others read
``/dev/null``, an immediate end of input, and would stop at once), and under ``srun`` the runner stops
the job through ``srun`` itself. ssh (directly, or pdsh's through ``PDSH_SSH_ARGS_APPEND``) always runs
with :data:`SSH_OPTIONS`.

The remote shell string (pdsh, ssh) has DeepSpeed's shape: ``export K=V; ...`` for the forwarded
variables (:mod:`zerospeed.launcher.environment`), ``cd <launch folder>``, then the agent; as in
DeepSpeed, the remote shell expands ``$VAR`` in the ``.deepspeed_env`` values (see :func:`remote_shell`).
Open MPI gets the variables as ``-x K=V``, MPICH as ``-genv K V``, Slurm as ``--export=ALL,K=V``: no
shell reads those, so every value arrives literally (DeepSpeed passes them the same way; a ``$VAR`` in
``.deepspeed_env`` is not expanded under these runners). ``--launcher_args``
go where DeepSpeed puts them: after pdsh's host list, before Open MPI's and MPICH's exports (as global
options), after srun's node options; for ssh, before the host.

Stopping a job (:func:`stop_commands`) kills each host's agent by the PID it recorded in
``<tmp>/zerospeed-job-<job_id>-<hostname>-n<node rank>/agent.pid`` (the agent stops its workers), through the same runner; never
by a name pattern, so another job's processes are never touched.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from zerospeed.launcher.environment import ForwardedEnvironment
from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.job import JobSpec

__all__ = [
    "ELASTIC_LAUNCHERS",
    "LAUNCHERS",
    "NODE_MODULE",
    "PDSH_MAX_FAN_OUT",
    "PREFLIGHT_MODULE",
    "PROBE_SSH_OPTIONS",
    "RUNNERS",
    "SSH_OPTIONS",
    "TEMP_VARIABLES",
    "RemoteLaunch",
    "agent_pid_file",
    "check_elastic_launcher",
    "launches",
    "preflight_launches",
    "probe_command",
    "remote_shell",
    "runner_executable",
    "stop_commands",
    "stop_script",
]

#: ``--launcher`` choices, DeepSpeed's names (``ssh`` is ours: what runs when pdsh is not installed).
LAUNCHERS = ("pdsh", "openmpi", "mpich", "slurm", "ssh")
#: Everything :func:`launches` accepts: the launchers plus ``no_ssh`` (one ``zerospeed`` per host).
RUNNERS = (*LAUNCHERS, "no_ssh")
NODE_MODULE = "zerospeed.launcher.node"
PREFLIGHT_MODULE = "zerospeed.launcher.preflight"
#: DeepSpeed's ``PDSH_MAX_FAN_OUT``: pdsh connects to at most this many hosts at once (its default is 32).
PDSH_MAX_FAN_OUT = 1024
#: ssh options for a connection nobody types into: never prompt (fail instead), give up connecting after
#: 10 s, and notice a host that died (no answer to 3 keep-alives 5 s apart) instead of waiting forever.
SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=5",
               "-o", "ServerAliveCountMax=3")
_PROBE_CONNECT_TIMEOUT_S = "3"
#: ssh options of the elastic reachability probe (:func:`probe_command`): never prompt, and give up within
#: 3 s, before the runner's own 5 s deadline for a probe, so a host that is still down says so itself.
PROBE_SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", f"ConnectTimeout={_PROBE_CONNECT_TIMEOUT_S}")
#: The launchers that can run ``--elastic_training``: each host's agent is its own process there.
ELASTIC_LAUNCHERS = ("pdsh", "ssh")
# Why one mpirun/srun cannot run an elastic job, per launcher.
_ONE_PROCESS_FOR_ALL = {"openmpi": "Open MPI's mpirun", "mpich": "MPICH's mpirun (hydra)", "slurm": "srun"}

# The executable each runner calls when none is given (see runner_executable for the lookup).
_DEFAULT_EXECUTABLES = {"pdsh": "pdsh", "ssh": "ssh", "openmpi": "mpirun", "mpich": "mpirun", "slurm": "srun"}
# Binaries that name one MPI for sure (Debian installs both MPIs and points ``mpirun`` at one of them).
_EXPLICIT_EXECUTABLES = {"openmpi": ("mpirun.openmpi",), "mpich": ("mpirun.mpich", "mpiexec.hydra")}
#: The variables Python's :func:`tempfile.gettempdir` reads, in its order: the agent's pid file lies there.
TEMP_VARIABLES = ("TMPDIR", "TEMP", "TMP")
_INSTALL_HINTS = {"pdsh": "pdsh", "ssh": "openssh-client", "openmpi": "openmpi-bin", "mpich": "mpich",
                  "slurm": "slurm-client"}


@dataclass(frozen=True)
class RemoteLaunch:
    """One local process the runner starts: ``argv``, the ``hosts`` it reaches (in node-rank order) and
    ``env``, variables for that LOCAL process on top of the runner's own environment (e.g. pdsh's
    ``PDSH_RCMD_TYPE=ssh``)."""

    argv: tuple[str, ...]
    hosts: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))


def runner_executable(runner: str, which: Callable[[str], str | None]) -> str:
    """The program to call for ``runner``: Open MPI's ``mpirun.openmpi`` and MPICH's ``mpirun.mpich`` (or
    ``mpiexec.hydra``) when installed, since Debian's plain ``mpirun`` is whichever MPI the alternatives
    point to; else the runner's usual name (``mpirun``, ``srun``, ``pdsh``, ``ssh``). ``which`` is
    :func:`shutil.which` (a parameter, to keep this testable). A runner that is not installed is an error
    naming the package."""
    _check_runner(runner, allow_no_ssh=False)
    for name in _EXPLICIT_EXECUTABLES.get(runner, ()):
        if which(name):
            return name
    name = _DEFAULT_EXECUTABLES[runner]
    if which(name) is None:
        raise LauncherError(
            f"--launcher {runner} needs {name!r} on PATH, and it is not there; install it (Debian: "
            f"apt install {_INSTALL_HINTS[runner]}) or pick another --launcher ({', '.join(LAUNCHERS)})"
        )
    return name


def launches(
    spec: JobSpec,
    runner: str,
    *,
    launcher_args: Sequence[str],
    ssh_port: int | None,
    exports: Mapping[str, str],
    cwd: str,
    python: str,
    executable: str | None = None,
    local_environ: Mapping[str, str] | None = None,
    save_pid: int | None = None,
) -> tuple[RemoteLaunch, ...]:
    """The processes that start ``spec``'s node agent on every host with ``runner``.

    ``exports`` reach every agent (and so every rank); ``cwd`` is the folder the agents start in (the
    launch folder, as DeepSpeed's ``cd``); ``python`` the interpreter on the hosts. ``executable``
    overrides the runner's program (see :func:`runner_executable`). ``local_environ`` is the runner's own
    environment, read only for the ssh options pdsh should add to the user's ``PDSH_SSH_ARGS_APPEND``.
    pdsh and ssh agents watch their stdin (``--watch_stdin``): when the connection goes, they stop (the
    MPI and Slurm agents do not: see the module's notes). ``save_pid`` (``--save_pid``: the runner's PID,
    as DeepSpeed passes it) names each agent's pid file. An elastic ``spec`` needs pdsh or ssh
    (:func:`check_elastic_launcher`) and gets one process per host, pdsh's too.
    """
    check_elastic_launcher(runner, elastic=spec.elastic is not None)
    return _node_commands(spec, runner, module=NODE_MODULE, watch_stdin=True, launcher_args=launcher_args,
                          ssh_port=ssh_port, exports=exports, cwd=cwd, python=python, executable=executable,
                          local_environ=local_environ, host_by_name=False,
                          extra_args=(f"--save_pid={save_pid}",) if save_pid else (),
                          per_host=spec.elastic is not None)


def preflight_launches(
    spec: JobSpec,
    runner: str,
    *,
    launcher_args: Sequence[str],
    ssh_port: int | None,
    exports: Mapping[str, str],
    cwd: str,
    python: str,
    executable: str | None = None,
    local_environ: Mapping[str, str] | None = None,
    check_master: bool = False,
) -> tuple[RemoteLaunch, ...]:
    """Like :func:`launches`, for ``python -m zerospeed.launcher.preflight --job=<token>``: the same runner,
    folder and variables as the job itself, so what pre-flight sees is what the ranks will see. Each host
    is named by ``--node_host`` (except under MPICH, which gives the process ``PMI_RANK`` only).
    ``check_master`` adds ``--check_master`` (after the host's name): each host then tries the master
    port, which only makes sense while the runner listens on it (:func:`multinode.run_job` decides, and
    calls this again with ``check_master=True``)."""
    return _node_commands(spec, runner, module=PREFLIGHT_MODULE, watch_stdin=False,
                          launcher_args=launcher_args, ssh_port=ssh_port, exports=exports, cwd=cwd,
                          python=python, executable=executable, local_environ=local_environ, host_by_name=True,
                          tail_args=("--check_master",) if check_master else ())


def check_elastic_launcher(runner: str, *, elastic: bool) -> None:
    """Refuse ``--elastic_training`` under Open MPI, MPICH or Slurm: their one ``mpirun``/``srun`` starts
    every host's agent and ends as a whole when one host is lost (the survivors' agents are killed with
    it), so nothing could go on without the host, and nothing could start its agent alone when it is
    back. pdsh (one process per host for elastic jobs), ssh and ``--no_ssh`` can."""
    if elastic and runner in _ONE_PROCESS_FOR_ALL:
        raise LauncherError(
            f"--elastic_training cannot run under --launcher {runner}: {_ONE_PROCESS_FOR_ALL[runner]} starts "
            "every host's agent as one job that ends as a whole when one host is lost; use --launcher pdsh "
            "or ssh, or --no_ssh on each host"
        )


def probe_command(
    runner: str,
    host: str,
    *,
    launcher_args: Sequence[str],
    ssh_port: int | None,
    executable: str | None = None,
    local_environ: Mapping[str, str] | None = None,
) -> RemoteLaunch:
    """The elastic runner's "is ``host`` up again" command (exit 0 = it is): ``true`` run on the host the
    way its agent is started, with the same port, ``--launcher_args`` (a user name, a key) and, for pdsh,
    the user's ``PDSH_SSH_ARGS_APPEND``; ssh gives up after 3 s (:data:`PROBE_SSH_OPTIONS`) and never
    prompts. pdsh runs with ``-S`` so ssh's own exit code (255 for a host it cannot reach) is pdsh's, and
    ``-t 3``: pdsh puts its own ``-oConnectTimeout=<-t>`` (10 by default) before ``PDSH_SSH_ARGS_APPEND``,
    and ssh keeps the first value of an option."""
    if runner not in ELASTIC_LAUNCHERS:
        raise LauncherError(f"no reachability probe for --launcher {runner!r}: elastic jobs run under "
                            f"{' or '.join(ELASTIC_LAUNCHERS)} only")
    program = executable or _DEFAULT_EXECUTABLES[runner]
    if runner == "pdsh":
        return RemoteLaunch(argv=(program, "-S", "-t", _PROBE_CONNECT_TIMEOUT_S, "-R", "ssh", "-w", host,
                                  *launcher_args, "true"), hosts=(host,),
                            env=_pdsh_env(ssh_port, local_environ, options=PROBE_SSH_OPTIONS))
    return RemoteLaunch(argv=(program, *PROBE_SSH_OPTIONS, *_ssh_port(ssh_port), *launcher_args, host, "true"),
                        hosts=(host,))


def stop_commands(
    spec: JobSpec,
    runner: str,
    *,
    launcher_args: Sequence[str],
    ssh_port: int | None,
    executable: str | None = None,
    local_environ: Mapping[str, str] | None = None,
    exports: Mapping[str, str] | None = None,
) -> tuple[RemoteLaunch, ...]:
    """The processes that stop THIS job on every host: ``kill -TERM`` of the PID in the agent's pid file
    (:func:`stop_script`), run through ``runner``. For the MPI runners and Slurm the first thing to try is
    a signal to the local ``mpirun``/``srun`` (they forward it); these commands are for what survives it.
    ``exports`` are the job's (as given to :func:`launches`): a ``TMPDIR``, ``TEMP`` or ``TMP`` among them
    moved the agent's pid file, and the stop script looks where the agent wrote it.
    ``no_ssh`` has nothing to stop remotely."""
    _check_runner(runner, allow_no_ssh=True)
    if runner == "no_ssh":
        return ()
    script = stop_script(spec.job_id, exports, shell_expands=runner in ("pdsh", "ssh"))
    hosts = spec.hosts
    program = executable or _DEFAULT_EXECUTABLES[runner]
    extra = tuple(launcher_args)
    if runner == "pdsh":
        return (RemoteLaunch(argv=(*_pdsh_prefix(program, hosts), *extra, _pdsh_escape(script)), hosts=hosts,
                             env=_pdsh_env(ssh_port, local_environ)),)
    if runner == "ssh":
        return tuple(RemoteLaunch(argv=(*_ssh_prefix(program, ssh_port), *extra, host, script), hosts=(host,))
                     for host in hosts)
    if runner == "openmpi":
        return (RemoteLaunch(argv=(program, *_openmpi_globals(ssh_port), *extra, "-n", str(len(hosts)),
                                   "--host", ",".join(hosts), "--map-by", "ppr:1:node", "sh", "-c", script),
                             hosts=hosts),)
    if runner == "mpich":
        _check_mpich_ssh_port(ssh_port)
        return (RemoteLaunch(argv=(program, "-n", str(len(hosts)), "-ppn", "1", "-hosts", ",".join(hosts),
                                   *extra, "sh", "-c", script), hosts=hosts),)
    # slurm: --overlap lets the step run beside the job's own step on the same nodes.
    _check_srun_ssh_port(ssh_port)
    return (RemoteLaunch(argv=(program, *_srun_nodes(hosts), *extra, "--overlap", "sh", "-c", script),
                         hosts=hosts),)


def agent_pid_file(job_id: str) -> str:
    """The agents' pid files of this job on one host, as a shell glob relative to the host's temporary
    folder as Python's :func:`tempfile.gettempdir` finds it (``$TMPDIR``, ``$TEMP``, ``$TMP``, else
    ``/tmp``): ``zerospeed-job-<id>-<uname -n>-n<node rank>/agent.pid``. The host's own name is part of
    the folder because hosts may share their temporary folder (a cluster's shared file system): a host
    must never read, and signal, a PID written by another host."""
    _check_job_id(job_id)
    return f'"${{TMPDIR:-${{TEMP:-${{TMP:-/tmp}}}}}}/zerospeed-job-{job_id}-$(uname -n)"-n*/agent.pid'


def stop_script(job_id: str, exports: Mapping[str, str] | None = None, *, shell_expands: bool = True) -> str:
    """A ``sh`` script that sends SIGTERM to this job's agent(s) on one host, if they still run there.

    The PID comes from the agent's own pid file; the process must still be a node agent (its command line
    names :data:`NODE_MODULE`), so a PID recycled after an agent died unclean is left alone. Exits 0 when
    there is nothing to stop. The agent found its temporary folder in the job's environment (the login
    shell's plus ``exports``), not in the login shell's alone: the script first sets the
    :data:`TEMP_VARIABLES` that ``exports`` holds, quoted as the agent's launch quoted them
    (``shell_expands``: pdsh and ssh expand ``.deepspeed_env`` values, see :func:`remote_shell`; the MPI
    runners and Slurm pass them literally)."""
    pid_file = agent_pid_file(job_id)
    temp = "".join(f"{name}={_export_value(name, exports, shell_expands=shell_expands)}; "
                   for name in TEMP_VARIABLES if exports and name in exports)
    return (f"{temp}for f in {pid_file}; do p=$(cat \"$f\" 2>/dev/null) && grep -qa {NODE_MODULE} "
            "\"/proc/$p/cmdline\" 2>/dev/null && kill -TERM \"$p\"; done; exit 0")


def remote_shell(exports: Mapping[str, str], cwd: str, argv: Sequence[str]) -> str:
    """DeepSpeed's remote command for pdsh and ssh: ``export K=V; ... cd <cwd> && exec <argv>``, every word
    quoted for a POSIX shell. ``&&`` (DeepSpeed writes ``;``) so an agent never starts in the wrong
    folder; ``exec`` so the agent is the process ssh started (its stdin, its signals).

    The values a :class:`~zerospeed.launcher.environment.ForwardedEnvironment` names in ``expand`` (the
    ``.deepspeed_env`` values) go in double quotes with only ``"``, ``\\`` and backquotes escaped, so the
    host's shell expands ``$VAR``, ``${VAR}`` and ``$(...)`` there, as DeepSpeed's pdsh command does
    (``LD_LIBRARY_PATH=/opt/nccl/lib:$LD_LIBRARY_PATH`` extends the host's own path). A literal ``$`` is
    written in single quotes in the file (``K='a$b'``), which makes the value literal. Every other value
    (the launching shell's variables, already expanded there) is single-quoted: it arrives as it was."""
    parts = [f"export {_checked_name(name)}={_export_value(name, exports, shell_expands=True)};"
             for name in exports]
    parts.append(f"cd {shlex.quote(cwd)} &&")
    parts.append("exec " + shlex.join(argv))
    return " ".join(parts)


# --- internals --------------------------------------------------------------------------------------


def _node_commands(spec: JobSpec, runner: str, *, module: str, watch_stdin: bool,
                   launcher_args: Sequence[str], ssh_port: int | None, exports: Mapping[str, str], cwd: str,
                   python: str, executable: str | None, local_environ: Mapping[str, str] | None,
                   host_by_name: bool, extra_args: tuple[str, ...] = (), tail_args: tuple[str, ...] = (),
                   per_host: bool = False) -> tuple[RemoteLaunch, ...]:
    """Shared by :func:`launches` (the node agent) and :func:`preflight_launches` (the pre-flight probe):
    the runners differ only in how the module's command reaches each host and learns which host it is.
    ``extra_args`` follow ``--job``, ``tail_args`` the host's name; ``watch_stdin`` applies to pdsh and
    ssh only; ``per_host`` runs pdsh once per host."""
    _check_runner(runner, allow_no_ssh=True)
    if runner == "no_ssh":
        return ()
    for name in exports:
        _checked_name(name)
    hosts = spec.hosts
    program = executable or _DEFAULT_EXECUTABLES[runner]
    extra = tuple(launcher_args)
    base = (python, "-u", "-m", module, f"--job={spec.encode()}", *extra_args)
    stdin = ("--watch_stdin",) if watch_stdin else ()

    def identity(node_rank: int) -> tuple[str, ...]:
        return (f"--node_host={hosts[node_rank]}",) if host_by_name else (f"--node_rank={node_rank}",)

    if runner == "pdsh":
        tail = "".join(f" {shlex.quote(word)}" for word in tail_args)
        command = _pdsh_escape(remote_shell(exports, cwd, (*base, *stdin))) + " --node_host=%h" + tail
        groups = tuple((host,) for host in hosts) if per_host else (hosts,)
        return tuple(RemoteLaunch(argv=(*_pdsh_prefix(program, group), *extra, command), hosts=group,
                                  env=_pdsh_env(ssh_port, local_environ)) for group in groups)
    if runner == "ssh":
        return tuple(
            RemoteLaunch(argv=(*_ssh_prefix(program, ssh_port), *extra, host,
                               remote_shell(exports, cwd, (*base, *stdin, *identity(rank), *tail_args))),
                         hosts=(host,))
            for rank, host in enumerate(hosts))
    if runner == "openmpi":
        contexts: list[str] = []
        for rank, host in enumerate(hosts):
            if contexts:
                contexts.append(":")
            contexts += ["-n", "1", "--host", host, "-wdir", cwd]
            for name, value in exports.items():
                contexts += ["-x", f"{name}={value}"]
            contexts += [*base, *identity(rank), *tail_args]
        return (RemoteLaunch(argv=(program, *_openmpi_globals(ssh_port), *extra, *contexts), hosts=hosts),)
    if runner == "mpich":
        _check_mpich_ssh_port(ssh_port)
        genv = [word for name, value in exports.items() for word in ("-genv", name, value)]
        return (RemoteLaunch(argv=(program, "-n", str(len(hosts)), "-ppn", "1", "-hosts", ",".join(hosts),
                                   *extra, *genv, "-wdir", cwd, *base, *tail_args), hosts=hosts),)
    # slurm: srun runs no shell, so the node name comes from a small one.
    _check_srun_ssh_port(ssh_port)
    export, env = _slurm_export(exports)
    script = "exec " + shlex.join(base) + ' --node_host="$SLURMD_NODENAME"' + "".join(
        f" {shlex.quote(word)}" for word in tail_args)
    return (RemoteLaunch(argv=(program, *_srun_nodes(hosts), *extra, "--kill-on-bad-exit=1", f"--chdir={cwd}",
                               export, "sh", "-c", script), hosts=hosts, env=env),)


def _check_runner(runner: str, *, allow_no_ssh: bool) -> None:
    choices = RUNNERS if allow_no_ssh else LAUNCHERS
    if runner not in choices:
        raise LauncherError(f"unknown launcher {runner!r}; choose one of {', '.join(choices)}")


def _checked_name(name: str) -> str:
    if not (name and (name[0].isalpha() or name[0] == "_") and all(c.isalnum() or c == "_" for c in name)
            and name.isascii()):
        raise LauncherError(f"cannot export variable {name!r} to the hosts: not a shell variable name")
    return name


def _export_value(name: str, exports: Mapping[str, str], *, shell_expands: bool) -> str:
    """``exports[name]`` as shell text: in double quotes (``"``, ``\\`` and backquotes escaped) for the
    shell to expand when ``shell_expands`` and ``exports`` marks it (:func:`remote_shell`), else quoted
    to arrive literally."""
    value = exports[name]
    if shell_expands and isinstance(exports, ForwardedEnvironment) and name in exports.expand:
        return '"' + re.sub(r'(["\\`])', r"\\\1", value) + '"'
    return shlex.quote(value)


def _check_job_id(job_id: str) -> None:
    if not (job_id and job_id.isascii() and all(c.isalnum() or c in "-_" for c in job_id)):
        raise LauncherError(f"job id {job_id!r} must be letters, digits, '-' and '_' only")


def _pdsh_prefix(program: str, hosts: Sequence[str]) -> tuple[str, ...]:
    return (program, "-S", "-f", str(PDSH_MAX_FAN_OUT), "-R", "ssh", "-w", ",".join(hosts))


def _pdsh_escape(text: str) -> str:
    """pdsh substitutes ``%h``, ``%u``, ``%n`` in the remote command; a literal ``%`` is ``%%``."""
    return text.replace("%", "%%")


def _pdsh_env(ssh_port: int | None, local_environ: Mapping[str, str] | None, *,
              options: Sequence[str] = SSH_OPTIONS) -> Mapping[str, str]:
    """pdsh's ssh module takes extra ssh options from ``PDSH_SSH_ARGS_APPEND`` (the user's value first,
    as DeepSpeed keeps it); ``PDSH_RCMD_TYPE=ssh`` as DeepSpeed sets it (``-R ssh`` says the same)."""
    words = [*options, *_ssh_port(ssh_port)]
    user = (local_environ or {}).get("PDSH_SSH_ARGS_APPEND", "").strip()
    append = " ".join([user, *words] if user else words)
    return MappingProxyType({"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": append})


def _ssh_prefix(program: str, ssh_port: int | None) -> tuple[str, ...]:
    return (program, *SSH_OPTIONS, *_ssh_port(ssh_port))


def _ssh_port(ssh_port: int | None) -> tuple[str, ...]:
    return ("-p", str(ssh_port)) if ssh_port is not None else ()


def _openmpi_globals(ssh_port: int | None) -> tuple[str, ...]:
    """Open MPI starts its daemons over ssh; a port goes to it through ``plm_rsh_args``."""
    return ("--mca", "plm_rsh_args", f"-p {ssh_port}") if ssh_port is not None else ()


def _check_srun_ssh_port(ssh_port: int | None) -> None:
    if ssh_port is not None:
        raise LauncherError(
            f"--ssh_port {ssh_port} has no meaning under --launcher slurm (srun reaches the hosts through "
            "slurmd, not ssh); leave it out, or use --launcher pdsh, ssh or openmpi"
        )


def _check_mpich_ssh_port(ssh_port: int | None) -> None:
    if ssh_port is not None:
        raise LauncherError(
            f"--ssh_port {ssh_port} cannot be passed to MPICH's hydra (it has no option for ssh arguments); "
            "set 'Port' for these hosts in ~/.ssh/config instead, or use --launcher pdsh, ssh or openmpi"
        )


def _srun_nodes(hosts: Sequence[str]) -> tuple[str, ...]:
    count = str(len(hosts))
    return (f"--nodes={count}", f"--ntasks={count}", "--ntasks-per-node=1", f"--nodelist={','.join(hosts)}")


def _slurm_export(exports: Mapping[str, str]) -> tuple[str, Mapping[str, str]]:
    """``--export=ALL,K=V,...``; srun splits the list at commas, so a value holding one is named only
    (``K``: srun then takes its value from its own environment, which the returned mapping sets)."""
    items = ["ALL"]
    env: dict[str, str] = {}
    for name, value in exports.items():
        if "," in value:
            items.append(name)
            env[name] = value
        else:
            items.append(f"{name}={value}")
    return "--export=" + ",".join(items), MappingProxyType(env)
