"""Which ranks take part in a checkpoint, and what of the model this rank writes.

With data parallelism alone the engine's data-parallel ``comm`` is every rank, and a checkpoint runs
its handshake, names its files and agrees on failures over it, as before. With tensor or pipeline
parallelism the data-parallel group is one of several (one per tensor-parallel rank and pipeline
stage), yet all of them write one checkpoint: the save and the load then run over a :class:`Comm` of
every rank, with a checkpoint id they agree on, so one commit (and one ``latest``) covers the whole job
and a failure anywhere leaves the previous checkpoint in place.

Every stored value is written by exactly one rank: the model's :class:`TPLayout` says which
parameters are slices (stored as parts by each tensor-parallel rank) and which are replicated (stored
by tensor-parallel rank 0 only); a tied pipeline module is stored by its lowest stage only
(:meth:`PipelineModule.tied_copies_below`); buffers by data- and tensor-parallel rank 0 of each stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from zerospeed.checkpoint.layout import CheckpointError
from zerospeed.distributed.comm import Comm
from zerospeed.pipe.module import PipelineModule
from zerospeed.tensor_parallel.layout import TPLayout, tp_layout

if TYPE_CHECKING:
    from zerospeed.checkpoint.contract import CheckpointedEngine


@dataclass(frozen=True)
class CheckpointTopology:
    """``comm``: every rank writing (or reading) the checkpoint; ``checkpoint_id``: the same on all of them;
    ``held_elsewhere``: this rank's parameter and buffer names whose values another rank stores (tied
    copies of a lower stage); ``writes_buffers``: whether this rank stores its (other) buffers."""

    comm: Comm
    layout: TPLayout
    checkpoint_id: str
    pipeline_degree: int = 1
    held_elsewhere: frozenset[str] = frozenset()
    writes_buffers: bool = True

    @property
    def tp_degree(self) -> int:
        return self.layout.degree


def checkpoint_topology(engine: CheckpointedEngine) -> CheckpointTopology:
    """The topology of ``engine``'s checkpoints (collective when tensor or pipeline parallelism is on:
    every rank calls it)."""
    tp = engine.mesh.comm("tp")
    layout = tp_layout(engine.module, tp.world_size, tp.rank)
    if layout.degree != tp.world_size:
        raise CheckpointError(f"the model's tensor-parallel layers are split over {layout.degree} ranks but the "
                              f"engine's tensor-parallel group has {tp.world_size}; build the layers with the mesh's "
                              f"tp group (mesh.comm('tp')) and pass that mesh to zerospeed.initialize")
    pp = engine.mesh.dims.pp
    held_elsewhere = engine.module.tied_copies_below() if isinstance(engine.module, PipelineModule) else frozenset()
    writes_buffers = engine.comm.rank == 0 and tp.rank == 0
    if layout.degree == 1 and pp == 1:
        return CheckpointTopology(engine.comm, layout, engine.checkpoint_id, pp, held_elsewhere, writes_buffers)
    comm = Comm(name="checkpoint", timeout=engine.comm.timeout)  # the world: pp x dp x tp
    # the engine agreed on its id over its data-parallel group only: take global rank 0's
    return CheckpointTopology(comm, layout, comm.all_gather_object(engine.checkpoint_id)[0], pp, held_elsewhere,
                              writes_buffers)


__all__ = ["CheckpointTopology", "checkpoint_topology"]
