"""benchmarks/_netns.py, the namespace plumbing of bench_comm_compression.py: a rate-limited veth pair between
two namespaces really limits a TCP transfer, everything it made is gone afterwards, a dead run's leftovers
are found by name and removed, and signals reach ``finally``. Skipped where namespaces cannot be made."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import _netns  # noqa: E402

pytestmark = pytest.mark.spawns  # `ip`, `tc` and two python processes per transfer


def _require_netns() -> None:
    try:
        _netns.check_available()
    except _netns.NetnsUnavailable as exc:
        pytest.skip(f"network namespaces not available: {exc}")


def _dead_pid() -> int:
    """A pid no process has now (a child we started and reaped)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_rate_limited_link_limits_and_is_removed() -> None:
    _require_netns()
    try:
        with _netns.veth_link(rate_mbit=50) as link:
            names = {e.netns for e in link.ends}
            assert names <= set(_netns.list_namespaces())
            limited = _netns.measure_throughput(link, int(50e6 / 8 * 0.4)) / 1e6
            assert 30 < limited < 55, f"50 Mbit/s link measured {limited:.1f} Mbit/s"
            _netns.set_rate(link, None)
            free = _netns.measure_throughput(link, 20 * 2**20) / 1e6
            assert free > 2 * limited, f"unshaped link measured {free:.1f} Mbit/s, shaped {limited:.1f}"
    except _netns.NetnsUnavailable as exc:  # e.g. a container without CAP_NET_ADMIN
        pytest.skip(f"network namespaces not permitted: {exc}")
    assert not names & set(_netns.list_namespaces())
    assert not {e.ifname for e in link.ends} & set(_netns.list_root_links())


def test_leftover_of_a_dead_run_is_removed() -> None:
    _require_netns()
    stale = f"{_netns.PREFIX}-{_dead_pid()}-00-0"
    try:
        _netns._run(["ip", "netns", "add", stale])
    except _netns.NetnsUnavailable as exc:
        pytest.skip(f"network namespaces not permitted: {exc}")
    try:
        assert stale in _netns.ours(_netns.list_namespaces())
        assert stale in _netns.remove_leftovers()
        assert stale not in _netns.list_namespaces()
    finally:
        if stale in _netns.list_namespaces():
            _netns._run(["ip", "netns", "delete", stale])


def test_unavailable_without_ip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_netns.shutil, "which", lambda tool: None)
    with pytest.raises(_netns.NetnsUnavailable, match="ip and tc not found"):
        _netns.check_available()


def test_sigterm_becomes_an_exception_then_handler_restored() -> None:
    before = signal.getsignal(signal.SIGTERM)
    reached_finally = False
    with pytest.raises(_netns.Interrupted, match="SIGTERM"):
        with _netns.signals_as_exceptions():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
            finally:
                reached_finally = True
    assert reached_finally
    assert signal.getsignal(signal.SIGTERM) == before
