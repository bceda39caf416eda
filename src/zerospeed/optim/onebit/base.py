"""What 1-bit Adam, 0/1 Adam and 1-bit LAMB share: the replica group, the compressed momentum
buffers with their error feedback, and saving those buffers per rank.

The compressed exchange runs once per parameter group over the group's momenta laid end to end
(as DeepSpeed's fp16 path hands its 1-bit optimizers one flat tensor per group), padded with zeros
to DeepSpeed's length: a multiple of ``world * lcm(world, 8)``, so every server chunk is whole
bytes of signs. The padding is part of the algorithm: the scales are norms over the padded length.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.optim import Optimizer

from zerospeed.distributed.comm import Comm

__all__ = ["COMM_BACKENDS", "CompressedMomentum", "OneBitOptimizer", "padded_length"]

#: DeepSpeed's ``comm_backend_name`` values; every one runs the same exchange over our comm door
#: (gloo or NCCL, whatever the process group is).
COMM_BACKENDS = ("nccl", "mpi", "hccl", "compressed")


def grad_of(p: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient: only parameters that received one step (:meth:`OneBitOptimizer._with_grads`)."""
    assert p.grad is not None, "only parameters with gradients step"
    return p.grad


def padded_length(numel: int, world: int) -> int:
    """DeepSpeed's corrected size: ``numel`` rounded up to a multiple of ``world * lcm(world, 8)``."""
    unit = world * (world * 8 // math.gcd(world, 8))
    return -(-numel // unit) * unit


class CompressedMomentum:
    """One parameter group's error-feedback buffers: the worker error over the padded length and
    this rank's server error over its chunk (zeros when compression starts), and the padding's
    values (1-bit LAMB's fused buffer keeps the last result there; others pad with zeros)."""

    def __init__(self, numel: int, world: int, device: torch.device):
        self.numel = numel
        self.world = world
        self.padded = padded_length(numel, world)
        self.worker_error = torch.zeros(self.padded, dtype=torch.float32, device=device)
        self.server_error = torch.zeros(self.padded // world, dtype=torch.float32, device=device)
        self.padding = torch.zeros(self.padded - numel, dtype=torch.float32, device=device)
        self._buffer: torch.Tensor | None = None  # the exchange's workspace (the padded momenta)

    def exchange(self, comm: Comm, tensors: Sequence[torch.Tensor], carry_padding: bool = False) -> None:
        """Replace ``tensors`` (this rank's momenta, fp32) by their compressed average over ``comm``.
        ``carry_padding``: the padding enters with the previous exchange's result in it, as in
        DeepSpeed's persistent fused buffer (1-bit LAMB), instead of zeros."""
        from zerospeed.distributed.compressed import compressed_allreduce

        if self._buffer is None:  # kept between steps: a fresh large tensor each step costs page faults
            self._buffer = torch.empty(self.padded, dtype=torch.float32, device=self.worker_error.device)
        buffer = self._buffer
        offset = 0
        for t in tensors:
            buffer[offset: offset + t.numel()].copy_(t.reshape(-1))
            offset += t.numel()
        assert offset == self.numel, "the group's momenta are laid out as at the start"
        if carry_padding:
            buffer[self.numel:].copy_(self.padding)
        else:
            buffer[self.numel:].zero_()
        compressed_allreduce(comm, buffer, self.worker_error, self.server_error)
        if carry_padding:
            self.padding.copy_(buffer[self.numel:])
        offset = 0
        for t in tensors:
            t.copy_(buffer[offset: offset + t.numel()].view_as(t))
            offset += t.numel()

    def saved(self) -> dict[str, Any]:
        return {"numel": self.numel, "world": self.world, "worker_error": self.worker_error.clone(),
                "server_error": self.server_error.clone(), "padding": self.padding.clone()}

    @classmethod
    def exact(cls, saved: dict[str, Any], device: torch.device) -> "CompressedMomentum":
        """This rank's buffers as its own save left them (the same world size)."""
        out = cls(int(saved["numel"]), int(saved["world"]), device)
        out.worker_error.copy_(saved["worker_error"])
        out.server_error.copy_(saved["server_error"])
        if "padding" in saved:
            out.padding.copy_(saved["padding"])
        return out

    @classmethod
    def restored(cls, saved: list[dict[str, Any]], rank: int, world: int,
                 device: torch.device) -> "CompressedMomentum":
        """Rank ``rank``'s buffers at another world size, from every saved rank's: each new worker error
        is the mean of the old ones (so the mean over ranks, the part of the average that was not yet
        sent, is unchanged) and the server errors, laid end to end, are cut into the new chunks (another
        world pads to another length: the padding restarts at zero)."""
        numel = int(saved[0]["numel"])
        if any(int(s["numel"]) != numel for s in saved):
            raise ValueError("the saved ranks' compression buffers cover different numbers of elements")
        out = cls(numel, world, device)
        mean = torch.stack([s["worker_error"][:numel].float() for s in saved]).mean(0)
        out.worker_error[:numel].copy_(mean)
        servers = torch.cat([s["server_error"].float() for s in saved])[:numel]
        chunk = out.padded // world
        start = rank * chunk
        part = servers[start: start + chunk]
        out.server_error[: part.numel()].copy_(part)
        return out


class OneBitOptimizer(Optimizer):
    """The part of the three 1-bit optimizers that is about ranks, not about the update rule.

    ``comm``: the replica group. The model state binds it when the engine adopts the optimizer
    (:meth:`bind_exchange`); an optimizer built outside ``zerospeed.initialize`` can be given one.
    """

    #: The algorithm's name in errors ("1-bit Adam"...).
    algorithm = "1-bit optimizer"

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], *, comm_backend_name: str,
                 amsgrad: bool = False, eps_inside_sqrt: bool = False, cuda_aware: bool = False,
                 deepspeed: Any = None, comm: Comm | None = None):
        """``amsgrad`` is refused; ``eps_inside_sqrt`` and ``cuda_aware`` are kept, as DeepSpeed keeps them,
        and change nothing (its updates never read them)."""
        if amsgrad:
            raise ValueError(f"amsgrad: {self.algorithm} has no AMSGrad variant; remove the key")
        if comm_backend_name not in COMM_BACKENDS:
            raise ValueError(f"comm_backend_name: {comm_backend_name!r} is not one of {', '.join(COMM_BACKENDS)} "
                             f"(all of them run the same compressed exchange over the process group)")
        super().__init__(params, defaults)
        self.comm_backend_name = comm_backend_name
        self._comm: Comm | None = comm
        if comm is None and isinstance(getattr(deepspeed, "comm", None), Comm):
            self._comm = deepspeed.comm  # DeepSpeed's ``deepspeed=engine`` argument
        self._momenta: dict[int, CompressedMomentum] = {}
        self.eps_inside_sqrt = eps_inside_sqrt
        self.cuda_aware = cuda_aware
        self.initialized = False  # DeepSpeed's first step() only sets the state up
        self.on_pieces = False  # the tensors are ZeRO shard pieces until params_replaced() (bind_exchange)

    # -- what every step does ---------------------------------------------------------------
    @staticmethod
    def _closure_loss(closure: Any) -> Any:
        """``closure()`` with gradients on (``step`` runs under ``no_grad``), or None without one."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def _with_grads(self, group: dict[str, Any]) -> list[torch.Tensor]:
        """The group's parameters that received a gradient; sparse gradients are refused."""
        params = [p for p in group["params"] if p.grad is not None]
        if any(p.grad.is_sparse for p in params):
            raise RuntimeError(f"{self.algorithm} does not support sparse gradients")
        return params

    @staticmethod
    def _mask(group: dict[str, Any], tensors: Sequence[torch.Tensor]) -> None:
        """DeepSpeed's ``exp_avg_mask``: values that must stay exactly zero (compression cannot say 0)."""
        mask = group.get("exp_avg_mask")
        if mask is not None:
            for t in tensors:
                t.mul_(mask.to(t.device))

    # -- ranks ------------------------------------------------------------------------------
    def bind_exchange(self, comm: Comm, *, pieces: bool = False) -> None:
        self.on_pieces = pieces
        if self._comm is not None and self._comm is not comm and self._comm.global_ranks != comm.global_ranks:
            raise ValueError(f"{type(self).__name__} already exchanges over ranks {self._comm.global_ranks}; a second "
                             f"model state over ranks {comm.global_ranks} (expert parallelism) is not supported: "
                             f"1-bit optimizers need one replica group")
        self._comm = comm

    @property
    def comm(self) -> Comm:
        if self._comm is None:
            raise RuntimeError(f"{type(self).__name__} has no data-parallel group: let zerospeed.initialize "
                               f"build or adopt it (the engine binds the group), or pass comm=")
        return self._comm

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def momentum_buffers(self, index: int, tensors: Sequence[torch.Tensor]) -> CompressedMomentum:
        """Group ``index``'s error buffers, made (zeros) when its compressed exchange first runs."""
        numel = sum(t.numel() for t in tensors)
        found = self._momenta.get(index)
        if found is None:
            found = self._momenta[index] = CompressedMomentum(numel, self.world_size, tensors[0].device)
        elif found.numel != numel or found.world != self.world_size:
            raise ValueError(f"{type(self).__name__}: the compression buffers of parameter group {index} cover "
                             f"{found.numel} elements over {found.world} ranks; the group now has {numel} "
                             f"elements over {self.world_size} ranks")
        return found

    def reset_error_feedback(self) -> None:
        """Drop the error buffers (0/1 Adam restarts them when its variance freezes)."""
        self._momenta.clear()

    def side_tensors(self) -> list[torch.Tensor]:
        """The compression buffers (error feedback, workspace): kept outside ``self.state``."""
        out: list[torch.Tensor] = []
        for momentum in self._momenta.values():
            out += [momentum.worker_error, momentum.server_error, momentum.padding]
            if momentum._buffer is not None:
                out.append(momentum._buffer)
        return out

    # -- per-rank checkpoint state ------------------------------------------------------------
    def rank_state(self) -> dict[str, Any]:
        return {"format": 1, "groups": {i: m.saved() for i, m in self._momenta.items()}, **self._rank_extra()}

    def load_rank_states(self, read: Callable[[int], dict[str, Any]], saved_world: int, rank: int,
                         world_size: int) -> None:
        self._momenta.clear()
        if saved_world == world_size:  # this rank's own save: nothing else to read
            own = read(rank)
            for index, entry in own.get("groups", {}).items():
                self._momenta[index] = CompressedMomentum.exact(entry, self._device(index))
            self._load_rank_extra(own)
        else:
            saved = [read(r) for r in range(saved_world)]
            indices = {i for s in saved for i in s.get("groups", {})}
            for index in sorted(indices):
                groups = [s.get("groups", {}).get(index) for s in saved]
                if any(g is None for g in groups):
                    raise ValueError(f"{type(self).__name__}: parameter group {index}'s compression buffers are "
                                     f"missing from some saved ranks")
                self._momenta[index] = CompressedMomentum.restored(groups, rank, world_size,
                                                                   self._device(index))
            self._load_rank_extra(saved[0])
        self.sync_phase()

    def _device(self, index: int) -> torch.device:
        """Where group ``index``'s buffers live: its tensors' device (every tensor is on one device; under ZeRO
        a group may hold no piece on this rank, yet its buffers are restored for after the hand-over)."""
        group = self.param_groups[index]["params"] or [p for g in self.param_groups for p in g["params"]]
        return group[0].device if group else torch.device("cpu")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """DeepSpeed's rule: the checkpoint's state decides the phase; the user's ``exp_avg_mask``
        (not the saved one) stays, since it may change between stages of a training."""
        masks = [group.get("exp_avg_mask") for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, mask in zip(self.param_groups, masks):
            group.pop("exp_avg_mask", None)
            if mask is not None:
                group["exp_avg_mask"] = mask
        self.sync_phase()

    def sync_phase(self) -> None:
        """Derive the algorithm's phase (warm-up, compression...) from restored state."""

    def params_replaced(self) -> None:
        """ZeRO's shard pieces were replaced by whole tensors, the state re-keyed (see
        :class:`~zerospeed.zero.handover.HandoverState`): the phase and caches follow the new tensors."""
        self.on_pieces = False
        self.sync_phase()

    def _phase_state(self) -> dict[str, Any]:
        """The state of the first parameter, in any group, that has a step count (every parameter
        steps together, so any one tells the phase); empty before the first step. Under ZeRO a group
        may hold no piece on this rank, so the first group's first tensor need not have one."""
        return next((self.state[p] for group in self.param_groups for p in group["params"]
                     if "step" in self.state.get(p, {})), {})

    def _rank_extra(self) -> dict[str, Any]:
        """Subclasses' own per-rank values (plain data)."""
        return {}

    def _load_rank_extra(self, saved: dict[str, Any]) -> None:
        """Restore :meth:`_rank_extra`."""
