"""Test selection: ``make test-fast`` runs what needs no extra process plus a few smoke tests
(``-m "not spawns or smoke"``).

A test module whose source names a way to start processes (the gloo harness ``run_distributed``,
``subprocess`` for the launcher, a benchmark or an example script; imported at the top or inside a
test) has all its tests marked ``spawns``; such tests are most of the suite's time. A handful of quick
2-rank tests are also marked ``smoke`` (in their modules) so the fast lane still runs real ranks:
a stage-2 parity case, a checkpoint round trip, a skipped step agreed across ranks.
"""

from __future__ import annotations

import pytest

_SPAWNING_NAMES = ("run_distributed", "subprocess")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "spawns: starts processes (ranks, the launcher, scripts); "
                                       "left out by make test-fast unless also marked smoke")
    config.addinivalue_line("markers", "smoke: a quick multi-rank test make test-fast runs although it spawns")
    config.addinivalue_line("markers", "cluster: runs on the namespace test cluster (zerospeed.testing.cluster: root, "
                                       "network namespaces, sshd, pdsh, MPI, Slurm); the `make test-cluster` lane")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    spawning: dict[str, bool] = {}  # by module file: its source names a way to start processes
    for item in items:
        path = str(item.path)
        if path not in spawning:
            source = item.path.read_text(encoding="utf-8")
            spawning[path] = any(name in source for name in _SPAWNING_NAMES)
        if spawning[path]:
            item.add_marker(pytest.mark.spawns)


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    """A test that starts the default process group in the pytest process (``initialize`` or
    ``init_inference`` run in-process start a 1-rank group) must not leave it to the next test:
    code that reads the world size (``PipelineModule``, the mesh) would see 1 instead of no group."""
    import os

    import torch.distributed as dist

    had_group = dist.is_available() and dist.is_initialized()
    environ = dict(os.environ)
    yield
    if not had_group and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
