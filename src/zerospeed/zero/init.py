"""``zero.Init``: build a model already partitioned; ``GatheredParameters``: see it whole for a while.

Under :class:`Init`, every module's parameters are partitioned as soon as that module's
``__init__`` returns: rank 0's values are broadcast (so every rank starts from the same weights
whatever its seed), each rank keeps an even 1/N slice, and the full tensor is dropped. Peak memory
is then about one module's parameters plus this rank's shards, so a model larger than one rank's
memory can be built. With ``remote_device="nvme"`` (the default when the config puts
``offload_param`` on NVMe) the slices themselves go to swap files under ``nvme_path`` as they are
made, so not even they are all in memory: a model larger than all of memory can be built.
:func:`zerospeed.initialize` later moves these partitions into its ZeRO-3 units, one parameter at a
time, deleting each swap file as its partition is taken.

:class:`GatheredParameters` gathers partitioned parameters (by ``zero.Init`` or by a ZeRO-3 engine)
for a ``with`` block. With ``modifier_rank=r``, rank ``r``'s in-place edits are broadcast on exit and
become every rank's shards (and fp32 masters). Every rank must enter it with the same parameters.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch
from torch import nn

from zerospeed.distributed.comm import Comm
from zerospeed.distributed.groups import group_size, is_initialized
from zerospeed.distributed.mesh import Mesh
from zerospeed.offload import remote_device_tier
from zerospeed.zero.ds_param import ZeroParamStatus
from zerospeed.zero.flat_param import FlatParamUnit
from zerospeed.zero.owner import InitOwner, engine_owner, init_partition, owner_of, set_owner

if TYPE_CHECKING:
    from zerospeed.offload import NvmeTier, SlabLease


class InitPartition(InitOwner):
    """One parameter partitioned by ``zero.Init``: this rank's even slice and the full shape."""

    def __init__(self, param: nn.Parameter, comm: Comm, stash: "NvmeStash | None" = None, ds_id: int = 0):
        self.param = param
        self.ds_id = ds_id
        self.comm = comm
        self.shape = tuple(param.shape)
        self.numel = param.numel()
        self.width = -(-self.numel // comm.world_size)
        flat = torch.zeros(self.width * comm.world_size, dtype=param.dtype, device=param.device)
        with torch.no_grad():
            flat[: self.numel].copy_(param.detach().reshape(-1))
        comm.broadcast(flat, src=0)
        self.shard = flat[comm.rank * self.width: (comm.rank + 1) * self.width].clone()
        # the buffer is a whole parameter: free it now rather than when its last reference goes (a caught
        # timeout's traceback, a comms logger or a profiler may hold one for a while), so the build's peak is
        # one module's parameters plus the shards however busy the machine is
        flat.untyped_storage().resize_(0)
        del flat
        self._empty = torch.empty(0, dtype=param.dtype, device=param.device)
        self._gathered: torch.Tensor | None = None
        param.data = self._empty
        # remote_device nvme: the slice lives in a swap file (``shard`` is empty while it is out), deleted
        # when the engine takes it or when the parameter is dropped (e.g. replaced by a tied weight)
        self._lease = stash.put(self.shard) if stash is not None else None
        self._drop_file = (weakref.finalize(self, self._lease.slabs.forget, self._lease.index)
                           if self._lease is not None else None)

    def _resident(self, write_back: bool = False) -> contextlib.AbstractContextManager[None]:
        return self._lease.held(write_back) if self._lease is not None else contextlib.nullcontext()

    def gather(self) -> None:
        if self._gathered is not None:
            return
        full = torch.empty(self.width * self.comm.world_size, dtype=self.shard.dtype, device=self.shard.device)
        with self._resident():
            self.comm.all_gather(full, self.shard)
        self._gathered = full
        self.param.data = full[: self.numel].view(self.shape)

    def release(self, modifier_rank: int | None) -> None:
        if self._gathered is None:
            return
        if modifier_rank is not None:
            self.comm.broadcast(self._gathered, src=modifier_rank)
            lo = self.comm.rank * self.width
            with self._resident(write_back=True):
                self.shard.copy_(self._gathered[lo: lo + self.width])
        self._gathered = None
        self.param.data = self._empty

    def take_full(self) -> torch.Tensor:
        """The full values (collective); afterwards this partition is dropped (the engine owns them, and
        a model larger than memory must not keep both copies while the engine's units are made)."""
        self.gather()
        values = self.param.data
        self._gathered = None
        self.shard = self._empty
        if self._drop_file is not None:  # its disk space is needed for what the engine writes next
            self._drop_file()
            self._lease = None
        return values

    def file_bytes(self) -> int:
        lease = self._lease
        return lease.slabs.nbytes[lease.index] if lease is not None else 0

    def tensors(self) -> list[torch.Tensor]:
        return [self.shard]

    # -- DeepSpeed's parameter attributes (zerospeed.zero.ds_param) ----------------------------
    @property
    def status(self) -> ZeroParamStatus:
        return ZeroParamStatus.AVAILABLE if self._gathered is not None else ZeroParamStatus.NOT_AVAILABLE

    @property
    def persistent(self) -> bool:
        return False  # zero.Init partitions every parameter

    def partition_numel(self) -> int:
        return self.width

    def padding_size(self) -> int:
        return self.width * self.comm.world_size - self.numel

    def partition_tensor(self) -> torch.Tensor:
        return self.shard

    def make_available(self) -> None:
        self.gather()

    def repartition(self) -> None:
        self.release(None)


def _all_module_classes() -> list[type]:
    seen, todo = [], [nn.Module]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.append(sub)
                todo.append(sub)
    return seen


class NvmeStash:
    """Swap files for ``zero.Init`` partitions (``remote_device="nvme"``), in a run directory of their own."""

    def __init__(self, tier: NvmeTier, comm: Comm):
        """Opens ``tier``'s run (collective: every rank partitions the same parameters)."""
        self.run = tier.open(comm, purpose="init", what="zero.Init(remote_device='nvme')")
        self.slabs = self.run.slabs("init")

    def put(self, shard: torch.Tensor) -> SlabLease:
        """Write ``shard`` (a 1-D CPU tensor, emptied) to a file of its own; its lease reads it back."""
        return self.slabs.lease(self.slabs.add(shard.view(-1), [shard]))


class Init(contextlib.ContextDecorator):
    """Partition each module's parameters as it is constructed (see the module docstring).

    ``config`` (a dict, path or :class:`~zerospeed.config.Config`) sets the parameter dtype from
    its fp16/bf16 sections unless ``dtype`` is given; ``enabled=False`` makes it a no-op.
    ``remote_device``: where the partitions wait for :func:`zerospeed.initialize` — ``"cpu"``
    (memory), or ``"nvme"`` (swap files under the config's ``offload_param.nvme_path``); default:
    ``"nvme"`` when the config puts ``offload_param`` there, else memory.
    Partitions are made over ``comm``, or ``mesh``'s data-parallel Comm; given neither, over every
    rank (the process group is started if it is not up: :func:`zerospeed.init_distributed`).
    """

    def __init__(self, module: nn.Module | None = None, *, config: Any = None, config_dict_or_path: Any = None,
                 enabled: bool = True, dtype: torch.dtype | None = None, comm: Comm | None = None,
                 mesh: Mesh | None = None, remote_device: str | None = None, **ignored: Any):
        if comm is not None and mesh is not None and comm is not mesh.dp:
            raise ValueError("zero.Init(comm=..., mesh=...): comm must be the mesh's data-parallel Comm "
                             "(mesh.dp); pass one of them")
        self.enabled = enabled
        self._comm = comm if comm is not None else (mesh.dp if mesh is not None else None)
        cfg = _load(config if config is not None else config_dict_or_path, self._data_parallel_size())
        self.dtype = dtype if dtype is not None else _dtype_from(cfg)
        self._remote = remote_device_tier(cfg, remote_device)  # the NVMe tier partitions go to, or None
        self._stash: NvmeStash | None = None
        self._patched: list[tuple[type, Any]] = []
        self._next_id = 0  # ds_id of the next parameter partitioned here (DeepSpeed: construction order)
        if module is not None and enabled:  # DeepSpeed's Init(module=...) partitions an existing model
            for sub in module.modules():
                self._partition(sub)

    def _data_parallel_size(self) -> int:
        """The size the config's batch arithmetic is checked against (a config filled in for the whole
        job, e.g. by the HF Trainer, names the global batch): the group given, else the whole job."""
        if self._comm is not None:
            return self._comm.world_size
        return group_size() if is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def comm(self) -> Comm:
        if self._comm is None:  # called outside initialize with no group given: every rank
            if not is_initialized():
                from zerospeed.distributed.env import init_distributed

                init_distributed()
            self._comm = Comm(name="zero.Init")
        return self._comm

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        _ = self.comm
        for cls in _all_module_classes():
            if "__init__" in cls.__dict__:
                self._wrap(cls)
        return self

    def __exit__(self, *exc: Any) -> None:
        for cls, original in reversed(self._patched):
            cls.__init__ = original
        self._patched = []

    def _wrap(self, cls: type) -> None:
        original = cls.__dict__["__init__"]
        init = self

        def __init__(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            original(module, *args, **kwargs)
            if _most_derived_init(module) is cls:  # not inside a subclass's super().__init__()
                init._partition(module)

        __init__.__wrapped__ = original  # type: ignore[attr-defined]
        cls.__init__ = __init__  # type: ignore[misc]  # patched on the class itself, restored on exit
        self._patched.append((cls, original))

    def partition(self, module: nn.Module) -> None:
        """Partition ``module``'s parameters now (those not partitioned yet), as construction inside
        this context does: for a model built on the meta device and materialised one piece at a time
        (each piece filled, then partitioned here -- onto NVMe with ``remote_device="nvme"``), so that
        it never exists whole in memory. Collective, like construction under the context."""
        if not self.enabled:
            raise RuntimeError("zero.Init(enabled=False).partition(...): this Init partitions nothing; "
                               "make it with enabled=True")
        meta = [name for name, p in module.named_parameters() if p.is_meta and owner_of(p) is None]
        if meta:
            raise ValueError(f"zero.Init.partition: parameter {meta[0]!r} is still on the meta device; "
                             f"materialise it first (module.to_empty(device='cpu') and fill it)")
        self._partition(module)

    def _partition(self, module: nn.Module) -> None:
        """Partition every parameter of ``module``'s subtree not yet partitioned."""
        for param in module.parameters():
            if owner_of(param) is not None:
                continue
            if self.dtype is not None and param.is_floating_point() and param.dtype != self.dtype:
                param.data = param.data.to(self.dtype)
            if self._remote is not None and self._stash is None and param.device.type == "cpu":
                self._stash = NvmeStash(self._remote, self.comm)
            stash = self._stash if param.device.type == "cpu" else None
            set_owner(param, InitPartition(param, self.comm, stash, ds_id=self._next_id))
            self._next_id += 1


def _most_derived_init(module: nn.Module) -> type:
    """The class whose ``__init__`` runs last for ``module`` (a subclass's ``super().__init__()``
    returns before the subclass has finished making its parameters)."""
    return next(c for c in type(module).__mro__ if "__init__" in c.__dict__)


def _load(config: Any, world_size: int) -> Any:
    if config is None:
        return None
    from zerospeed.config import Config, load_config

    return config if isinstance(config, Config) else load_config(config, world_size=world_size)


def _dtype_from(cfg: Any) -> torch.dtype | None:
    if cfg is None:
        return None
    from zerospeed.precision.policy import policy_from_config

    return policy_from_config(cfg).param_dtype


@contextlib.contextmanager
def GatheredParameters(params: torch.Tensor | Iterable[torch.Tensor | None], modifier_rank: int | None = None,
                       fwd_module: nn.Module | None = None, enabled: bool = True) -> Iterator[None]:
    """Make partitioned parameters whole inside the block (a no-op for parameters that are not)."""
    tensors = [params] if isinstance(params, torch.Tensor) else [p for p in params if p is not None]
    if not enabled:
        yield
        return
    partitions = [o for o in map(init_partition, tensors) if o is not None]
    engine_units: list[FlatParamUnit] = []
    for p in tensors:
        owner = engine_owner(p)
        unit = owner.unit if owner is not None else None
        if unit is not None and all(unit is not u for u in engine_units):
            engine_units.append(unit)
    gathered = [(unit, unit.gathered) for unit in engine_units if not unit.persistent]
    for partition in partitions:
        partition.gather()
    for unit, _ in gathered:
        unit.gather()
    try:
        yield
    finally:
        for partition in partitions:
            partition.release(modifier_rank)
        for unit, was_gathered in gathered:
            if modifier_rank is not None:
                _adopt_edits(unit, modifier_rank)
            if not was_gathered:
                unit.release()
        if modifier_rank is not None:
            for unit in engine_units:
                if unit.persistent:
                    _adopt_edits(unit, modifier_rank)


def _adopt_edits(unit: FlatParamUnit, modifier_rank: int) -> None:
    """Broadcast ``modifier_rank``'s full unit and make it every rank's shard and fp32 master."""
    unit.comm.broadcast(unit.full, src=modifier_rank)
    lo, hi = unit.plan.shard_range(unit.comm.rank)
    with torch.no_grad(), unit.shard_resident(write_back=True):
        unit.shard.copy_(unit.full[lo:hi])
        if unit.master is not None and unit.master is not unit.shard:
            with unit.master_resident():  # an NVMe-tier master is read in, updated, written back
                unit.master.copy_(unit.shard)
