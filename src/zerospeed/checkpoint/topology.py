"""Which ranks take part in a checkpoint, and how this rank's parameters are split among them.

Without tensor parallelism the engine's data-parallel ``comm`` is every rank, and a checkpoint runs
its handshake, names its files and agrees on failures over it, as before. With tensor parallelism
the data-parallel group is one of several (one per tensor-parallel rank), yet all of them write one
checkpoint: the save and the load then run over a :class:`Comm` of every rank, with a checkpoint id
they agree on, and the model's :class:`TPLayout` says which parameters are slices (stored as parts)
and which are replicated (stored by tensor-parallel rank 0 only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from zerospeed.checkpoint.layout import CheckpointError
from zerospeed.distributed.comm import Comm
from zerospeed.tensor_parallel.layout import TPLayout, tp_layout

if TYPE_CHECKING:
    from zerospeed.checkpoint.contract import CheckpointedEngine


@dataclass(frozen=True)
class CheckpointTopology:
    """``comm``: every rank writing (or reading) the checkpoint; ``checkpoint_id``: the same on all of them."""

    comm: Comm
    layout: TPLayout
    checkpoint_id: str

    @property
    def tp_degree(self) -> int:
        return self.layout.degree


def checkpoint_topology(engine: CheckpointedEngine) -> CheckpointTopology:
    """The topology of ``engine``'s checkpoints (collective when tensor parallelism is on: every rank calls it)."""
    tp = engine.mesh.comm("tp")
    layout = tp_layout(engine.module, tp.world_size, tp.rank)
    if layout.degree != tp.world_size:
        raise CheckpointError(f"the model's tensor-parallel layers are split over {layout.degree} ranks but the "
                              f"engine's tensor-parallel group has {tp.world_size}; build the layers with the mesh's "
                              f"tp group (mesh.comm('tp')) and pass that mesh to zerospeed.initialize")
    if layout.degree == 1:
        return CheckpointTopology(engine.comm, layout, engine.checkpoint_id)
    if engine.mesh.dims.pp > 1:  # the world would hold several stages' different parameters
        raise CheckpointError(f"checkpoints of runs with both tensor and pipeline parallelism (pp="
                              f"{engine.mesh.dims.pp}) are not supported yet; run with pp=1, or save the "
                              f"weights with save_16bit_model")
    comm = Comm(name="checkpoint", timeout=engine.comm.timeout)  # the world: dp x tp
    # the engine agreed on its id over its data-parallel group only: take global rank 0's
    return CheckpointTopology(comm, layout, comm.all_gather_object(engine.checkpoint_id)[0])


__all__ = ["CheckpointTopology", "checkpoint_topology"]
