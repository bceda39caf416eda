"""What saving and loading a checkpoint needs of a live engine.

``checkpoint/`` sits below ``engine.py`` (it must not import it), so it states here what it reads
and which public calls it makes; :class:`zerospeed.engine.Engine` satisfies it. The model's training
state itself is reached through the :class:`~zerospeed.zero.contract.ModelState` contract.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from zerospeed.checkpoint.layout import SaveLocks
from zerospeed.config import Config
from zerospeed.data.loader import DistributedLoader
from zerospeed.distributed.comm import Comm
from zerospeed.distributed.mesh import Mesh
from zerospeed.precision.loss_scale import LossScaler
from zerospeed.zero.contract import ModelState


class CheckpointedEngine(Protocol):
    """The engine as ``save_checkpoint`` / ``load_checkpoint`` / ``save_16bit_model`` use it."""

    comm: Comm
    #: every group of the job; checkpoints read its tensor-parallel one (see ``checkpoint/topology.py``)
    mesh: Mesh
    config: Config
    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    lr_scheduler: Any  # a torch or DeepSpeed schedule; its state_dict is saved when it has one
    scaler: LossScaler
    state: ModelState
    training_dataloader: DistributedLoader | None
    checkpoint_id: str
    #: the folders this engine saves into, locked against other jobs (rank 0 of a save acquires)
    save_locks: SaveLocks
    global_steps: int
    global_samples: int
    micro_steps: int
    skipped_steps: int
    #: Gradients are accumulated that no step has applied yet (a save then loses them).
    _window_open: bool

    def gradient_accumulation_steps(self) -> int: ...

    def train_micro_batch_size_per_gpu(self) -> int: ...

    def next_checkpoint_call(self) -> int:
        """Number this save's handshake (every rank counts its saves the same way)."""
        ...

    def return_checkpoint_call(self) -> None:
        """Un-count a save that only this rank attempted."""

    def restore_progress(self, *, global_steps: int, global_samples: int, micro_steps: int,
                         skipped_steps: int) -> None:
        """Set the step counters from a checkpoint."""

    def load_scaler_state(self, state: dict[str, Any]) -> None:
        """Restore the loss scaler from a checkpoint."""


__all__ = ["CheckpointedEngine"]
