"""Data loading for data-parallel training: each rank iterates its own shard in micro-batches.

:class:`DistributedLoader` wraps a torch ``DataLoader`` over a :class:`ResumableSampler` (torch's
``DistributedSampler`` plus a resume position), reshuffles every epoch without the user calling
``set_epoch``, and can save and restore exactly where it was, so a resumed run sees the same batches.
Its :meth:`~DistributedLoader.position` is the same at every world size (an epoch and a count of that
epoch's samples consumed by all ranks together), so a run resumed on more or fewer ranks (an elastic
restart) continues at the next global sample, resharded over its ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Sized
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

log = logging.getLogger("zerospeed")


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


def small_dataset_warning(samples: int, *, micro_batch_size: int, gradient_accumulation_steps: int,
                          world_size: int, drop_last: bool) -> str | None:
    """What goes wrong when ``samples`` is less than one global batch (``None`` when it is not), and the fix.

    torch's ``DistributedSampler`` evens the ranks out by repeating samples (or, with drop_last, leaving
    some out) and the last micro-batch of an epoch may be partial: harmless on a large dataset, but on
    one smaller than a global batch every optimizer step trains on short micro-batches holding repeated
    rows (or steps only every few epochs), which looks like a working run.
    """
    global_batch = micro_batch_size * gradient_accumulation_steps * world_size
    if samples >= global_batch:
        return None
    if drop_last:
        per_rank = samples // world_size
        micro_batches = per_rank // micro_batch_size
        shares = f"each rank gets {per_rank} sample(s) per epoch"
        if samples - per_rank * world_size:
            shares += f" ({samples - per_rank * world_size} left out by dataloader_drop_last)"
    else:
        per_rank = -(-samples // world_size)
        micro_batches = -(-per_rank // micro_batch_size)
        shares = f"each rank gets {per_rank} sample(s) per epoch"
        if per_rank * world_size - samples:
            shares += f" (including {per_rank * world_size - samples} repeated, so that every rank gets as many)"
    effects = [shares]
    if not drop_last and per_rank % micro_batch_size:
        effects.append(f"its {'only' if micro_batches == 1 else 'last'} micro-batch holds {per_rank % micro_batch_size} "
                       f"instead of {micro_batch_size}")
    if micro_batches == 0:
        effects.append("an epoch yields no micro-batch at all")
    elif micro_batches < gradient_accumulation_steps:
        effects.append(f"an epoch is {micro_batches} micro-batch(es), fewer than the {gradient_accumulation_steps} "
                       "of one optimizer step")
    return (f"the training data holds {samples} samples, fewer than one global batch of {global_batch} "
            f"(train_micro_batch_size_per_gpu {micro_batch_size} x gradient_accumulation_steps "
            f"{gradient_accumulation_steps} x {world_size} data-parallel rank(s)): {'; '.join(effects)}. Add data "
            f"(at least {global_batch} samples) or lower train_micro_batch_size_per_gpu / gradient_accumulation_steps")


class DistributedLoader:
    """Micro-batches of this rank's shard of ``dataset``, an epoch at a time.

    ``gradient_accumulation_steps`` only sizes the global batch for the warning that the dataset is
    smaller than one global batch (:func:`small_dataset_warning`). ``warn`` says whether this process
    logs it; by default the loader of data-parallel rank 0 does. ``zerospeed.initialize`` passes
    "global rank 0", since with pipeline or tensor parallelism every stage and tensor rank has a
    data-parallel rank 0 and the job would warn once per stage.
    """

    def __init__(self, dataset: Dataset, *, micro_batch_size: int, rank: int, world_size: int,
                 collate_fn: Callable[[list[Any]], Any] | None = None, drop_last: bool = False,
                 shuffle: bool = True, seed: int = 0, num_workers: int = 0, pin_memory: bool = False,
                 gradient_accumulation_steps: int = 1, warn: bool | None = None):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1 "
                             f"(train_micro_batch_size_per_gpu in the config)")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the data-parallel world of {world_size}")
        if gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps={gradient_accumulation_steps} must be >= 1")
        if (rank == 0 if warn is None else warn) and isinstance(dataset, Sized):
            warning = small_dataset_warning(len(dataset), micro_batch_size=micro_batch_size,
                                            gradient_accumulation_steps=gradient_accumulation_steps,
                                            world_size=world_size, drop_last=drop_last)
            if warning is not None:
                log.warning("%s", warning)
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
        # Samples of the current epoch this rank skips before those micro-batches: set by resume_at
        # (a resume at another world size), so the epoch goes on at a sample, not a micro-batch, boundary.
        self.sample_offset = 0

    def __len__(self) -> int:
        """Micro-batches in a whole epoch on this rank."""
        per_rank = len(self.sampler) + self.sampler.start_index
        return per_rank // self.micro_batch_size if self.drop_last else -(-per_rank // self.micro_batch_size)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self._generator.manual_seed(self.sampler.seed + self.epoch)  # worker seeds depend on (seed, epoch) only
        self.sampler.start_index = self.sample_offset + self.batches_in_epoch * self.micro_batch_size
        try:
            for batch in self._loader:
                self.batches_in_epoch += 1
                yield batch
        finally:
            self.sampler.start_index = 0
        self.epoch += 1
        self.batches_in_epoch = 0
        self.sample_offset = 0

    def state_dict(self) -> dict[str, int]:
        """This rank's position (exact for a resume at the same world size and micro batch)."""
        state = {"epoch": self.epoch, "batches_in_epoch": self.batches_in_epoch}
        if self.sample_offset:
            state["sample_offset"] = self.sample_offset
        return state

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at the saved position: the next iteration continues that epoch's order."""
        self.epoch = int(state["epoch"])
        self.batches_in_epoch = int(state["batches_in_epoch"])
        self.sample_offset = int(state.get("sample_offset", 0))

    def position(self) -> dict[str, int]:
        """Where the data stands for all ranks together, independent of the world size: ``epoch`` and
        ``samples``, the number of that epoch's ordered samples already consumed (the ranks take the
        epoch's order round-robin, so consumed samples are always a prefix of it), and ``dataset_size``.
        A finished epoch is reported as the next one at 0."""
        per_rank = self.sampler.num_samples
        consumed = min(self.sample_offset + self.batches_in_epoch * self.micro_batch_size, per_rank)
        left = per_rank - consumed
        size = len(self.sampler.dataset)  # type: ignore[arg-type]  # a map-style (Sized) dataset
        samples = consumed * self.sampler.num_replicas
        if left <= 0 or (self.drop_last and left < self.micro_batch_size) or samples >= size:
            return {"epoch": self.epoch + 1, "samples": 0, "dataset_size": size}
        return {"epoch": self.epoch, "samples": samples, "dataset_size": size}

    def resume_at(self, epoch: int, samples: int) -> None:
        """Continue at sample ``samples`` of ``epoch``'s order (a :meth:`position` saved at any world
        size): this rank takes the rest of the epoch's order round-robin, as an uninterrupted run at
        this world size would from that sample on. When ``samples`` is not a multiple of the world size
        the start is rounded down to one, so up to world size - 1 samples are seen twice, never skipped."""
        if epoch < 0 or samples < 0:
            raise ValueError(f"resume_at(epoch={epoch}, samples={samples}): both must be >= 0")
        world = self.sampler.num_replicas
        per_rank, extra = divmod(samples, world)
        if extra and self.sampler.rank == 0:
            log.warning("data position: epoch %d resumes at sample %d, the multiple of the %d data-parallel ranks "
                        "below the saved %d: %d sample(s) are seen again (save at optimizer-step boundaries with a "
                        "global batch divisible by the world size to resume exactly)", epoch, samples - extra, world,
                        samples, extra)
        self.epoch = epoch
        self.batches_in_epoch = 0
        self.sample_offset = per_rank


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
