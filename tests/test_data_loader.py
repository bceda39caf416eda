"""DistributedLoader: disjoint shards, per-epoch reshuffle, exact resume; RepeatingLoader."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from zerospeed.data import DistributedLoader
from zerospeed.utils import RepeatingLoader


def dataset(n: int = 23) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def ids(batches) -> list[int]:
    return [int(i) for (b,) in batches for i in b]


def test_ranks_see_disjoint_shards_covering_the_data() -> None:
    loaders = [DistributedLoader(dataset(24), micro_batch_size=4, rank=r, world_size=3, seed=7) for r in range(3)]
    seen = [ids(list(loader)) for loader in loaders]
    assert [len(s) for s in seen] == [8, 8, 8]
    assert sorted(sum(seen, [])) == list(range(24))
    assert [len(loader) for loader in loaders] == [2, 2, 2]


def test_each_epoch_reshuffles_deterministically() -> None:
    loader = DistributedLoader(dataset(), micro_batch_size=5, rank=0, world_size=2, seed=1)
    first, second = ids(list(loader)), ids(list(loader))
    assert first != second  # a new order every epoch, without calling set_epoch
    again = DistributedLoader(dataset(), micro_batch_size=5, rank=0, world_size=2, seed=1)
    assert ids(list(again)) == first and ids(list(again)) == second
    assert loader.state_dict() == {"epoch": 2, "batches_in_epoch": 0}


def test_resume_mid_epoch_gives_the_same_remaining_batches() -> None:
    full = DistributedLoader(dataset(), micro_batch_size=2, rank=1, world_size=2, seed=3)
    list(full)  # epoch 0
    epoch1 = [b[0].tolist() for b in full]
    part = DistributedLoader(dataset(), micro_batch_size=2, rank=1, world_size=2, seed=3)
    list(part)
    it = iter(part)
    head = [next(it)[0].tolist() for _ in range(2)]
    state = part.state_dict()
    assert state == {"epoch": 1, "batches_in_epoch": 2}
    resumed = DistributedLoader(dataset(), micro_batch_size=2, rank=1, world_size=2, seed=3)
    resumed.load_state_dict(state)
    assert head + [b[0].tolist() for b in resumed] == epoch1
    assert resumed.state_dict() == {"epoch": 2, "batches_in_epoch": 0}


def test_drop_last_and_collate_fn() -> None:
    loader = DistributedLoader(dataset(23), micro_batch_size=5, rank=0, world_size=2, drop_last=True,
                               shuffle=False, collate_fn=lambda items: torch.stack([x for (x,) in items]) * 10)
    batches = list(loader)
    assert len(loader) == len(batches) == 2  # 11 samples per rank with drop_last -> 2 full batches
    assert all(b.shape == (5,) and int(b[0]) % 10 == 0 for b in batches)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match=r"micro_batch_size=0 must be >= 1 \(train_micro_batch_size_per_gpu"):
        DistributedLoader(dataset(), micro_batch_size=0, rank=0, world_size=1)
    with pytest.raises(ValueError, match="rank 2 is outside the data-parallel world of 2"):
        DistributedLoader(dataset(), micro_batch_size=1, rank=2, world_size=2)


def test_repeating_loader_cycles_and_refuses_empty() -> None:
    loader = RepeatingLoader([1, 2, 3])
    assert [next(loader) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]
    with pytest.raises(ValueError, match="yields nothing"):
        next(RepeatingLoader([]))
