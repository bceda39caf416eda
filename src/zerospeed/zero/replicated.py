"""ZeRO stage 0: every rank holds everything; gradients are all-reduced in buckets.

This and :class:`zerospeed.zero.sharded.ShardedState` are the two model-state strategies the
engine drives through the same calls (``begin_backward`` / ``end_backward`` / ``step_grads`` /
``apply`` / ``zero``), so the engine's step (unscale, overflow, clip, schedule) is written once.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterator, Sequence

import torch
from torch import nn

from zerospeed.distributed.comm import Comm
from zerospeed.offload.run import IoStats
from zerospeed.optim.exchange import ExchangingOptimizer, HoldsSideTensors
from zerospeed.sharding.slots import ParamInfo, Slot, even_split
from zerospeed.zero.contract import CheckpointGroups, ParamOwner
from zerospeed.zero.grads import GradBuckets, ReductionPolicy
from zerospeed.zero.memory import storage_bytes
from zerospeed.zero.owner import clear_owner, set_owner
from zerospeed.zero.sparse_rows import SparseRows
from zerospeed.zero.step_grads import NormScope, StepGrads


class ReplicatedState:
    """Model parameters, fp32 masters when training in 16 bits, and the gradient buckets."""

    stage = 0

    def __init__(self, model: nn.Module, comm: Comm, *, master_dtype: torch.dtype, accum_dtype: torch.dtype,
                 bucket_elems: int, reduction: ReductionPolicy, norm: NormScope = NormScope(),
                 owns: Callable[[nn.Parameter], bool] | None = None, rows: SparseRows | None = None):
        """``norm``: how the global gradient norm counts parameters when the model is split beyond data
        parallelism (after the all-reduce every data-parallel rank holds the same averaged gradients).
        ``owns``: which of the model's parameters this state keeps (default all; a :class:`SplitState`
        gives expert parameters to a state over their own replica group). ``rows``: lookup tables
        whose gradients are exchanged as the rows each window touched (``sparse_gradients``)."""
        self.module = model
        self.comm = comm
        self.norm = norm
        self._owns = owns
        self.model_params = [p for _, p in self._named() if p.requires_grad]
        if self.model_params and self.model_params[0].dtype != master_dtype:
            self.master_params = [nn.Parameter(p.detach().to(master_dtype).clone()) for p in self.model_params]
        else:
            self.master_params = self.model_params
        self.buckets = GradBuckets(self.model_params, comm, bucket_elems=bucket_elems, accum_dtype=accum_dtype,
                                   policy=reduction, rows=rows)
        self.optimizer: torch.optim.Optimizer | None = None
        self._exchange: ExchangingOptimizer | None = None  # an optimizer averaging by itself after warm-up
        for i, p in enumerate(self.model_params):
            set_owner(p, ReplicatedParamRef(self, i))

    unit_count = 0

    def keeps(self, param: torch.Tensor) -> bool:
        return any(p is param for _, p in self._named())

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """Point the optimizer's groups at the fp32 masters (its state is still empty here); an
        optimizer that exchanges by itself (1-bit Adam...) is given this state's replica group."""
        self.optimizer = optimizer
        if isinstance(optimizer, ExchangingOptimizer):
            optimizer.bind_exchange(self.comm)
            self._exchange = optimizer
        if self.master_params is self.model_params:
            return
        by_id = {id(p): m for p, m in zip(self.model_params, self.master_params, strict=True)}
        for group in optimizer.param_groups:
            for p in group["params"]:  # state made at construction (Adagrad) moves to the master
                state = optimizer.state.pop(p, None)
                if state and id(p) in by_id:
                    optimizer.state[by_id[id(p)]] = {
                        k: v.to(by_id[id(p)].dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                        for k, v in state.items()}
            group["params"] = [by_id.get(id(p), p) for p in group["params"]]

    def _named(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The model's parameters this state keeps, by name, in the module's order."""
        return ((name, p) for name, p in self.module.named_parameters() if self._owns is None or self._owns(p))

    # -- backward ---------------------------------------------------------------------------
    def begin_backward(self, reduce: bool) -> None:
        self.buckets.reduce_this_step = reduce and not self._local_window()

    def end_backward(self) -> None:
        """Buckets still in flight are waited for at the step."""

    def allows_no_sync(self) -> bool:
        return True

    # -- step -------------------------------------------------------------------------------
    def _local_window(self) -> bool:
        """This window's gradients stay on their rank: the optimizer exchanges by itself now."""
        return self._exchange is not None and not self._exchange.reduces_gradients()

    def step_grads(self) -> StepGrads:
        """The averaged gradients (this rank's own in a local window), as flat tensors this rank
        may scale in place."""
        if self._local_window():
            self.buckets.finish_locally()
        else:
            self.buckets.finish()
        return StepGrads.in_memory(self.buckets.flat_buffers(), self._norm_skip())

    def _norm_skip(self) -> list[list[tuple[int, int]]]:
        """Per bucket, the slots of parameters another rank counts in the norm (buckets are re-laid
        after the first window, so this is read each step)."""
        skip: list[list[tuple[int, int]]] = [[] for _ in self.buckets.reducer.buckets]
        if not self.norm.counted_elsewhere:
            return skip
        for name, p in self._named():
            if name in self.norm.counted_elsewhere and p.requires_grad:
                b, slot = self.buckets.reducer.where(p)
                s = self.buckets.reducer.buckets[b].slots[slot]
                skip[b].append((s.offset, s.end))
        return [sorted(ranges) for ranges in skip]

    def squared_norm(self, grads: StepGrads) -> torch.Tensor:
        """The global squared norm; in a local window this rank's own (each rank clips its own
        gradients, as DeepSpeed's 1-bit optimizers do), made infinite on every rank when any rank
        overflowed, so all ranks skip the same steps."""
        squared = self.sum_over_ranks(grads.local_norm().double().square())
        if not self._local_window():
            return squared
        overflowed = torch.tensor([0.0 if bool(torch.isfinite(squared).all()) else 1.0], dtype=torch.float64)
        self.comm.all_reduce(overflowed, "max")
        return squared if overflowed.item() == 0.0 else torch.full_like(squared, float("inf"))

    def sum_over_ranks(self, local: torch.Tensor) -> torch.Tensor:
        """Gradients are replicated over data parallelism after the all-reduce: only the axes that split
        the model (``norm.across``) add to the local value."""
        return self.norm.sum_across(local)

    def apply(self) -> None:
        """Run the optimizer on the masters and copy the result into the model."""
        assert self.optimizer is not None
        for master, model in zip(self.master_params, self.model_params, strict=True):
            master.grad = self.buckets.grad_of(model).to(master.dtype)
        self.optimizer.step()
        for master in self.master_params:  # a state sharing the optimizer (SplitState) steps after this one
            master.grad = None
        if self.master_params is not self.model_params:
            with torch.no_grad():
                for master, model in zip(self.master_params, self.model_params, strict=True):
                    model.copy_(master)

    def zero(self) -> None:
        for p in self.master_params:
            p.grad = None
        for p in self.model_params:
            p.grad = None
        self.buckets.zero()

    def settle(self) -> None:
        """The optimizer runs only inside :meth:`apply`: nothing in the background to wait for."""

    # -- memory -----------------------------------------------------------------------------
    def offload_io(self) -> dict[str, float]:
        """Nothing is offloaded at stage 0."""
        return IoStats().as_dict()

    def describe_offload(self) -> str:
        return "all state in memory on every rank (ZeRO stage 0)"

    def release_all(self) -> None:
        """Parameters are always whole at stage 0."""

    def resident_state(self, units: Sequence[int] | None = None, write_back: bool = False) -> ContextManager[None]:
        """Everything is always in memory here."""
        return contextlib.nullcontext()

    def memory_breakdown(self) -> dict[str, int]:
        own = [p for _, p in self._named()]
        params = storage_bytes(own)
        grads = storage_bytes(self.buckets.flat_buffers())
        states = storage_bytes(self._state_tensors(), exclude=own)
        return {"params": params, "grads": grads, "optimizer_states": states,
                "total": params + grads + states, "buffers": 0, "offloaded": 0, "on_nvme": 0}

    def _state_tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = list(self.master_params)  # the model's own parameters when there are no masters: excluded by the caller
        if self.optimizer is not None:
            for master in self.master_params:
                out += [v for v in self.optimizer.state.get(master, {}).values() if isinstance(v, torch.Tensor)]
            if isinstance(self.optimizer, HoldsSideTensors):  # 1-bit compression buffers
                out += self.optimizer.side_tensors()
        return out

    # -- checkpoints -------------------------------------------------------------------------
    def checkpoint_params(self) -> list[ParamInfo]:
        return [ParamInfo(name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in self._named()]

    def checkpoint_groups(self) -> CheckpointGroups:
        """Everything is in memory: one visit of everything."""
        return CheckpointGroups.everything_in_memory()

    def checkpoint_slots(self, for_save: bool, units: Sequence[int] | None = None) -> list[Slot]:
        """Every parameter whole for loading; for saving, this rank's even share of each, so the ranks
        of a replicated run write in parallel and no byte twice. (``units``: accepted for symmetry
        with :class:`ShardedState`; must be None here.)"""
        if units is not None:
            raise ValueError("ReplicatedState has no units: call checkpoint_slots(for_save) without units")
        master_of = {id(p): m for p, m in zip(self.model_params, self.master_params, strict=True)}
        out = []
        for name, p in self._named():
            master = master_of.get(id(p), p)
            if not master.is_contiguous():
                raise ValueError(f"parameter {name} is not contiguous; checkpoints need contiguous parameters")
            flat = master.detach().view(-1)
            start, end = even_split(flat.numel(), self.comm.rank, self.comm.world_size) if for_save else (0, flat.numel())
            out.append(Slot(name, start, end, flat[start:end], master if p.requires_grad else None, start))
        return out

    def full_param_values(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter's value, by name (already whole here)."""
        return ((name, p.detach()) for name, p in self._named())

    def after_checkpoint_load(self, units: Sequence[int] | None = None) -> None:
        """The masters were overwritten: copy them into the model and drop stale gradients
        (``units``: for symmetry with :class:`ShardedState`; must be None here)."""
        if units is not None:
            raise ValueError("ReplicatedState has no units: call after_checkpoint_load() without units")
        if self.master_params is not self.model_params:
            with torch.no_grad():
                for master, model in zip(self.master_params, self.model_params, strict=True):
                    model.copy_(master)
        self.zero()

    def remove_hooks(self) -> None:
        self.buckets.remove_hooks()

    def detach_model(self) -> None:
        """Unhook the model (a second ``initialize`` on it)."""
        self.remove_hooks()
        for p in self.model_params:
            clear_owner(p)


class ReplicatedParamRef(ParamOwner):
    """A parameter's back-reference to the stage-0 state (masters, buckets, optimizer state)."""

    def __init__(self, state: ReplicatedState, index: int):
        self.state: ReplicatedState = state
        self.index = index

    def _master(self) -> torch.Tensor:
        return self.state.master_params[self.index]

    def full_fp32(self) -> torch.Tensor:
        return self._master().detach().float().clone()

    def full_grad(self) -> torch.Tensor | None:
        self.state.buckets.finish()  # averaged (waits for the reduction of the window's last backward)
        return self.state.buckets.grad_of(self.state.model_params[self.index]).float().clone()

    def full_optimizer_state(self, key: str) -> torch.Tensor | None:
        optimizer = self.state.optimizer
        value = optimizer.state.get(self._master(), {}).get(key) if optimizer is not None else None
        return value.clone() if isinstance(value, torch.Tensor) else None

    def set_full_fp32(self, value: torch.Tensor) -> None:
        with torch.no_grad():
            self._master().copy_(value)
            self.state.model_params[self.index].copy_(value)
