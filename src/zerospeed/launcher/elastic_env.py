"""What the node agent tells restarted workers of an elastic job, and the line the engine logs from it.

On every worker restart (a rank failed, a host was lost, or a host joined) the node agent
(:mod:`zerospeed.launcher.node`) sets, in the new workers' environment,

- :data:`LOST_AT_VARIABLE`: the Unix time at which the agent saw the failure or the membership change
  (its monitor loop polls every 0.1 s, so this is within that of the workers' exit);
- :data:`RESTART_COUNT_VARIABLE`: how many restarts this agent has made (membership changes included,
  unlike torch's ``TORCHELASTIC_RESTART_COUNT``, which counts failures only).

The engine reads them once and, at the first optimizer step of the process, logs
:func:`restart_message` on global rank 0: the downtime an operator cares about (host lost -> training
again). A separate module so the engine imports neither torch's elastic agent nor the launcher.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["LOST_AT_VARIABLE", "RESTART_COUNT_VARIABLE", "ElasticRestart", "restart_message"]

LOST_AT_VARIABLE = "ZEROSPEED_ELASTIC_LOST_AT"
RESTART_COUNT_VARIABLE = "ZEROSPEED_ELASTIC_RESTART_COUNT"


@dataclass(frozen=True)
class ElasticRestart:
    """This process was started by an elastic restart: the ``count``-th, after a loss seen at ``lost_at``."""

    count: int
    lost_at: float

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> ElasticRestart | None:
        """The restart this process belongs to; ``None`` for a first start (or values we did not write)."""
        raw = environ.get(LOST_AT_VARIABLE)
        if not raw:
            return None
        try:
            return cls(count=int(environ.get(RESTART_COUNT_VARIABLE, "0")), lost_at=float(raw))
        except ValueError:
            return None


def restart_message(restart: ElasticRestart, *, world_size: int, now: float) -> str:
    """The one line the engine logs at the first step after a restart."""
    return (f"zerospeed: elastic restart {restart.count}: {world_size} ranks, downtime "
            f"{now - restart.lost_at:.1f} s (host lost -> first step)")
