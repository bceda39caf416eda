"""Top-1, top-2 and top-k gating with DeepSpeed's semantics, as pure functions (no collectives).

Each function turns fp32 router logits ``[tokens, experts]`` into a :class:`DispatchPlan`. The
formulas are DeepSpeed's (``deepspeed/moe/sharded_moe.py``, itself after GShard and fairscale):

* capacity: ``ceil(tokens / experts * capacity_factor)`` floored at ``min_capacity``; top-2 and
  top-k scale the factor by k (``capacity_factor * k``).
* l_aux: top-1 ``sum(me * ce) * E``; top-2 ``mean(me * ce) * E * E``; top-k
  ``mean(me * ce) * E * E / k``; ``me`` is the mean gate probability per expert, ``ce`` the
  fraction of tokens whose first choice (top-1, top-2) or any choice (top-k) is that expert,
  measured before any token is dropped.
* combine weights: the raw softmax probability for top-1, the probabilities renormalised over the
  kept choices for top-2 and top-k.

``drop_tokens=True`` gives the capacity plan (``combine_weights`` ``[S, E, C]`` and
``dispatch_mask``). ``drop_tokens=False`` gives the dropless plan: every route kept, as
``expert_indices`` / ``expert_weights`` ``[S, k]``. DeepSpeed reaches "no drops" by raising the
capacity to the largest expert load (an all-reduce MAX over the expert group); the dropless
dispatch needs no capacity at all, so these functions never communicate.

Randomness (random token selection, the Jitter / RSample / second-expert noises) draws from
``generator`` (torch's default generator when None) with the same draws DeepSpeed's
``torch.distributions`` samplers make, so a seeded run matches it number for number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")


@dataclass(frozen=True)
class DispatchPlan:
    """Where every token goes and with what weight.

    Both plans give, per route (token s, choice j), ``expert_indices`` ``[S, k]`` int64 and
    ``expert_weights`` ``[S, k]`` fp32 (0 for a route that is dropped, or masked out by ``used_token``).
    Capacity plan (``capacity`` is an int) also gives ``route_slots`` ``[S, k]`` int64: the route's
    flat slot ``expert * capacity + position`` in the ``[E, C]`` buffer, or ``E * C`` (one scratch
    slot past the end) when it is dropped; ``combine_weights`` ``[S, E, C]`` and the boolean
    ``dispatch_mask`` (DeepSpeed's dense form) are built from them on request. Dropless plan
    (``capacity`` is None): nothing dropped. ``exp_counts`` ``[E]`` counts routes per expert before drops.
    """

    l_aux: Tensor
    exp_counts: Tensor
    capacity: int | None = None
    expert_indices: Tensor | None = None
    expert_weights: Tensor | None = None
    route_slots: Tensor | None = None

    @property
    def dropless(self) -> bool:
        return self.capacity is None

    @property
    def num_experts(self) -> int:
        return int(self.exp_counts.shape[0])

    @property
    def combine_weights(self) -> Tensor | None:
        """Dense ``[S, E, C]`` combine weights of a capacity plan (None for a dropless plan)."""
        if self.capacity is None:
            return None
        assert self.route_slots is not None and self.expert_weights is not None
        num_tokens, slots = self.route_slots.shape[0], self.num_experts * self.capacity
        dense = self.expert_weights.new_zeros(num_tokens, slots + 1)
        dense = dense.scatter_add(1, self.route_slots, self.expert_weights.to(dense.dtype))
        return dense[:, :slots].reshape(num_tokens, self.num_experts, self.capacity)

    @property
    def dispatch_mask(self) -> Tensor | None:
        """Boolean ``[S, E, C]``: which slot each kept route fills (None for a dropless plan)."""
        combine = self.combine_weights
        return None if combine is None else combine.bool()


def expert_capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """DeepSpeed's ``_capacity``: ``max(ceil(tokens / experts * capacity_factor), min_capacity)``."""
    # Same float arithmetic as DeepSpeed (a Python float product, then ceil), so edge cases agree.
    return max(int(math.ceil((num_tokens / num_experts) * capacity_factor)), int(min_capacity))


def uniform(shape: tuple[int, ...] | torch.Size, low: float, high: float, *, device: torch.device,
            generator: torch.Generator | None = None) -> Tensor:
    """``low + U[0,1) * (high - low)``: the draw ``torch.distributions.Uniform(low, high).rsample`` makes."""
    rand = torch.rand(shape, generator=generator, device=device)
    return low + rand * (high - low)


def multiplicative_jitter(x: Tensor, epsilon: float = 1e-2, generator: torch.Generator | None = None) -> Tensor:
    """``x`` times noise uniform in ``[1 - epsilon, 1 + epsilon)`` (Switch Transformer; DeepSpeed's Jitter)."""
    if epsilon == 0:
        return x
    return x * uniform(x.shape, 1.0 - epsilon, 1.0 + epsilon, device=x.device, generator=generator)


def gumbel_noise(shape: tuple[int, ...] | torch.Size, *, device: torch.device,
                 generator: torch.Generator | None = None) -> Tensor:
    """Standard Gumbel noise ``-log(-log(u))``, u uniform in ``[tiny, 1 - eps)`` as torch's Gumbel samples it."""
    finfo = torch.finfo(torch.float32)
    u = uniform(shape, finfo.tiny, 1.0 - finfo.eps, device=device, generator=generator)
    return -torch.log(-torch.log(u))


def _check_logits(logits: Tensor, k: int) -> None:
    if logits.dim() != 2:
        raise ValueError(f"gating: logits must be [tokens, experts], got shape {tuple(logits.shape)}")
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"gating: k={k} must be between 1 and the number of experts ({logits.shape[1]})")


def _capacity_plan(l_aux: Tensor, exp_counts: Tensor, indices: Tensor, kept: Tensor, locations: Tensor,
                   weights: Tensor, capacity: int) -> DispatchPlan:
    """A capacity plan from per-route ``[S, k]`` experts, kept flags, slot positions and combine weights."""
    num_experts = exp_counts.shape[0]
    slots = torch.where(kept.bool(), indices * capacity + locations, torch.full_like(indices, num_experts * capacity))
    return DispatchPlan(l_aux=l_aux, exp_counts=exp_counts, capacity=capacity, expert_indices=indices,
                        expert_weights=weights * kept.to(weights.dtype), route_slots=slots)


def top1gating(logits: Tensor, capacity_factor: float, min_capacity: int, used_token: Tensor | None = None,
               noisy_gate_policy: str | None = None, drop_tokens: bool = True, use_rts: bool = True,
               generator: torch.Generator | None = None) -> DispatchPlan:
    """Top-1 gating. ``RSample`` picks the expert from Gumbel-noised logits (weights stay the clean
    softmax); ``use_rts`` keeps a random ``capacity`` of each expert's tokens instead of the first
    ones. ``used_token`` ``[S]`` (1 = real token) masks padding out of routing and l_aux."""
    _check_logits(logits, 1)
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    if noisy_gate_policy == "RSample":
        chooser = logits + gumbel_noise(logits.shape, device=logits.device, generator=generator)
    else:
        chooser = gates
    indices = torch.argmax(chooser, dim=1)
    mask = F.one_hot(indices, num_classes=num_experts)
    if used_token is not None:
        mask = mask * used_token.reshape(-1, 1).to(mask.dtype)
    exp_counts = mask.sum(dim=0).detach()
    me = gates.mean(dim=0)
    ce = mask.float().mean(dim=0)
    l_aux = torch.sum(me * ce) * num_experts
    if not drop_tokens:
        weights = (gates * mask).sum(dim=1, keepdim=True)
        return DispatchPlan(l_aux=l_aux, exp_counts=exp_counts, expert_indices=indices.reshape(-1, 1),
                            expert_weights=weights)
    capacity = expert_capacity(num_tokens, num_experts, capacity_factor, min_capacity)
    if use_rts:
        # DeepSpeed: the `capacity` tokens with the largest uniform scores stay, per expert.
        scores = mask * uniform(mask.shape, 0.0, 1.0, device=logits.device, generator=generator)
        keep_idx = torch.topk(scores, k=min(capacity, num_tokens), dim=0)[1]
        mask = mask * torch.zeros_like(mask).scatter_(0, keep_idx, 1)
    else:
        # Deterministic first-come order (DeepSpeed takes a topk over 0/1 ties here, whose order
        # torch leaves unspecified).
        mask = mask * torch.lt(torch.cumsum(mask, dim=0) - 1, capacity)
    locations = torch.cumsum(mask, dim=0) - 1
    kept = mask.sum(dim=1, keepdim=True)
    loc = (locations * mask).sum(dim=1, keepdim=True)
    weights = (gates * mask).sum(dim=1, keepdim=True)
    return _capacity_plan(l_aux, exp_counts, indices.reshape(-1, 1), kept, loc, weights, capacity)


def top2gating(logits: Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               top2_2nd_expert_sampling: bool = True, generator: torch.Generator | None = None) -> DispatchPlan:
    """Top-2 gating. The second expert is the best other one, of Gumbel-noised logits when
    ``top2_2nd_expert_sampling``; capacity is for both choices (factor x 2), first choices fill
    their slots before second choices, and the kept gates are renormalised to sum to one."""
    _check_logits(logits, 2)
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    indices1 = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(indices1, num_classes=num_experts)
    second = logits
    if top2_2nd_expert_sampling:
        second = logits + gumbel_noise(logits.shape, device=logits.device, generator=generator)
    indices2 = torch.argmax(second.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(indices2, num_classes=num_experts)
    me = gates.mean(dim=0)
    ce = mask1.float().mean(dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts
    exp_counts = (mask1 + mask2).sum(dim=0).detach()
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
    capacity = None
    if drop_tokens:
        capacity = expert_capacity(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * torch.lt(locations1, capacity)
        mask2 = mask2 * torch.lt(locations2, capacity)
    gates1 = (gates * mask1).sum(dim=1)
    gates2 = (gates * mask2).sum(dim=1)
    denom = torch.clamp(gates1 + gates2, min=torch.finfo(gates.dtype).eps)
    gates1, gates2 = gates1 / denom, gates2 / denom
    if capacity is None:
        return DispatchPlan(l_aux=l_aux, exp_counts=exp_counts, expert_indices=torch.stack([indices1, indices2], 1),
                            expert_weights=torch.stack([gates1, gates2], 1))
    loc1 = (locations1 * mask1).sum(dim=1)
    loc2 = (locations2 * mask2).sum(dim=1)
    return _capacity_plan(l_aux, exp_counts, torch.stack([indices1, indices2], 1),
                          torch.stack([mask1.sum(dim=1), mask2.sum(dim=1)], 1), torch.stack([loc1, loc2], 1),
                          torch.stack([gates1, gates2], 1), capacity)


def topkgating(logits: Tensor, k: int, capacity_factor: float, min_capacity: int,
               drop_tokens: bool = True) -> DispatchPlan:
    """Top-k gating (k >= 3 in the layer; any k here). With ``drop_tokens`` each expert keeps the
    ``capacity`` (factor x k) routes with the largest gate values (DeepSpeed's ``probs`` drop
    policy); the kept gates of a token are renormalised to sum to one."""
    _check_logits(logits, k)
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, True)
    exp_counts = mask.sum(dim=0).detach()
    me = gates.mean(dim=0)
    ce = mask.float().mean(dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts / k
    if not drop_tokens:
        weights = top_gate / torch.clamp(top_gate.sum(dim=1, keepdim=True), min=torch.finfo(gates.dtype).eps)
        return DispatchPlan(l_aux=l_aux, exp_counts=exp_counts, expert_indices=top_idx, expert_weights=weights)
    capacity = expert_capacity(num_tokens, num_experts, capacity_factor * k, min_capacity)
    routed_gates = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
    keep_idx = torch.topk(routed_gates, k=min(capacity, num_tokens), dim=0, sorted=False)[1]
    mask = mask & torch.zeros_like(mask).scatter_(0, keep_idx, True)
    kept = gates * mask
    kept = kept / torch.clamp(kept.sum(dim=-1, keepdim=True), min=torch.finfo(gates.dtype).eps)
    locations = torch.cumsum(mask, dim=0) - 1
    return _capacity_plan(l_aux, exp_counts, top_idx, mask.gather(1, top_idx), locations.gather(1, top_idx),
                          kept.gather(1, top_idx), capacity)


__all__ = ["DispatchPlan", "NOISY_GATE_POLICIES", "expert_capacity", "gumbel_noise", "multiplicative_jitter",
           "top1gating", "top2gating", "topkgating", "uniform"]
