"""1-bit LAMB (Li et al. 2021), as DeepSpeed 0.19.6's ``OnebitLamb`` computes it.

- The first ``step()`` only sets the state up (``step`` becomes 1, nothing moves).
- Warm-up, through step ``freeze_step``: the engine averages the gradients and each step is LAMB
  without bias correction (eps outside the square root): the trust ratio ``||p|| / ||update||``
  (1.0 when either norm is zero) clipped to ``[min_coeff, max_coeff]``. Each ratio other than
  exactly 1.0 enters a running average ``lamb_coeff_freeze`` (weight ``coeff_beta``) that the
  compression stage uses; at step ``freeze_step`` the variance is copied to ``exp_avg_sq_fresh``.
- Compression, after step ``freeze_step``: the gradients stay on their rank. On the first such
  step every momentum gets a ``scaling_coeff``: the mean over all tensors of
  ``||m|| / sqrt(numel)`` divided by its own, so the tensors travel at one scale. Each rank folds
  its own gradient into its momentum, scales it, and all momenta of all groups, laid end to end in
  one buffer (DeepSpeed's fused ``exp_avg_flat``), are averaged by the 1-bit exchange; the buffer's
  padding keeps the previous exchange's result, as DeepSpeed's persistent buffer does. Then the
  scale is divided out (also on one rank, where nothing is exchanged), the gradient is
  reconstructed from the momentum's change to keep ``exp_avg_sq_fresh`` moving while the variance
  stays frozen, and the frozen coefficient is scaled by a factor: the largest ratio of the frozen
  to the fresh denominator (blended toward 1 by the share of weight decay in the update), clipped
  to ``[factor_min, factor_max]`` and to within ``factor_threshold`` of the last factor.

The coefficients are plain floats (per-parameter scalars in checkpoints); the error buffers and the
padding are saved per rank, so a resumed run continues exactly (DeepSpeed resets the errors on
load, and in warm-up also the coefficient average).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch

from zerospeed.distributed.comm import Comm
from zerospeed.optim.onebit.base import OneBitOptimizer

__all__ = ["OnebitLamb"]


def _without_empty(params: Iterable[Any]) -> list[Any]:
    """DeepSpeed's ``filter_empty_parameters``: tensors with no elements (a division by their size
    would be NaN) are left out, and so are groups left with none."""
    items = list(params)
    if items and isinstance(items[0], dict):
        out = []
        for group in items:
            kept = [p for p in group["params"] if p.numel() > 0]
            if kept:
                out.append({**group, "params": kept})
        return out
    return [p for p in items if p.numel() > 0]


class OnebitLamb(OneBitOptimizer):
    """DeepSpeed's signature; ``bias_correction``, ``eps_inside_sqrt``, ``max_grad_norm`` and
    ``cuda_aware`` are accepted and, as in DeepSpeed, do not change the update."""

    algorithm = "1-bit LAMB"

    def __init__(self, params: Iterable[Any], deepspeed: Any = None, lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_grad_norm: float = 0.0,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, amsgrad: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str = "nccl", coeff_beta: float = 0.9, factor_max: float = 4.0,
                 factor_min: float = 0.5, factor_threshold: float = 0.1, *, comm: Comm | None = None):
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
            raise ValueError(f"freeze_step: {freeze_step!r} must be an integer >= 1 (the last uncompressed "
                             f"warm-up step)")
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"min_coeff, max_coeff: {min_coeff}, {max_coeff} must satisfy 0 <= min_coeff <= "
                             f"max_coeff (the range of the trust ratio)")
        if not 0.0 <= coeff_beta < 1.0:
            raise ValueError(f"coeff_beta: {coeff_beta} must be in [0, 1) (the weight of the coefficient average)")
        if not 0.0 < factor_min <= factor_max:
            raise ValueError(f"factor_min, factor_max: {factor_min}, {factor_max} must satisfy 0 < factor_min <= "
                             f"factor_max (the range of the frozen coefficient's scaling)")
        if not 0.0 <= factor_threshold < 1.0:
            raise ValueError(f"factor_threshold: {factor_threshold} must be in [0, 1) (how far the factor may "
                             f"move in one step)")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        max_grad_norm=max_grad_norm, max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(_without_empty(params), defaults, comm_backend_name=comm_backend_name, amsgrad=amsgrad,
                         eps_inside_sqrt=eps_inside_sqrt, cuda_aware=cuda_aware, deepspeed=deepspeed, comm=comm)
        self.freeze_step = freeze_step
        self.coeff_beta = coeff_beta
        self.factor_max = factor_max
        self.factor_min = factor_min
        self.factor_threshold = factor_threshold
        self.frozen = False  # DeepSpeed's lamb_freeze_key: the momentum travels compressed
        self.lamb_coeffs: list[float] = []  # this step's coefficients, in parameter order
        # ZeRO pieces' squared norms -> whole parameters' (warm-up under ZeRO 1-2; see reduce_norms_with)
        self.norm_reducer: Callable[[list[torch.Tensor], torch.Tensor], torch.Tensor] | None = None

    def reduces_gradients(self) -> bool:
        return not self.frozen

    def get_lamb_coeffs(self) -> list[float]:
        """The last step's coefficients (a copy: the next step refills the list)."""
        return list(self.lamb_coeffs)

    def _stated(self) -> list[tuple[dict[str, Any], torch.Tensor]]:
        """Every (group, parameter) with state, in order: the fused buffer's layout."""
        return [(group, p) for group in self.param_groups for p in group["params"] if "step" in self.state.get(p, {})]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = self._closure_loss(closure)
        self.lamb_coeffs.clear()
        compressing = self.frozen and self.initialized
        last_momenta: dict[int, torch.Tensor] = {}
        if compressing:
            last_momenta = {id(p): self.state[p]["exp_avg"].clone() for _, p in self._stated()}
            self._set_scaling_coeffs()
        last: dict[str, Any] | None = None
        warming: list[tuple[dict[str, Any], torch.Tensor, dict[str, Any]]] = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in self._with_grads(group):
                state = self.state[p]
                if "step" not in state:
                    state.update(step=0, lamb_coeff_freeze=0.0, last_factor=1.0, exp_avg=torch.zeros_like(p),
                                 exp_avg_sq=torch.zeros_like(p), exp_avg_sq_fresh=torch.zeros_like(p))
                state["step"] += 1
                last = state
                if not self.initialized:
                    continue
                exp_avg = state["exp_avg"]
                exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                if compressing:
                    exp_avg.mul_(state["scaling_coeff"])
                    continue
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                if state["step"] == self.freeze_step:
                    state["exp_avg_sq_fresh"] = state["exp_avg_sq"].clone()
                warming.append((group, p, state))
        if self.initialized and not compressing:
            self._warmup_updates(warming)
        if compressing:
            stated = self._stated()
            momenta = [self.state[p]["exp_avg"] for _, p in stated]
            if self.world_size > 1:
                self.momentum_buffers(0, momenta).exchange(self.comm, momenta, carry_padding=True)
            for group, p in stated:
                self._compressed_update(group, p, last_momenta[id(p)])
        if not self.initialized:
            self.initialized = True
            return loss
        if not self.frozen and last is not None and last["step"] >= self.freeze_step:
            self.frozen = True
        return loss

    def reduce_norms_with(self, reducer: Callable[[list[torch.Tensor], torch.Tensor], torch.Tensor]) -> None:
        """The parameters are ZeRO shard pieces during warm-up: ``reducer`` maps their squared norms to the
        whole parameters' (a collective, called on every rank at every warm-up step)."""
        self.norm_reducer = reducer

    def _warmup_updates(self, warming: list[tuple[dict[str, Any], torch.Tensor, dict[str, Any]]]) -> None:
        """LAMB's step, and the coefficient average the compression stage starts from. The weight and
        update norms are whole-tensor norms: over ZeRO pieces they are summed across ranks first."""
        updates = []
        for group, p, state in warming:
            update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + group["eps"])
            if group["weight_decay"] > 0.0:
                update += group["weight_decay"] * p
            updates.append(update)
        params = [p for _, p, _ in warming]
        weight_sq = torch.stack([p.pow(2).sum() for p in params]) if params else torch.zeros(0)
        update_sq = torch.stack([u.pow(2).sum() for u in updates]) if updates else torch.zeros(0)
        if self.norm_reducer is not None:
            weight_sq, update_sq = self.norm_reducer(params, weight_sq), self.norm_reducer(params, update_sq)
        for (group, p, state), update, weight_norm, update_norm in zip(warming, updates, weight_sq.sqrt(),
                                                                      update_sq.sqrt()):
            lamb_coeff = 1.0
            if weight_norm != 0 and update_norm != 0:
                lamb_coeff = min(max((weight_norm / update_norm).item(), group["min_coeff"]), group["max_coeff"])
            if lamb_coeff != 1.0:  # DeepSpeed's quirk: a ratio of exactly 1 is left out of the average
                state["lamb_coeff_freeze"] = (self.coeff_beta * state["lamb_coeff_freeze"]
                                              + (1 - self.coeff_beta) * lamb_coeff)
            self.lamb_coeffs.append(lamb_coeff)
            p.add_(-group["lr"] * lamb_coeff * update)

    def _set_scaling_coeffs(self) -> None:
        """At the first compression step: one scale for all momenta (the mean of their RMS values)."""
        stated = self._stated()
        if not stated or "scaling_coeff" in self.state[stated[0][1]]:
            return
        scales = [(torch.linalg.vector_norm(self.state[p]["exp_avg"]) / math.sqrt(p.numel())).item()
                  for _, p in stated]
        per_group = [[s for (g, _), s in zip(stated, scales) if g is group] for group in self.param_groups]
        united = sum(sum(g) for g in per_group) / len(scales)  # DeepSpeed's summation order: group by group
        for (_, p), scale in zip(stated, scales):
            if scale == 0.0:
                raise RuntimeError(f"1-bit LAMB: a parameter of shape {tuple(p.shape)} has an all-zero momentum "
                                   f"after warm-up, so its compression scale (mean RMS / its RMS) is infinite "
                                   f"(DeepSpeed divides by zero here); give it gradients during warm-up or leave "
                                   f"it out of the optimizer")
            self.state[p]["scaling_coeff"] = united / scale

    def _compressed_update(self, group: dict[str, Any], p: torch.Tensor, last_momentum: torch.Tensor) -> None:
        """The averaged momentum back to its scale, then LAMB with the frozen coefficient rescaled."""
        state = self.state[p]
        beta1, beta2 = group["betas"]
        exp_avg = state["exp_avg"]
        exp_avg.div_(state["scaling_coeff"])
        self._mask(group, [exp_avg])
        grad = (exp_avg - last_momentum * beta1) / (1 - beta1)
        state["exp_avg_sq_fresh"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = state["exp_avg_sq"].sqrt() + group["eps"]
        update_prelim = exp_avg / denom
        update = update_prelim + group["weight_decay"] * p if group["weight_decay"] > 0.0 else update_prelim
        update_norm = update.pow(2).sum().sqrt()
        factor = (denom / (state["exp_avg_sq_fresh"].sqrt() + group["eps"])).max().item()
        if group["weight_decay"] > 0.0:
            ratio = min(1.0, (update_prelim.pow(2).sum().sqrt() / update_norm).item())
            factor = factor * ratio + (1.0 - ratio)
        factor = min(max(factor, self.factor_min), self.factor_max)
        factor = min(max(factor, state["last_factor"] * (1.0 - self.factor_threshold)),
                     state["last_factor"] * (1.0 + self.factor_threshold))
        state["last_factor"] = factor
        lamb_coeff = state["lamb_coeff_freeze"] * factor
        self.lamb_coeffs.append(lamb_coeff)
        p.add_(-group["lr"] * lamb_coeff * update)

    def params_replaced(self) -> None:
        """Whole tensors now (the warm-up's ZeRO pieces are gone): norms need no reduction any more."""
        self.norm_reducer = None
        super().params_replaced()

    def sync_phase(self) -> None:
        """Warm-up or compression from the restored step counts, as DeepSpeed's ``load_state_dict``."""
        steps = [s["step"] for s in self.state.values() if "step" in s]
        if steps:
            self.initialized = True
            self.frozen = max(steps) >= self.freeze_step
