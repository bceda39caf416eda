"""Hostfiles and DeepSpeed-style ``--include`` / ``--exclude`` strings, as pure functions.

A hostfile lists the machines of a job, one ``<hostname> slots=<count>`` per line (MPI style, the
format DeepSpeed reads); ``#`` starts a comment and blank lines are ignored. A filter string selects
slots on those hosts: ``NODE[@NODE...]`` with ``NODE = host[:slot[,slot...]]``; a host without a slot
list means all of its slots.

Everything here is a function from text to values so it can be tested without processes; errors are
:class:`HostfileError` / :class:`ResourceFilterError` with messages that say where and how to fix.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from pathlib import Path

from zerospeed.launcher.errors import HostfileError, ResourceFilterError

__all__ = [
    "LOCALHOST",
    "check_filter",
    "local_resources",
    "parse_hostfile",
    "parse_inclusion_exclusion",
    "read_hostfile",
]

LOCALHOST = "localhost"
_TEXT_SOURCE = "<hostfile text>"
_SLOTS_KEY = "slots="
_MAX_SLOTS_KEY = "max_slots="
# Characters with a meaning in include/exclude strings or in the hostfile syntax itself.
_RESERVED_HOST_CHARS = frozenset("@:,=#")


def local_resources(slots: int) -> dict[str, int]:
    """The resource pool used without a hostfile: this machine, named ``localhost``."""
    if slots < 1:
        raise ResourceFilterError(f"the local machine needs at least 1 slot, got {slots}")
    return {LOCALHOST: slots}


def read_hostfile(path: str | os.PathLike[str]) -> dict[str, int]:
    """Read and parse the hostfile at ``path``; a missing file is a user error, not a traceback."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise HostfileError(
            f"hostfile {str(file)!r} does not exist; pass an existing --hostfile, or omit --hostfile "
            "to run on this machine only"
        ) from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise HostfileError(f"cannot read hostfile {str(file)!r}: {exc}") from None
    return parse_hostfile(text, source=str(file))


def parse_hostfile(
    hostfile: str | os.PathLike[str], *, source: str | None = None
) -> dict[str, int]:
    """Parse hostfile text (a ``str``) or a hostfile path (a ``PathLike``) into ``host -> slots``.

    The result keeps file order, because rank numbering follows it. ``source`` names the text in
    error messages (defaults to the path, or ``<hostfile text>``).
    """
    if isinstance(hostfile, os.PathLike):
        return read_hostfile(hostfile)
    where = source or _TEXT_SOURCE
    resources: dict[str, int] = {}
    first_seen: dict[str, int] = {}
    for lineno, raw in enumerate(hostfile.splitlines(), start=1):
        entry = raw.split("#", 1)[0].strip()
        if not entry:
            continue
        host, slots = _parse_entry(entry, raw.strip(), f"{where}:{lineno}")
        if host in resources:
            raise HostfileError(
                f"{where}:{lineno}: host {host!r} is listed twice (first on line {first_seen[host]}); "
                "keep one line per host with its total slot count"
            )
        resources[host] = slots
        first_seen[host] = lineno
    if not resources:
        raise HostfileError(
            f"{where}: no hosts found; add one line per machine like 'worker-1 slots=4'"
        )
    return resources


def _parse_entry(entry: str, line: str, where: str) -> tuple[str, int]:
    """Split one non-comment hostfile line into ``(host, slots)`` or explain what is wrong."""
    tokens = entry.split()
    host = tokens[0]
    expected = "expected '<hostname> slots=<count>' (e.g. 'worker-1 slots=4')"
    if len(tokens) == 1:
        raise HostfileError(f"{where}: host {host!r} has no 'slots=<count>'; {expected}, got {line!r}")
    extra_ok = all(t.startswith(_MAX_SLOTS_KEY) for t in tokens[2:])  # Open MPI's max_slots is harmless
    if not extra_ok or not tokens[1].startswith(_SLOTS_KEY):
        raise HostfileError(f"{where}: {expected}, got {line!r}")
    bad = sorted(_RESERVED_HOST_CHARS.intersection(host))
    if bad or host.startswith("-"):
        raise HostfileError(
            f"{where}: invalid hostname {host!r} (it must not start with '-' or contain any of "
            f"{' '.join(sorted(_RESERVED_HOST_CHARS))}); {expected}"
        )
    value = tokens[1][len(_SLOTS_KEY):]
    if not (value.isascii() and value.isdigit()) or int(value) < 1:
        raise HostfileError(
            f"{where}: slots for host {host!r} must be a positive integer, got {value!r}; "
            f"write e.g. '{host} slots=4'"
        )
    return host, int(value)


def parse_inclusion_exclusion(
    resources: Mapping[str, int], include: str | None = None, exclude: str | None = None
) -> dict[str, list[int]]:
    """Select slot ids from ``resources`` (``host -> slot count``) with DeepSpeed's filter syntax.

    ``include`` keeps only the named hosts/slots, ``exclude`` drops them (a bare host drops the
    whole host); at most one of them may be given. The result maps each remaining host, in
    ``resources`` order, to its sorted slot ids. Filters that name unknown hosts or slots, or leave
    nothing to run on, are errors rather than silently shrinking the job.
    """
    include = include or ""
    exclude = exclude or ""
    if include and exclude:
        raise _both_filters(include, exclude)
    selected = {host: list(range(slots)) for host, slots in resources.items()}
    if not include and not exclude:
        return selected
    flag, text = ("--include", include) if include else ("--exclude", exclude)
    requested = _parse_filter(text, flag, resources)
    result: dict[str, list[int]] = {}
    if include:
        for host in resources:
            if host in requested:
                wanted = requested[host]  # None: the whole host
                result[host] = list(range(resources[host])) if wanted is None else wanted
    else:
        for host, slots in selected.items():
            dropped = requested.get(host, [])
            if dropped is None:
                continue
            kept = [slot for slot in slots if slot not in dropped]
            if kept:
                result[host] = kept
        if not result:
            raise _nothing_left(exclude)
    return {host: sorted(slots) for host, slots in result.items()}


def check_filter(include: str | None, exclude: str | None, hosts: Collection[str]) -> None:
    """Reject an ``--include``/``--exclude`` that is wrong whatever each host's slot count: both given,
    bad syntax, a host not in ``hosts``, an exclude of every host whole.

    The launcher calls it before it counts CUDA devices to size this machine's pool (which imports
    torch: seconds on a busy machine), so a malformed filter is refused at once; the slot ids are
    checked against the counts by :func:`parse_inclusion_exclusion` afterwards.
    """
    include = include or ""
    exclude = exclude or ""
    if include and exclude:
        raise _both_filters(include, exclude)
    if not include and not exclude:
        return
    flag, text = ("--include", include) if include else ("--exclude", exclude)
    requested = _parse_filter(text, flag, dict.fromkeys(hosts))
    if exclude and all(host in requested and requested[host] is None for host in hosts):
        raise _nothing_left(exclude)


def _both_filters(include: str, exclude: str) -> ResourceFilterError:
    return ResourceFilterError(
        f"--include {include!r} and --exclude {exclude!r} are mutually exclusive; use only one"
    )


def _nothing_left(exclude: str) -> ResourceFilterError:
    return ResourceFilterError(
        f"--exclude {exclude!r} removes every slot on every host; nothing is left to run on"
    )


def _parse_filter(
    text: str, flag: str, resources: Mapping[str, int | None]
) -> dict[str, list[int] | None]:
    """Parse ``host[:s,s]@host...`` into ``host -> slots`` (``None`` = the whole host), validated
    (slot ids against the host's count, unless that is ``None``: not known yet)."""
    requested: dict[str, list[int] | None] = {}
    for part in text.split("@"):
        node = part.strip()
        if not node:
            raise ResourceFilterError(
                f"{flag} {text!r} has an empty host entry; separate hosts with a single '@', "
                "e.g. 'worker-0@worker-1:0,1'"
            )
        host, sep, slot_text = node.partition(":")
        host = host.strip()
        if not host:
            raise ResourceFilterError(f"{flag} {text!r}: {node!r} has no hostname before ':'")
        if host not in resources:
            known = ", ".join(resources) or "(none)"
            raise ResourceFilterError(
                f"{flag} {text!r}: unknown host {host!r}; available hosts: {known}"
            )
        slots = _parse_slots(slot_text, host, flag, text, resources[host]) if sep else None
        previous = requested.get(host, [])
        if slots is None or previous is None:
            requested[host] = None
        else:
            requested[host] = sorted(set(previous) | set(slots))
    return requested


def _parse_slots(slot_text: str, host: str, flag: str, text: str, count: int | None) -> list[int]:
    """Parse ``0,2,3`` for one host and check every id is below the host's slot count (if known)."""
    items = [item.strip() for item in slot_text.split(",")]
    if not slot_text.strip() or any(not item for item in items):
        raise ResourceFilterError(
            f"{flag} {text!r}: host {host!r} has an empty slot list; write e.g. '{host}:0,1' "
            f"or just '{host}' for all of its slots"
        )
    slots: list[int] = []
    for item in items:
        if not (item.isascii() and item.isdigit()):
            raise ResourceFilterError(
                f"{flag} {text!r}: slot {item!r} on host {host!r} is not a non-negative integer"
            )
        slot = int(item)
        if count is not None and slot >= count:
            raise ResourceFilterError(
                f"{flag} {text!r}: slot {slot} on host {host!r} is out of range; "
                f"{host!r} has {count} slot{'s' if count != 1 else ''} (ids 0..{count - 1})"
            )
        slots.append(slot)
    return slots
