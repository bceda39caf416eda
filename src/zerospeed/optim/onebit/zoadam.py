"""0/1 Adam (Lu et al. 2022), as DeepSpeed 0.19.6's ``ZeroOneAdam`` computes it.

The phases, counted in ``step()`` calls:

- the first call only sets the state up (``step`` becomes 1, nothing moves);
- variance phase, through step ``var_freeze_step + 1``: the variance is updated on steps that
  are multiples of ``var_interval``, which starts at 1 and doubles every ``var_update_scaler``
  such updates. On those steps the engine averages the gradients (DeepSpeed's
  ``enable_backward_allreduce``, answered here by :meth:`reduces_gradients` for the coming window)
  and both moments move; on the others each rank's own gradient is averaged by the 1-bit exchange
  and only the momentum moves (on one rank it does not move at all: DeepSpeed's update sits inside
  its ``size > 1`` branch). Adam without bias correction, eps outside the square root.
- local phase, after step ``var_freeze_step + 1`` (the error buffers restart at zero then): the
  gradients stay on their rank, each rank folds its own gradient into its momentum and steps its
  own parameters, accumulating the steps taken (``momentum_accumulator``) and the learning rates
  (``lrs``). Every ``local_step_interval``-th step (by the absolute step count) the ranks meet:
  each undoes its local steps, the accumulated steps scaled by the frozen denominator are averaged
  by the 1-bit exchange, the momentum becomes their learning-rate-weighted mean and the parameters
  take the averaged step. The interval doubles every ``local_step_scaler`` steps, up to
  ``local_step_clipper``. Between meetings nothing is communicated.

DeepSpeed compresses each tensor on its own; here each parameter group is exchanged as one buffer,
its tensors laid end to end (the error buffers are per group, see :class:`OneBitOptimizer`).
Parameters and momenta differ between ranks in the local phase, so a checkpoint keeps each rank's
own copy (:meth:`rank_state`) and a run resumed at the same world size continues exactly (DeepSpeed
instead restarts its intervals, accumulator and error buffers on load); at another world size the
engine's element-wise restored values are used.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from zerospeed.distributed.comm import Comm
from zerospeed.optim.onebit.base import OneBitOptimizer, grad_of

__all__ = ["ZeroOneAdam"]

#: Per-parameter state differing between ranks in the local phase, saved per rank.
_OWN_KEYS = ("exp_avg", "momentum_accumulator")


def _at_least(name: str, value: int, low: int, why: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: {value!r} must be an integer >= {low} ({why})")


class ZeroOneAdam(OneBitOptimizer):
    """DeepSpeed's signature; ``bias_correction``, ``eps_inside_sqrt``, ``max_grad_norm`` and
    ``cuda_aware`` are accepted and, as in DeepSpeed, do not change the update."""

    algorithm = "0/1 Adam"

    def __init__(self, params: Iterable[Any], deepspeed: Any = None, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, var_freeze_step: int = 100000,
                 var_update_scaler: int = 16, local_step_scaler: int = 32678, local_step_clipper: int = 16,
                 amsgrad: bool = False, cuda_aware: bool = False, comm_backend_name: str = "nccl", *,
                 comm: Comm | None = None):
        _at_least("var_freeze_step", var_freeze_step, 0, "the last step that may update the variance")
        _at_least("var_update_scaler", var_update_scaler, 1, "variance updates before their interval doubles")
        _at_least("local_step_scaler", local_step_scaler, 1, "steps before the local step interval doubles")
        _at_least("local_step_clipper", local_step_clipper, 1, "the largest local step interval")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults, comm_backend_name=comm_backend_name, amsgrad=amsgrad,
                         eps_inside_sqrt=eps_inside_sqrt, cuda_aware=cuda_aware, deepspeed=deepspeed, comm=comm)
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        self.frozen = False  # DeepSpeed's freeze_key: the variance is frozen, steps are local
        self.allreduce_next = True  # DeepSpeed's enable_backward_allreduce, for the coming window
        self._own_pending: list[dict[str, Any]] = []  # a checkpoint's rank-local values, being restored

    def reduces_gradients(self) -> bool:
        return self.allreduce_next

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = self._closure_loss(closure)
        for index, group in enumerate(self.param_groups):
            params = self._with_grads(group)
            for p in params:
                state = self.state[p]
                if not state:
                    self._init_state(p)
                state["step"] += 1
            if self.initialized and params:
                self._step_group(index, group, params)
        if not self.initialized:
            self.initialized = True
            return loss
        first = self._phase_state()
        if not self.frozen and first.get("step", 0) > self.var_freeze_step:
            self.frozen = True
            self.reset_error_feedback()  # the errors now measure accumulated steps, not gradients
        if self.frozen:
            self.allreduce_next = False
        return loss

    def _init_state(self, p: torch.Tensor) -> None:
        self.state[p].update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p),
                             momentum_accumulator=torch.zeros_like(p), var_interval=1, var_counter=0,
                             local_step_interval=1, local_step_counter=0, lrs=0.0)

    def _step_group(self, index: int, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        states = [self.state[p] for p in params]
        world = self.world_size
        if not self.frozen:
            exchanged = []
            for p, state in zip(params, states):
                if state["step"] % state["var_interval"] == 0:  # the engine averaged this gradient
                    state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                    state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                else:
                    exchanged.append((p, state))
            if exchanged and world > 1:
                grads = [grad_of(p).float().clone() for p, _ in exchanged]
                self.momentum_buffers(index, grads).exchange(self.comm, grads)
                self._mask(group, grads)
                for (_, state), grad in zip(exchanged, grads):
                    state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
        else:
            for p, state in zip(params, states):
                state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["lrs"] += group["lr"]
        for p, state in zip(params, states):
            update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + group["eps"])
            if group["weight_decay"] > 0.0:
                update += group["weight_decay"] * p
            p.add_(-group["lr"] * update)
            if self.frozen:
                state["momentum_accumulator"].add_(-group["lr"] * update)
        if self.frozen:
            meeting = [(p, s) for p, s in zip(params, states) if s["step"] % s["local_step_interval"] == 0]
            if meeting:
                self._meet(index, group, meeting)
        for state in states:
            self._advance_intervals(state)

    def _meet(self, index: int, group: dict[str, Any], meeting: list[tuple[torch.Tensor, dict[str, Any]]]) -> None:
        """The ranks' local steps replaced by their compressed average."""
        buffers = []
        for p, state in meeting:
            buffer = state["momentum_accumulator"]
            p.add_(-1 * buffer)
            buffer.mul_(state["exp_avg_sq"].sqrt() + group["eps"])
            buffers.append(buffer)
        if self.world_size > 1:
            self.momentum_buffers(index, buffers).exchange(self.comm, buffers)
            self._mask(group, buffers)
        for p, state in meeting:
            buffer = state["momentum_accumulator"]
            state["exp_avg"].zero_().add_(buffer / state["lrs"], alpha=-1)
            p.add_(buffer / (state["exp_avg_sq"].sqrt() + group["eps"]))
            buffer.zero_()
            state["lrs"] = 0.0

    def _advance_intervals(self, state: dict[str, Any]) -> None:
        """DeepSpeed's interval policies, after the step; in the variance phase the next window's
        all-reduce is decided here (the last parameter's answer stands, as in DeepSpeed)."""
        if not self.frozen:
            if state["step"] % state["var_interval"] == 0:
                state["var_counter"] += 1
                if state["var_counter"] == self.var_update_scaler:
                    state["var_counter"] = 0
                    state["var_interval"] *= 2
            self.allreduce_next = (state["step"] + 1) % state["var_interval"] == 0
        else:
            state["local_step_counter"] += 1
            if state["local_step_counter"] == self.local_step_scaler:
                state["local_step_counter"] = 0
                state["local_step_interval"] = min(self.local_step_clipper, state["local_step_interval"] * 2)

    # -- checkpoints ----------------------------------------------------------------------------
    def _owned(self) -> list[tuple[int, int, torch.Tensor]]:
        return [(i, j, p) for i, group in enumerate(self.param_groups)
                for j, p in enumerate(group["params"]) if "step" in self.state.get(p, {})]

    def _rank_extra(self) -> dict[str, Any]:
        """In the local phase each rank's parameters, momenta and accumulated steps are its own."""
        if not self.frozen:
            return {}
        return {"own": [{"group": i, "index": j, "param": p.detach().clone(),
                         **{k: self.state[p][k].detach().clone() for k in _OWN_KEYS}}
                        for i, j, p in self._owned()]}

    def _load_rank_extra(self, saved: dict[str, Any]) -> None:
        """Only meaningful at the saved world size (``load_rank_states`` hands rank 0's otherwise)."""
        self._own_pending = saved.get("own", [])

    def load_rank_states(self, read: Callable[[int], dict[str, Any]], saved_world: int, rank: int,
                         world_size: int) -> None:
        self._own_pending = []
        super().load_rank_states(read, saved_world, rank, world_size)
        if saved_world != world_size:
            self._own_pending = []  # another world: the element-wise values the engine restored stand
            return
        self._apply_own(final=not self.on_pieces)

    def _apply_own(self, final: bool) -> None:
        """Put the pending rank-local values on the parameters they were saved from. While the
        optimizer holds ZeRO shard pieces (a local-phase checkpoint loaded at stage 1-2) they do not fit:
        they wait for the whole tensors the model state hands over at the end of that load
        (:meth:`params_replaced`); on whole tensors (``final``) a misfit is an error."""
        if not self._own_pending:
            return
        where = {(i, j): p for i, j, p in self._owned()}
        placed = [(where.get((int(entry["group"]), int(entry["index"]))), entry) for entry in self._own_pending]
        misfit = next((entry for p, entry in placed if p is None or p.shape != entry["param"].shape), None)
        if misfit is not None:
            if final:
                raise ValueError(f"ZeroOneAdam: the checkpoint holds rank-local values for parameter "
                                 f"{misfit['index']} of group {misfit['group']} (shape "
                                 f"{tuple(misfit['param'].shape)}), which has no such state here")
            return
        with torch.no_grad():
            for p, entry in placed:
                assert p is not None
                p.copy_(entry["param"])
                for key in _OWN_KEYS:
                    self.state[p][key].copy_(entry[key])
        self._own_pending = []

    def params_replaced(self) -> None:
        super().params_replaced()
        self._apply_own(final=True)

    def sync_phase(self) -> None:
        """Phase and the coming window's all-reduce from the restored step counts, as DeepSpeed's
        ``load_state_dict`` derives them."""
        first = self._phase_state()
        if "step" not in first:
            return
        self.initialized = True
        self.frozen = first["step"] > self.var_freeze_step
        self.allreduce_next = (not self.frozen and (first["step"] + 1) % first["var_interval"] == 0)
