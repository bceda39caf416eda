"""Optimizer state on NVMe: a unit's fp32 master, optimizer states and gradient as one swapped slab.

For each unit in the NVMe tier, the master and every per-element state of its pieces (Adam's
``exp_avg`` and ``exp_avg_sq``, Adagrad's ``sum``, Lion's ``exp_avg``) are laid out in one flat
fp32 slab — ``[master | state 1 | state 2 ... | gradient]``, each region shard-sized, pieces at
their shard offsets — so the unit moves to and from its file in one request each way. The
optimizer's pieces and state tensors are views of the slab (attached to it: empty while it is
swapped out), so the optimizer, checkpoints and ``safe_get_full_*`` see ordinary tensors whenever
the unit is resident.

The gradient region (stages 2-3) is scratch: each micro-batch's reduced gradient shard is written
straight into it while backward goes on (read, added to and rewritten on later micro-batches of a
window), it comes in with the rest of the slab at ``step()``, and write-back skips it. So neither the
gradients nor the masters are ever all in memory: a unit's state is resident only while it updates.
The masters are made here, one unit at a time, from the parameter shards.

The states must exist before the first step (an optimizer creates them lazily, in memory, which is
what NVMe offload must avoid), so only optimizers whose per-element states are known are supported:
they are created here as zeros, exactly as those optimizers would create them.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Generator, Iterator, Sequence

import torch

from zerospeed.offload import IOWait, RunDirectory, SwappedSlabs, TierStorage
from zerospeed.ops.adagrad import CPUAdagrad
from zerospeed.ops.adam import CPUAdam
from zerospeed.ops.lion import CPULion


def per_element_states(optimizer: torch.optim.Optimizer) -> tuple[tuple[str, ...], dict[str, float]]:
    """``(state keys holding one value per element, scalar states)`` a fresh state of ``optimizer``
    has; raises for optimizers whose state is not known up front."""
    if isinstance(optimizer, (CPUAdam, torch.optim.Adam, torch.optim.AdamW)):
        if any(group.get("amsgrad") for group in optimizer.param_groups):
            raise NotImplementedError("offload_optimizer.device nvme with amsgrad: not supported; drop amsgrad")
        return ("exp_avg", "exp_avg_sq"), {"step": 0.0}
    if isinstance(optimizer, (CPUAdagrad, torch.optim.Adagrad)):
        return ("sum",), {"step": 0.0}
    if isinstance(optimizer, CPULion):
        return ("exp_avg",), {"step": 0.0}
    raise NotImplementedError(f"offload_optimizer.device nvme: {type(optimizer).__name__}'s state is not known "
                              f"before its first step; use Adam/AdamW (CPUAdam), Adagrad or Lion, or offload to "
                              f"the CPU instead")


class SwappedOptimizerState:
    """The NVMe-tier units of a :class:`ZeroOptimizer`: their masters and states live in slab files."""

    def __init__(self, units: Sequence[int], *, run: TierStorage, lookahead: int = 1):
        """``run``: the NVMe run the slabs go in (owned from now on: :meth:`close` closes it)."""
        self.units = list(units)
        self.run = run
        self.lookahead = lookahead
        self.slabs: SwappedSlabs | None = None
        self._slab_of: dict[int, int] = {}  # unit index -> slab index
        self._grad_at: dict[int, int] = {}  # unit index -> element offset of its gradient region
        self.grads: dict[int, torch.Tensor] = {}  # unit index -> its gradient region (empty while out)
        self._grad_writes: list[tuple[IOWait, torch.Tensor]] = []  # in flight: (request, its buffer)

    @property
    def directory(self) -> RunDirectory:
        """The run directory the slabs are in (once built)."""
        assert self.slabs is not None
        return self.slabs.directory

    def build(self, optimizer: torch.optim.Optimizer, masters: list[torch.Tensor],
              pieces: Sequence[tuple[torch.nn.Parameter, int, int, int]], initial_states: dict[int, dict],
              fill_master: Callable[[int, torch.Tensor], None], with_grads: bool) -> None:
        """Make each unit's slab — master (``fill_master(u, out)`` writes its values), the optimizer's
        states, and a gradient region when ``with_grads`` — and swap it out, one unit at a time.

        ``masters[u]`` is a placeholder of the right size on entry (never written, so it costs no
        memory) and the slab's master view on return. ``pieces``: ``(piece, unit, offset, numel)``;
        ``initial_states``: id(piece) -> a state the optimizer already holds (Adagrad's accumulators
        from construction), copied into the slab.
        """
        keys, scalars = per_element_states(optimizer)
        group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
        regions = 1 + len(keys) + int(with_grads)
        total = sum(regions * masters[u].numel() * 4 for u in self.units)
        what = ", ".join(("fp32 masters",) + keys + (("gradients",) if with_grads else ()))
        self.run.check_room(total, f"the {what} of {len(self.units)} units")
        # one unit at a time: built, written out and released before the next is made
        self.slabs = self.run.slabs("unit", lookahead=self.lookahead)
        for u in self.units:
            n = masters[u].numel()
            slab = torch.zeros(regions * n, dtype=torch.float32)
            new_master = slab[:n]
            fill_master(u, new_master)
            views: list[torch.Tensor] = [new_master]  # the very object masters[u] holds: kept valid
            masters[u] = new_master
            for piece, pu, offset, numel in pieces:
                if pu != u:
                    continue
                with torch.no_grad():
                    piece.data = slab[offset: offset + numel]
                views.append(piece)
                old = initial_states.get(id(piece), {})
                state = {key: torch.tensor(value) for key, value in scalars.items()}
                for k, key in enumerate(keys):
                    region = slab[(1 + k) * n + offset: (1 + k) * n + offset + numel]
                    if isinstance(old.get(key), torch.Tensor) and old[key].numel() == numel:
                        region.copy_(old[key].reshape(-1))
                    elif key == "sum":  # Adagrad's accumulator starts at initial_accumulator_value
                        region.fill_(float(group_of[id(piece)].get("initial_accumulator_value", 0.0)))
                    state[key] = region
                    views.append(region)
                optimizer.state[piece] = state
            if with_grads:
                self._grad_at[u] = (1 + len(keys)) * n
                self.grads[u] = slab[self._grad_at[u]:]
                views.append(self.grads[u])
            self._slab_of[u] = self.slabs.add(slab, views, check_room=False, keep_numel=(1 + len(keys)) * n)

    # -- gradients --------------------------------------------------------------------------------
    def holds_grad(self, unit_index: int) -> bool:
        return unit_index in self._grad_at

    def store_grad(self, unit_index: int, values: torch.Tensor, accumulate: bool,
                   accum_dtype: torch.dtype) -> torch.Tensor:
        """Put one micro-batch's reduced gradient shard into unit ``unit_index``'s gradient region
        (added to what the region holds when ``accumulate``, in ``accum_dtype`` as an in-memory
        shard would be); returns the new value, whose write is in flight (:meth:`flush_grads`)."""
        assert self.slabs is not None
        i, at = self._slab_of[unit_index], self._grad_at[unit_index]
        if accumulate:
            old = torch.empty(values.numel(), dtype=torch.float32)
            self.flush_grads()  # a write of this region may still be in flight
            self.slabs.read_region(i, old, at)
            total = old if accum_dtype == torch.float32 else old.to(accum_dtype)
            total.add_(values)
        else:
            total = values.to(accum_dtype, copy=True)
        stored = total if total.dtype == torch.float32 else total.float()
        stored = stored.contiguous()
        self._grad_writes.append((self.slabs.write_region(i, stored, at), stored))
        while len(self._grad_writes) > max(self.lookahead, 1) + 1:  # bounded memory: wait for the oldest
            request, _ = self._grad_writes.pop(0)
            self.slabs.wait_region_writes([request])
        return total

    def flush_grads(self) -> None:
        """Wait until every gradient written so far is in its file."""
        if self.slabs is None:
            return
        pending, self._grad_writes = self._grad_writes, []
        self.slabs.wait_region_writes([request for request, _ in pending])

    def swapped(self, unit_index: int) -> bool:
        return unit_index in self._slab_of

    def stream(self, order: Sequence[int], write_back: bool = True) -> Generator[int, None, None]:
        """Yield the units of ``order`` in turn, each resident while the consumer holds it (units of
        other tiers pass straight through)."""
        assert self.slabs is not None
        swapped = [u for u in order if u in self._slab_of]
        inner = self.slabs.stream([self._slab_of[u] for u in swapped], write_back=write_back)
        try:
            for u in order:
                if u in self._slab_of:
                    next(inner)
                yield u
            for _ in inner:  # let the stream finish its last write-back
                pass
        finally:
            inner.close()

    @contextlib.contextmanager
    def resident(self, units: Sequence[int] | None = None, write_back: bool = False) -> Iterator[None]:
        """The given units (default: all) resident inside the block; written back after it only when
        ``write_back`` (something changed them: a checkpoint load, ``safe_set_full_fp32_param``)."""
        assert self.slabs is not None
        wanted = [self._slab_of[u] for u in (self.units if units is None else units) if u in self._slab_of]
        with self.slabs.resident_during(wanted, write_back=write_back):
            yield

    @property
    def bytes_moved(self) -> tuple[int, int]:
        """(bytes read, bytes written) so far."""
        return (self.slabs.bytes_read, self.slabs.bytes_written) if self.slabs is not None else (0, 0)

    def close(self) -> None:
        """Stop the I/O threads (pending transfers end first), release the slabs, delete the files."""
        self._grad_writes = []
        self.run.close()
