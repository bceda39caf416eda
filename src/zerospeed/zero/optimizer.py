"""ZeroOptimizer: the optimizer step over this rank's shards only (ZeRO stages 1-3).

Every unit's shard gets an fp32 master (the compute-dtype shard itself when that is fp32). Each
trainable parameter's part of it becomes a small ``nn.Parameter`` view (a *piece*), and the user's
torch optimizer is pointed at the pieces instead of the model's parameters, so its states exist
for this rank's elements only and its param groups (learning rates, weight decay, schedules) stay
as the user built them. A step is the three phases of the ZeRO paper: the gradient shards are
already reduced; the wrapped optimizer updates the local pieces; the updated shards go back to the
compute-dtype parameters (all-gathered at once for stages 1-2, on next use for stage 3).

Elementwise optimizers (Adam, AdamW, SGD, Adagrad) are exact on pieces. Lamb's trust ratio needs
whole-parameter norms: the pieces' squared norms are summed across ranks (one small all-reduce).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Generator
from typing import Callable, Sequence

import torch
from torch import nn

from zerospeed.distributed.comm import Comm, Handle
from zerospeed.offload import MemoryStorage, SlabLease, TierStorage
from zerospeed.offload.store import StateStore
from zerospeed.offload.tier import MemoryTier, StateTier
from zerospeed.ops.cpu_optimizer import CPUOptimizer
from zerospeed.optim.exchange import ExchangingOptimizer
from zerospeed.optim.lamb import Lamb
from zerospeed.optim.norms import WholeTensorNorms
from zerospeed.zero.flat_param import FlatParamUnit
from zerospeed.zero.swapped import SwappedOptimizerState

SUPPORTED_OPTIMIZERS: tuple[type, ...] = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD,
                                          torch.optim.Adagrad, Lamb, CPUOptimizer)


def steps_whole(optimizer: torch.optim.Optimizer) -> bool:
    """Whether one ``step()`` must cover every piece: norms over whole parameters are one collective
    pass (Lamb), and a 1-bit optimizer counts its calls (its set-up step, warm-up and freeze)."""
    return isinstance(optimizer, (WholeTensorNorms, ExchangingOptimizer))


def check_supported(optimizer: torch.optim.Optimizer, allow_untested: bool) -> None:
    """Refuse optimizers whose update is not known to be exact on shards (DeepSpeed's rule). A 1-bit
    optimizer is exact: it warms up on pieces and is handed whole tensors before it compresses
    (:class:`~zerospeed.zero.handover.HandoverState`)."""
    if isinstance(optimizer, SUPPORTED_OPTIMIZERS) or isinstance(optimizer, ExchangingOptimizer) or allow_untested:
        return
    names = ", ".join(cls.__name__ for cls in SUPPORTED_OPTIMIZERS)
    raise ValueError(f"ZeRO has not been tested with {type(optimizer).__name__} (tested: {names}); an optimizer "
                     f"that looks at whole tensors (norms, shapes) would be wrong on shards. Set "
                     f"\"zero_allow_untested_optimizer\": true in the config to use it anyway")


def _nothing(unit_index: int) -> None:
    """The default ``before_update``: gradients in memory need nothing when their unit is resident."""


class ZeroOptimizer:
    """Masters and the wrapped optimizer for this rank's shards; see the module docstring."""

    def __init__(self, units: Sequence[FlatParamUnit], comm: Comm, *, master_dtype: torch.dtype,
                 allgather_bucket_elems: int, store: StateStore | None = None, grads_in_slabs: bool = False,
                 keep_masters: bool = True):
        """``store``: where masters and optimizer states live (CPU memory under ``offload_optimizer``,
        for all units or, with ``ratio < 1``, the later ones); default: with the shards.
        ``grads_in_slabs``: swapped slabs also carry the unit's gradient shard (stages 2-3: gradient
        shards stay out of memory). ``keep_masters=False`` (no optimizer will ever run: inference):
        each unit's master *is* its compute-dtype shard, so no fp32 copy and no piece exists, and
        :meth:`adopt` refuses; a model larger than memory then costs nothing beyond its shards."""
        self.units = list(units)
        self.comm = comm
        self.allgather_bucket_elems = max(int(allgather_bucket_elems), 1)
        self.masters: list[torch.Tensor] = []
        self.piece_of: dict[int, nn.Parameter] = {}  # id(model parameter) -> its master piece here
        self._grad_slices: list[tuple[nn.Parameter, int, int, int]] = []  # piece, unit, offset, numel
        self._global_index: dict[int, int] = {}  # id(piece) -> index of its model parameter
        # id(piece) -> its [start, end) in its parameter, and the parameter's numel
        self._piece_range: dict[int, tuple[int, int, int]] = {}
        index = 0
        sizes = [unit.plan.shard_numel for unit in self.units]
        self.tiers: list[StateTier] = (store.optimizer_tiers(sizes) if store is not None
                                       else [MemoryTier("device", unit.shard.device) for unit in self.units])
        params_swapped = store is not None and store.params.swaps
        self.keeps_masters = keep_masters
        for u, unit in enumerate(self.units):
            if not keep_masters:
                self.masters.append(unit.shard)  # the same object: follows a swapped shard in and out
                continue
            if self.tiers[u].swaps:
                # a placeholder, never written (so it takes no memory): adopt() makes the real master in
                # the unit's slab, one unit at a time, once the optimizer's states are known
                master = torch.empty(unit.plan.shard_numel, dtype=master_dtype)
            else:
                with unit.shard_resident():
                    master = self.tiers[u].place(unit.shard, master_dtype)
                    if master is unit.shard and params_swapped and not unit.persistent:
                        master = unit.shard.clone()  # the shard has its own file: the master must not go with it
            self.masters.append(master)
            slot_of = {slot.name: i for i, slot in enumerate(unit.plan.params)}
            for piece in unit.plan.pieces(comm.rank):
                i = slot_of[piece.param]
                if not unit.trainable[i]:
                    continue
                view = nn.Parameter(master[piece.shard_offset: piece.shard_offset + piece.numel])
                self.piece_of[id(unit.params[i])] = view
                self._piece_range[id(view)] = (piece.start, piece.end, unit.plan.params[i].numel)
                self._grad_slices.append((view, u, piece.shard_offset, piece.numel))
            for i, p in enumerate(unit.params):
                if unit.trainable[i]:
                    if id(p) in self.piece_of:
                        self._global_index[id(self.piece_of[id(p)])] = index
                    index += 1
        self._num_params = index
        self._unit_pieces = [{id(piece) for piece, u, *_ in self._grad_slices if u == unit_index}
                             for unit_index in range(len(self.units))]
        self.optimizer: torch.optim.Optimizer | None = None
        # seconds of the last step: the update on the calling thread, casting and gathering the shards
        self.times = {"update": 0.0, "publish": 0.0}
        self.store = store
        self.swapped: SwappedOptimizerState | None = None  # NVMe-tier units, built by adopt()
        self.storage: TierStorage = MemoryStorage()  # where swapped units live (their NVMe run), set by adopt()
        self.grads_in_slabs = grads_in_slabs

    # -- wiring -----------------------------------------------------------------------------
    def adopt(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Point ``optimizer``'s groups at this rank's pieces, moving any state it already has (Adagrad
        makes its accumulators at construction) to the pieces as their slices."""
        if not self.keeps_masters:
            raise RuntimeError("this ZeRO state was built without an optimizer (keep_masters=False: inference), "
                               "so it has no fp32 masters to update; pass the optimizer to zerospeed.initialize "
                               "(optimizer=... or an \"optimizer\" config section) to train")
        known = {id(p) for unit in self.units for p in unit.params}
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) not in known:
                    raise ValueError(f"optimizer param group {g} holds a tensor of shape {tuple(p.shape)} that is "
                                     f"not a parameter of the model; ZeRO shards only the model's parameters")
            for p in group["params"]:
                state = optimizer.state.pop(p, None)
                piece = self.piece_of.get(id(p))
                if state and piece is not None:
                    optimizer.state[piece] = self._slice_state(state, p, piece, group)
            group["params"] = [self.piece_of[id(p)] for p in group["params"] if id(p) in self.piece_of]
        if isinstance(optimizer, Lamb) and any(group.get("max_grad_norm", 0) > 0 for group in optimizer.param_groups):
            raise NotImplementedError("Lamb's max_grad_norm under ZeRO: use gradient_clipping instead")
        if isinstance(optimizer, WholeTensorNorms):
            optimizer.reduce_norms_with(self.reduce_piece_norms)
        self.optimizer = optimizer
        swapping = [u for u, tier in enumerate(self.tiers) if tier.swaps]
        if swapping:
            self._swap_out(optimizer, self.tiers[swapping[0]], swapping)
        return optimizer

    def _swap_out(self, optimizer: torch.optim.Optimizer, tier: StateTier, units: list[int]) -> None:
        """Move the masters and (created now) optimizer states of ``units`` into ``tier``'s files."""
        assert self.store is not None
        # one run directory, a subdirectory per rank
        run = tier.open(self.comm, purpose="", what="offload_optimizer nvme")
        initial = {id(piece): optimizer.state.get(piece, {}) for piece, *_ in self._grad_slices}
        swapped = SwappedOptimizerState(units, run=run, lookahead=self.store.nvme_lookahead)
        error: BaseException | None = None
        try:
            swapped.build(optimizer, self.masters, self._grad_slices, initial, self._fill_master,
                          with_grads=self.grads_in_slabs)
        except (OSError, ValueError, NotImplementedError, RuntimeError) as exc:
            error = exc
        try:
            self.comm.fail_together(error, "offload_optimizer nvme")
        except BaseException:
            swapped.close()
            raise
        self.swapped, self.storage = swapped, run
        for u in units:
            self.units[u].bind_master(self.masters[u])

    def _fill_master(self, unit_index: int, out: torch.Tensor) -> None:
        """Write unit ``unit_index``'s master values (its shard, in the master dtype) into ``out``."""
        unit = self.units[unit_index]
        with torch.no_grad(), unit.shard_resident():
            out.copy_(unit.shard)

    def _slice_state(self, state: dict, param: torch.Tensor, piece: nn.Parameter, group: dict) -> dict:
        start, end, numel = self._piece_range[id(piece)]
        out = {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == 0 < piece.numel():
                # made from an already partitioned (empty) parameter: as Adagrad would make it
                out[key] = torch.full_like(piece, float(group.get("initial_accumulator_value", 0.0)))
            elif isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel:
                out[key] = value.detach().reshape(-1)[start:end].to(piece.dtype).clone()
            else:
                out[key] = value
        return out

    def reduce_piece_norms(self, pieces: list[torch.Tensor], squares: torch.Tensor) -> torch.Tensor:
        """Whole-parameter squared norms for ``pieces`` from their local squared norms (collective:
        every rank calls it the same number of times, with or without pieces)."""
        device = self.units[0].full.device  # the collective runs on the compute device (masters may be offloaded)
        total = torch.zeros(self._num_params, dtype=torch.float64, device=device)
        index = torch.tensor([self._global_index[id(p)] for p in pieces], dtype=torch.long, device=device)
        if pieces:
            total.index_add_(0, index, squares.to(device=device, dtype=torch.float64))
        self.comm.all_reduce(total)
        return total[index].to(device=squares.device, dtype=squares.dtype) if pieces else squares

    def pieces(self) -> list[tuple[nn.Parameter, int, int, int]]:
        """``(piece, unit index, offset in the shard, numel)`` for every piece on this rank."""
        return list(self._grad_slices)

    # -- step -------------------------------------------------------------------------------
    def step(self, grad_shards: Sequence[torch.Tensor], done: frozenset[int] | set[int] = frozenset(),
             copied: frozenset[int] | set[int] = frozenset(),
             before_update: Callable[[int], None] = _nothing) -> None:
        """Update the pieces from the (unscaled, clipped) gradient shards, then publish the shards.

        ``done``: units already updated this window (stepped early, during backward; see
        :mod:`zerospeed.zero.eager`), of which ``copied`` already have their compute-dtype shard
        written. ``before_update(u)`` runs once unit ``u`` is resident for its update, before its
        gradient is used (gradient shards kept in slabs get the step's unscale and clip then). When shards must be all-gathered afterwards (stages 1-2), the update runs unit by
        unit and each unit's all-gather goes out as soon as that unit is updated, overlapping the
        rest of the step (Lamb, whose step is one collective pass over every group, updates all
        units at once; so does a 1-bit optimizer, which counts its calls).
        """
        if self.optimizer is None:
            raise RuntimeError("ZeroOptimizer.step before adopt(): no optimizer to run")
        todo = [u for u in range(len(self.units)) if u not in done]
        publisher = _Publisher(self.allgather_bucket_elems, self.times)
        self.times.update(update=0.0, publish=0.0)
        swaps = self.swapped is not None or any(unit.shard_lease is not None for unit in self.units)
        try:
            at_once = steps_whole(self.optimizer) or not any(unit.persistent for unit in self.units)
            if at_once and not swaps:
                copy_out = self.copy_out_targets(todo)
                copied = set(copied) | set(copy_out or {})
                self._attach_grads({u: grad_shards[u] for u in todo})
                self.times["update"] += self._step_groups(copy_out)
                for u, (unit, master) in enumerate(zip(self.units, self.masters)):
                    publisher.publish(unit, master, copied=u in copied)
            else:
                self._step_unit_by_unit(grad_shards, done, set(copied), publisher, before_update)
            publisher.wait_all()
        finally:
            self._detach_grads(todo)

    def _step_unit_by_unit(self, grad_shards: Sequence[torch.Tensor], done: frozenset[int] | set[int],
                           copied: set[int], publisher: "_Publisher", before_update: Callable[[int], None]) -> None:
        """Update and publish one unit at a time: each unit's all-gather overlaps the next update, and
        NVMe-tier units stream through memory (read ahead, written back behind)."""
        assert self.optimizer is not None
        groups = self.optimizer.param_groups
        everything = [group["params"] for group in groups]
        order = range(len(self.units))
        stream = self.swapped.stream(order) if self.swapped is not None else iter(order)
        prefetched: list[tuple[int, SlabLease]] = []  # units whose NVMe-tier parameter shard is read ahead
        try:
            # closed on the way out, so a failed step releases its unit at once (its file untouched)
            with contextlib.closing(stream) if isinstance(stream, Generator) else contextlib.nullcontext():
                for u in stream:
                    unit, master = self.units[u], self.masters[u]
                    following = self.units[u + 1].shard_lease if u + 1 < len(self.units) else None
                    if following is not None:  # the next unit's shard is read while this one updates
                        following.acquire(wait=False)
                        prefetched.append((u + 1, following))
                    with unit.shard_resident(write_back=True):  # an NVMe-tier shard: in, updated, out
                        unit_copied = u in copied
                        if u not in done:
                            # the copy-out targets are views of the shard: made while it is resident
                            unit_copy_out = self.copy_out_targets([u])
                            unit_copied = bool(unit_copy_out)
                            before_update(u)
                            self._attach_grads({u: grad_shards[u]})
                            mine = self._unit_pieces[u]
                            for group, params in zip(groups, everything):
                                group["params"] = [p for p in params if id(p) in mine]
                            self.times["update"] += self._step_groups(unit_copy_out)
                            self._detach_grads([u])
                        swapped = self.swapped is not None and self.swapped.swapped(u)
                        # a swapped master or shard is released after this: copy before moving on
                        publisher.publish(unit, master, copied=unit_copied,
                                          blocking=swapped or unit.shard_lease is not None)
                    if prefetched and prefetched[0][0] == u:
                        _, lease = prefetched.pop(0)
                        lease.release()  # the update above (if any) marked it to be written
        finally:
            for group, params in zip(groups, everything):
                group["params"] = params
            for _, lease in prefetched:  # a failed step: let go of the reads ahead
                lease.release()

    def step_units(self, units: Sequence[int], grads: dict[int, torch.Tensor],
                   copy_out: dict[int, dict[int, torch.Tensor]] | None) -> None:
        """Update only the pieces of ``units`` (an early sub-group step; no publishing, no collective)."""
        assert self.optimizer is not None
        self._attach_grads(grads)
        try:
            self._step_groups(copy_out)
        finally:
            self._detach_grads(units)

    def may_step_early(self) -> list[bool]:
        """Per unit: may it be updated while backward still runs? Not when its master is the very
        shard the model computes with (a persistent unit without a separate master)."""
        return [not (unit.persistent and master is unit.shard) for unit, master in zip(self.units, self.masters)]

    def _attach_grads(self, grads: dict[int, torch.Tensor]) -> None:
        for piece, u, offset, numel in self._grad_slices:
            if u in grads:
                grad = grads[u][offset: offset + numel]
                same = grad.dtype == piece.dtype and grad.device == piece.device
                piece.grad = grad if same else grad.to(device=piece.device, dtype=piece.dtype)

    def _detach_grads(self, units: Sequence[int]) -> None:
        wanted = set(units)
        for piece, u, *_ in self._grad_slices:
            if u in wanted:
                piece.grad = None

    def copy_out_targets(self, units: Sequence[int], early: bool = False) -> dict[int, dict[int, torch.Tensor]] | None:
        """For a CPU optimizer writing the compute-dtype copy in its own pass (``fp16_param_groups``):
        unit index -> {id(piece): its slice of the unit's compute-dtype shard}, for those of ``units``
        whose shard is a separate CPU tensor (and, ``early``, not one the model computes with); None
        when the optimizer cannot do that."""
        if not isinstance(self.optimizer, CPUOptimizer):
            return None
        wanted = set(units)
        out: dict[int, dict[int, torch.Tensor]] = {}
        for piece, u, offset, numel in self._grad_slices:
            unit, master = self.units[u], self.masters[u]
            if u not in wanted or master is unit.shard or unit.shard.device.type != "cpu" \
                    or master.device.type != "cpu" or (early and unit.persistent):
                continue
            out.setdefault(u, {})[id(piece)] = unit.shard[offset: offset + numel]
        return out

    def _step_groups(self, copy_out: dict[int, dict[int, torch.Tensor]] | None) -> float:
        """Step every piece that has a gradient (pieces without one are skipped by the optimizer);
        returns the seconds it took."""
        assert self.optimizer is not None
        start = time.perf_counter()
        if not copy_out:
            self.optimizer.step()
        else:
            targets = {key: view for views in copy_out.values() for key, view in views.items()}
            # the CPU optimizers' one-pass copy-out (CPUOptimizer.step), not torch's Optimizer.step
            self.optimizer.step(fp16_param_groups=[[targets.get(id(p)) for p in group["params"]]  # type: ignore[call-overload]
                                                   for group in self.optimizer.param_groups])
        return time.perf_counter() - start

    def state_tensors(self) -> list[torch.Tensor]:
        """Masters (when separate from the shards) and the wrapped optimizer's state tensors."""
        out = [m for m, unit in zip(self.masters, self.units) if m is not unit.shard]
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                out += [v for v in state.values() if isinstance(v, torch.Tensor) and v.numel() > 1]
        return out


class _Publisher:
    """Casts updated masters into the compute-dtype shards and all-gathers persistent units, keeping
    at most ``allgather_bucket_size`` elements in flight."""

    def __init__(self, bucket_elems: int, times: dict[str, float]):
        self.bucket_elems = bucket_elems
        self.in_flight: list[tuple[Handle, int]] = []
        self.live = 0
        self.times = times  # "publish" accumulates the seconds spent here

    def publish(self, unit: FlatParamUnit, master: torch.Tensor, copied: bool = False, blocking: bool = False) -> None:
        """``copied``: the optimizer already wrote the compute-dtype shard (a CPU optimizer's copy-out);
        ``blocking``: the master is released right after (NVMe), so its copy must be complete."""
        start = time.perf_counter()
        try:
            self._publish(unit, master, copied, blocking)
        finally:
            self.times["publish"] += time.perf_counter() - start

    def _publish(self, unit: FlatParamUnit, master: torch.Tensor, copied: bool, blocking: bool) -> None:
        with torch.no_grad():
            if master is not unit.shard and not copied:
                # from offloaded (pinned) masters to the device: asynchronous, ordered before the all-gather
                unit.shard.copy_(master, non_blocking=master.device != unit.shard.device and not blocking)
        if not unit.persistent:
            return
        while self.in_flight and self.live + unit.numel > self.bucket_elems:
            handle, numel = self.in_flight.pop(0)
            handle.wait()
            self.live -= numel
        published = unit.publish_shard(async_op=True)
        assert published is not None, "a persistent unit publishes its shard"
        self.in_flight.append((published, unit.numel))
        self.live += unit.numel

    def wait_all(self) -> None:
        start = time.perf_counter()
        for handle, _ in self.in_flight:
            handle.wait()
        self.in_flight, self.live = [], 0
        self.times["publish"] += time.perf_counter() - start
