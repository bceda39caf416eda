"""1-bit Adam (Tang et al. 2021), as DeepSpeed 0.19.6's ``OnebitAdam`` computes it.

Warm-up: the engine averages the gradients and each step is Adam without bias correction, with eps
outside the square root. The first ``step()`` only sets the state up (``step`` becomes 1, nothing is
updated), as DeepSpeed's does. Once a step reaches ``freeze_step`` the variance freezes and from
the next step on the gradients stay on their rank: each rank folds its own gradient into the
momentum, the momenta are averaged by the error-compensated 1-bit exchange
(:mod:`zerospeed.distributed.compressed`), and the update uses the frozen variance. Unlike
DeepSpeed, a resumed run continues where it stopped (DeepSpeed re-runs its set-up step and resets
the error buffers; ours are saved per rank, see :class:`OneBitOptimizer`).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from zerospeed.distributed.comm import Comm
from zerospeed.optim.onebit.base import OneBitOptimizer, grad_of

__all__ = ["OnebitAdam"]


class OnebitAdam(OneBitOptimizer):
    """DeepSpeed's signature; ``bias_correction``, ``eps_inside_sqrt``, ``max_grad_norm`` and
    ``cuda_aware`` are accepted and, as in DeepSpeed, do not change the update."""

    algorithm = "1-bit Adam"

    def __init__(self, params: Iterable[Any], deepspeed: Any = None, lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_grad_norm: float = 0.0,
                 amsgrad: bool = False, cuda_aware: bool = False, comm_backend_name: str = "nccl", *,
                 comm: Comm | None = None):
        if freeze_step < 1:
            raise ValueError(f"freeze_step: {freeze_step} must be >= 1 (the number of uncompressed warm-up steps)")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults, comm_backend_name=comm_backend_name, amsgrad=amsgrad,
                         eps_inside_sqrt=eps_inside_sqrt, cuda_aware=cuda_aware, deepspeed=deepspeed, comm=comm)
        self.freeze_step = freeze_step
        self.frozen = False  # the variance is frozen and the momentum travels compressed
        self._denominators: dict[torch.Tensor, torch.Tensor] = {}  # sqrt(frozen variance) + eps, per parameter

    def reduces_gradients(self) -> bool:
        return not self.frozen

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = self._closure_loss(closure)
        last: dict[str, Any] | None = None
        for index, group in enumerate(self.param_groups):
            params = self._with_grads(group)
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                last = state
            if not self.initialized or not params:
                continue
            beta1, beta2 = group["betas"]
            compressed = self.frozen and not group.get("non_freeze", False)  # else the variance still moves
            if not compressed:
                for p in params:
                    grad = grad_of(p)
                    if self.frozen:  # DeepSpeed's per-group escape: averaged exactly, variance kept moving
                        grad = grad.clone()
                        self.comm.all_reduce(grad, "avg")
                    exp_avg, exp_avg_sq = self.state[p]["exp_avg"], self.state[p]["exp_avg_sq"]
                    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            else:
                momenta = [self.state[p]["exp_avg"] for p in params]
                for p, exp_avg in zip(params, momenta):
                    exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                if self.world_size > 1:
                    self.momentum_buffers(index, momenta).exchange(self.comm, momenta)
                self._mask(group, momenta)
            for p in params:
                state = self.state[p]
                denominator = self._denominators.get(p) if compressed else None
                if denominator is None:
                    denominator = state["exp_avg_sq"].sqrt() + group["eps"]
                    if compressed:  # the same values every step from here on: computed once
                        self._denominators[p] = denominator
                update = state["exp_avg"] / denominator
                if group["weight_decay"] > 0.0:
                    update += group["weight_decay"] * p
                p.add_(-group["lr"] * update)
        if not self.initialized:
            self.initialized = True
            return loss
        if not self.frozen and last is not None and last["step"] >= self.freeze_step:
            self.frozen = True
        return loss

    def side_tensors(self) -> list[torch.Tensor]:
        return super().side_tensors() + list(self._denominators.values())

    def sync_phase(self) -> None:
        """Warm-up or compression from the saved step counts (after any state restore)."""
        self._denominators.clear()
        steps = [s["step"] for s in self.state.values() if "step" in s]
        if steps:
            self.initialized = True
            self.frozen = max(steps) >= self.freeze_step
