"""Test selection: ``make test-fast`` runs what needs no extra process (``-m "not spawns"``).

A test module that starts processes (the gloo harness ``run_distributed``, the launcher, a benchmark
or example script through ``subprocess``) has all its tests marked ``spawns``; such tests are most of
the suite's time.
"""

from __future__ import annotations

import pytest

_SPAWNING_NAMES = ("run_distributed", "subprocess")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "spawns: starts processes (ranks, the launcher, scripts); "
                                       "left out by make test-fast")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and any(hasattr(module, name) for name in _SPAWNING_NAMES):
            item.add_marker(pytest.mark.spawns)
