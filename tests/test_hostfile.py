"""Hostfile and --include/--exclude parsing: exact values and exact error messages."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zerospeed.launcher import (
    HostfileError,
    LauncherError,
    ResourceFilterError,
    parse_hostfile,
    parse_inclusion_exclusion,
    read_hostfile,
)
from zerospeed.launcher.hostfile import local_resources

HOSTFILE = """\
# two workers
worker-0 slots=4

worker-1 slots=2   # the small one
\t# indented comment
"""


# --- parse_hostfile -------------------------------------------------------------------------


def test_parse_hostfile_keeps_order_and_skips_comments_and_blank_lines() -> None:
    resources = parse_hostfile(HOSTFILE)
    assert resources == {"worker-0": 4, "worker-1": 2}
    assert list(resources) == ["worker-0", "worker-1"]


def test_parse_hostfile_order_is_file_order_not_sorted() -> None:
    assert list(parse_hostfile("b slots=1\na slots=1\n")) == ["b", "a"]


def test_parse_hostfile_accepts_tabs_and_no_trailing_newline() -> None:
    assert parse_hostfile("node7\tslots=16") == {"node7": 16}


def test_parse_hostfile_from_path(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text(HOSTFILE)
    assert parse_hostfile(path) == {"worker-0": 4, "worker-1": 2}
    assert read_hostfile(str(path)) == {"worker-0": 4, "worker-1": 2}


def test_hostfile_errors_are_launcher_errors() -> None:
    assert issubclass(HostfileError, LauncherError)
    assert issubclass(ResourceFilterError, LauncherError)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "worker-0 slots=4\nworker-1\n",
            "<hostfile text>:2: host 'worker-1' has no 'slots=<count>'; expected '<hostname> "
            "slots=<count>' (e.g. 'worker-1 slots=4'), got 'worker-1'",
        ),
        (
            "worker-0 gpus=4\n",
            "<hostfile text>:1: expected '<hostname> slots=<count>' (e.g. 'worker-1 slots=4'), "
            "got 'worker-0 gpus=4'",
        ),
        (
            "worker-0 slots=4 gpus=8\n",
            "<hostfile text>:1: expected '<hostname> slots=<count>' (e.g. 'worker-1 slots=4'), "
            "got 'worker-0 slots=4 gpus=8'",
        ),
        (
            "# c\n\nworker-0 slots=0\n",
            "<hostfile text>:3: slots for host 'worker-0' must be a positive integer, got '0'; "
            "write e.g. 'worker-0 slots=4'",
        ),
        (
            "worker-0 slots=-2\n",
            "<hostfile text>:1: slots for host 'worker-0' must be a positive integer, got '-2'; "
            "write e.g. 'worker-0 slots=4'",
        ),
        (
            "worker-0 slots=four\n",
            "<hostfile text>:1: slots for host 'worker-0' must be a positive integer, got 'four'; "
            "write e.g. 'worker-0 slots=4'",
        ),
        (
            "worker-0 slots=\n",
            "<hostfile text>:1: slots for host 'worker-0' must be a positive integer, got ''; "
            "write e.g. 'worker-0 slots=4'",
        ),
        (
            "worker-0 slots=4\nworker-1 slots=2\nworker-0 slots=4  # again\n",
            "<hostfile text>:3: host 'worker-0' is listed twice (first on line 1); keep one line "
            "per host with its total slot count",
        ),
        (
            "# only comments\n\n",
            "<hostfile text>: no hosts found; add one line per machine like 'worker-1 slots=4'",
        ),
        (
            "",
            "<hostfile text>: no hosts found; add one line per machine like 'worker-1 slots=4'",
        ),
        (
            "a@b slots=2\n",
            "<hostfile text>:1: invalid hostname 'a@b' (it must not start with '-' or contain any "
            "of # , : = @); expected '<hostname> slots=<count>' (e.g. 'worker-1 slots=4')",
        ),
    ],
)
def test_parse_hostfile_errors(text: str, message: str) -> None:
    with pytest.raises(HostfileError) as info:
        parse_hostfile(text)
    assert str(info.value) == message


def test_hostfile_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("worker-0 slots=4\nworker-1 slots=x\n")
    with pytest.raises(HostfileError, match=re.escape(f"{path}:2: slots for host 'worker-1'")):
        read_hostfile(path)


def test_missing_hostfile(tmp_path: Path) -> None:
    path = tmp_path / "nope"
    with pytest.raises(HostfileError) as info:
        read_hostfile(path)
    assert str(info.value) == (
        f"hostfile {str(path)!r} does not exist; pass an existing --hostfile, or omit --hostfile "
        "to run on this machine only"
    )


def test_local_resources() -> None:
    assert local_resources(3) == {"localhost": 3}
    with pytest.raises(ResourceFilterError):
        local_resources(0)


# --- parse_inclusion_exclusion --------------------------------------------------------------

POOL = {"worker-0": 4, "worker-1": 4, "worker-2": 2}


def test_no_filter_selects_everything() -> None:
    assert parse_inclusion_exclusion(POOL) == {
        "worker-0": [0, 1, 2, 3],
        "worker-1": [0, 1, 2, 3],
        "worker-2": [0, 1],
    }
    assert parse_inclusion_exclusion(POOL, "", "") == parse_inclusion_exclusion(POOL)


@pytest.mark.parametrize(
    ("include", "expected"),
    [
        ("worker-1", {"worker-1": [0, 1, 2, 3]}),
        ("worker-1:0,2", {"worker-1": [0, 2]}),
        ("worker-0@worker-1:0,2", {"worker-0": [0, 1, 2, 3], "worker-1": [0, 2]}),
        # Result follows hostfile order, not the order in the string; slots are sorted, deduplicated.
        ("worker-2:1@worker-0:3,1,3", {"worker-0": [1, 3], "worker-2": [1]}),
        # The same host twice merges its slots; the whole host wins over a slot list.
        ("worker-1:0@worker-1:3", {"worker-1": [0, 3]}),
        ("worker-1:0@worker-1", {"worker-1": [0, 1, 2, 3]}),
        (" worker-2 : 0 ", {"worker-2": [0]}),
    ],
)
def test_include(include: str, expected: dict[str, list[int]]) -> None:
    result = parse_inclusion_exclusion(POOL, include=include)
    assert result == expected
    assert list(result) == list(expected)


@pytest.mark.parametrize(
    ("exclude", "expected"),
    [
        ("worker-1", {"worker-0": [0, 1, 2, 3], "worker-2": [0, 1]}),
        ("worker-1:0,2", {"worker-0": [0, 1, 2, 3], "worker-1": [1, 3], "worker-2": [0, 1]}),
        ("worker-0@worker-2:1", {"worker-1": [0, 1, 2, 3], "worker-2": [0]}),
        # Excluding all slots of a host removes the host.
        ("worker-2:0,1", {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}),
    ],
)
def test_exclude(exclude: str, expected: dict[str, list[int]]) -> None:
    assert parse_inclusion_exclusion(POOL, exclude=exclude) == expected


def test_localhost_pool() -> None:
    pool = local_resources(4)
    assert parse_inclusion_exclusion(pool, include="localhost:1,3") == {"localhost": [1, 3]}
    assert parse_inclusion_exclusion(pool, exclude="localhost:0") == {"localhost": [1, 2, 3]}


@pytest.mark.parametrize(
    ("include", "exclude", "message"),
    [
        (
            "worker-0",
            "worker-1",
            "--include 'worker-0' and --exclude 'worker-1' are mutually exclusive; use only one",
        ),
        (
            "worker-9:0",
            None,
            "--include 'worker-9:0': unknown host 'worker-9'; available hosts: worker-0, "
            "worker-1, worker-2",
        ),
        (
            None,
            "worker-9",
            "--exclude 'worker-9': unknown host 'worker-9'; available hosts: worker-0, "
            "worker-1, worker-2",
        ),
        (
            "worker-2:2",
            None,
            "--include 'worker-2:2': slot 2 on host 'worker-2' is out of range; 'worker-2' has 2 "
            "slots (ids 0..1)",
        ),
        (
            None,
            "worker-0:4",
            "--exclude 'worker-0:4': slot 4 on host 'worker-0' is out of range; 'worker-0' has 4 "
            "slots (ids 0..3)",
        ),
        (
            "worker-0:a",
            None,
            "--include 'worker-0:a': slot 'a' on host 'worker-0' is not a non-negative integer",
        ),
        (
            "worker-0:-1",
            None,
            "--include 'worker-0:-1': slot '-1' on host 'worker-0' is not a non-negative integer",
        ),
        (
            "worker-0:",
            None,
            "--include 'worker-0:': host 'worker-0' has an empty slot list; write e.g. "
            "'worker-0:0,1' or just 'worker-0' for all of its slots",
        ),
        (
            "worker-0:0,,1",
            None,
            "--include 'worker-0:0,,1': host 'worker-0' has an empty slot list; write e.g. "
            "'worker-0:0,1' or just 'worker-0' for all of its slots",
        ),
        (
            "worker-0@@worker-1",
            None,
            "--include 'worker-0@@worker-1' has an empty host entry; separate hosts with a single "
            "'@', e.g. 'worker-0@worker-1:0,1'",
        ),
        ("@", None, "--include '@' has an empty host entry; separate hosts with a single '@', "
         "e.g. 'worker-0@worker-1:0,1'"),
        (":0", None, "--include ':0': ':0' has no hostname before ':'"),
        (
            None,
            "worker-0@worker-1@worker-2:0,1",
            "--exclude 'worker-0@worker-1@worker-2:0,1' removes every slot on every host; nothing "
            "is left to run on",
        ),
    ],
)
def test_filter_errors(include: str | None, exclude: str | None, message: str) -> None:
    with pytest.raises(ResourceFilterError) as info:
        parse_inclusion_exclusion(POOL, include, exclude)
    assert str(info.value) == message


def test_filter_does_not_mutate_resources() -> None:
    pool = dict(POOL)
    parse_inclusion_exclusion(pool, exclude="worker-0:1")
    assert pool == POOL


def test_open_mpi_max_slots_is_accepted_and_ignored() -> None:
    assert dict(parse_hostfile("w1 slots=4 max_slots=8\nw2 slots=2\n")) == {"w1": 4, "w2": 2}
    with pytest.raises(HostfileError, match="expected '<hostname> slots=<count>'"):
        parse_hostfile("w1 slots=4 gpus=8\n")
