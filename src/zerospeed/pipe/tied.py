"""Weights tied across pipeline stages (``TiedLayerSpec``): one start value, one summed gradient.

A tie ``key`` has a copy on each stage in ``module.tied_stages(key)``. The copies start from the lowest
such stage's value (broadcast at start) and every window's gradient of a copy is replaced by the sum of
all copies' gradients, so the copies stay equal after every optimizer step. The norm counts the tie once
(on its lowest stage: see :func:`counted_elsewhere`).

The sum is taken on the *reduced* gradient, after the data-parallel reduction of the window (summing is
linear, so the order does not matter): at ZeRO stage 0 every data-parallel rank holds the whole averaged
gradient, at stages 1-2 each holds a piece whose position in its flat shard differs from stage to
stage. Both cases use one collective per tied tensor over the ranks of the tied stages that share this
rank's tensor-parallel coordinate (all data-parallel ranks): each rank places the part it owns (at stage
0, data-parallel rank 0 owns the whole tensor) into a zero tensor of the parameter's size, the
all-reduce adds the stages' (disjoint per stage) parts, and each rank takes its part back.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from zerospeed.distributed import groups
from zerospeed.distributed.comm import Comm
from zerospeed.distributed.mesh import Mesh
from zerospeed.pipe.module import PipelineModule
from zerospeed.zero.contract import ModelState
from zerospeed.zero.replicated import ReplicatedState
from zerospeed.zero.sharded import ShardedState


def counted_elsewhere(module: PipelineModule) -> frozenset[str]:
    """Names of this stage's tied tensors whose gradient another stage counts in the norm (every stage
    of the tie but its lowest)."""
    names = {id(p): name for name, p in module.named_parameters()}
    out = set()
    for key, _path, tensor in module.tied_weights():
        if module.tied_stages(key)[0] != module.stage_id and id(tensor) in names:
            out.add(names[id(tensor)])
    return frozenset(out)


class TiedWeights:
    """The ties of this stage and the groups that sum them (built collectively: every rank of the job
    constructs one, in the same order)."""

    def __init__(self, module: PipelineModule, mesh: Mesh) -> None:
        self.module = module
        self.mesh = mesh
        dims = mesh.dims
        self._comms: dict[tuple[int, ...], Comm] = {}
        stage_sets = sorted({tuple(module.tied_stages(key)) for key in module.plan.tied_keys})
        rank = groups.group_rank()
        for stages in stage_sets:
            if len(stages) < 2:
                continue
            members: dict[int, list[int]] = {}
            for r in range(dims.world_size):
                c = dims.coords(r)
                key = c["tp"] if c["pp"] in stages else -1 - r  # ranks of other stages: singleton groups
                members.setdefault(key, []).append(r)
            group = groups.new_partition(sorted(members.values()))
            if dims.coords(rank)["pp"] in stages:
                self._comms[stages] = Comm(group, name=f"tied{list(stages)}", timeout=mesh.dp.timeout)
        self._names = {id(p): name for name, p in module.named_parameters()}

    def _local(self) -> Iterator[tuple[str, torch.Tensor, Comm]]:
        for key, _path, tensor in self.module.tied_weights():
            comm = self._comms.get(tuple(self.module.tied_stages(key)))
            if comm is not None:
                yield key, tensor, comm

    def broadcast_weights(self) -> None:
        """Every copy takes the value of the tie's lowest stage (its data-parallel rank 0)."""
        dims = self.mesh.dims
        me = dims.coords(groups.group_rank())
        with torch.no_grad():
            for key, tensor, comm in self._local():
                lowest = self.module.tied_stages(key)[0]
                src = next(r for r in comm.global_ranks
                           if dims.coords(r)["pp"] == lowest and dims.coords(r)["dp"] == 0
                           and dims.coords(r)["tp"] == me["tp"])
                comm.broadcast(tensor.data, src=comm.global_ranks.index(src))

    def sum_grads(self, state: ModelState) -> None:
        """Replace each tied tensor's reduced window gradient by the sum over the tie's stages."""
        for _key, tensor, comm in self._local():
            if isinstance(state, ReplicatedState):
                self._sum_replicated(state, tensor, comm)
            elif isinstance(state, ShardedState):
                self._sum_sharded(state, tensor, comm)
            else:  # pragma: no cover - the engine refuses other states with pipelines
                raise TypeError(f"tied pipeline weights cannot be summed in a {type(state).__name__}")

    def _sum_replicated(self, state: ReplicatedState, tensor: torch.Tensor, comm: Comm) -> None:
        grad = state.buckets.grad_of(tensor).reshape(-1)
        full = grad.clone() if self.mesh.dp.rank == 0 else torch.zeros_like(grad)
        comm.all_reduce(full)
        grad.copy_(full)

    def _sum_sharded(self, state: ShardedState, tensor: torch.Tensor, comm: Comm) -> None:
        assert isinstance(tensor, nn.Parameter)
        unit, index = state.unit_of(tensor)
        unit_index = state.units.index(unit)
        slot = unit.plan.params[index]
        start, stop = unit.plan.shard_range(self.mesh.dp.rank)
        lo, hi = max(slot.offset, start), min(slot.end, stop)
        shard = state.grads.units[unit_index].shard
        full = torch.zeros(slot.end - slot.offset, dtype=shard.dtype, device=unit.full.device)
        if lo < hi:
            full[lo - slot.offset: hi - slot.offset].copy_(shard[lo - start: hi - start])
        comm.all_reduce(full)
        if lo < hi:
            shard[lo - start: hi - start].copy_(full[lo - slot.offset: hi - slot.offset])


__all__ = ["TiedWeights", "counted_elsewhere"]
