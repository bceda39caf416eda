"""Data loading for data-parallel training: each rank iterates its own shard in micro-batches.

:class:`DistributedLoader` wraps a torch ``DataLoader`` over a :class:`ResumableSampler` (torch's
``DistributedSampler`` plus a resume position), reshuffles every epoch without the user calling
``set_epoch``, and can save and restore exactly where it was, so a resumed run sees the same batches.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` that can start part-way into an epoch (skips indices, not data)."""

    def __init__(self, dataset: Dataset, *, num_replicas: int, rank: int, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.start_index = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.start_index:])

    def __len__(self) -> int:
        return super().__len__() - self.start_index


class DistributedLoader:
    """Micro-batches of this rank's shard of ``dataset``, an epoch at a time."""

    def __init__(self, dataset: Dataset, *, micro_batch_size: int, rank: int, world_size: int,
                 collate_fn: Callable[[list[Any]], Any] | None = None, drop_last: bool = False,
                 shuffle: bool = True, seed: int = 0, num_workers: int = 0, pin_memory: bool = False):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1 "
                             f"(train_micro_batch_size_per_gpu in the config)")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the data-parallel world of {world_size}")
        self.micro_batch_size = micro_batch_size
        self.drop_last = drop_last
        self.sampler = ResumableSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle,
                                        seed=seed, drop_last=drop_last)
        # Its own generator: a DataLoader without one draws its workers' base seed from the global torch
        # RNG each time an iterator starts, which would shift every later dropout mask of a resumed run.
        self._generator = torch.Generator()
        self._loader = DataLoader(dataset, batch_size=micro_batch_size, sampler=self.sampler,
                                  collate_fn=collate_fn, drop_last=drop_last, num_workers=num_workers,
                                  pin_memory=pin_memory, generator=self._generator)
        self.epoch = 0
        self.batches_in_epoch = 0  # micro-batches already yielded in the current epoch

    def __len__(self) -> int:
        """Micro-batches in a whole epoch on this rank."""
        per_rank = len(self.sampler) + self.sampler.start_index
        return per_rank // self.micro_batch_size if self.drop_last else -(-per_rank // self.micro_batch_size)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self._generator.manual_seed(self.sampler.seed + self.epoch)  # worker seeds depend on (seed, epoch) only
        self.sampler.start_index = self.batches_in_epoch * self.micro_batch_size
        try:
            for batch in self._loader:
                self.batches_in_epoch += 1
                yield batch
        finally:
            self.sampler.start_index = 0
        self.epoch += 1
        self.batches_in_epoch = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches_in_epoch": self.batches_in_epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at the saved position: the next iteration continues that epoch's order."""
        self.epoch = int(state["epoch"])
        self.batches_in_epoch = int(state["batches_in_epoch"])


class RepeatingLoader:
    """Iterate a loader forever, restarting it when it runs out (DeepSpeed's ``RepeatingLoader``)."""

    def __init__(self, loader: Iterable[Any]):
        self.loader = loader
        self._it = iter(loader)

    def __iter__(self) -> "RepeatingLoader":
        return self

    def __next__(self) -> Any:
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self.loader)
            try:
                return next(self._it)
            except StopIteration:
                raise ValueError("RepeatingLoader: the wrapped loader yields nothing") from None
