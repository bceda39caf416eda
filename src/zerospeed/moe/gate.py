"""The router module (DeepSpeed's ``TopKGate``: attribute ``wg``), wrapping the pure gating functions.

It owns the one parameter (``wg``, hidden -> experts, no bias, fp32) and the training/eval
switches: the eval capacity factor and no noisy gate outside training, as in DeepSpeed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zerospeed.moe.gating import (NOISY_GATE_POLICIES, DispatchPlan, multiplicative_jitter, top1gating, top2gating,
                                  topkgating)


class TopKGate(nn.Module):
    """Routes each token to ``k`` of ``num_experts`` experts; ``forward`` returns a :class:`DispatchPlan`."""

    wg: nn.Linear

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"noisy_gate_policy={noisy_gate_policy!r} is not supported; use None, 'Jitter' or "
                             f"'RSample'")
        if not 1 <= k <= num_experts:
            raise ValueError(f"k={k} must be between 1 and num_experts={num_experts}")
        # fp32 whatever the default dtype: routing decisions are made in fp32, as in DeepSpeed.
        self.wg = nn.Linear(model_dim, num_experts, bias=False, dtype=torch.float32)
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling

    def forward(self, input: Tensor, used_token: Tensor | None = None) -> DispatchPlan:
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x)
        logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1gating(logits, factor, self.min_capacity, used_token,
                              self.noisy_gate_policy if self.training else None, self.drop_tokens, self.use_rts)
        if self.k == 2:
            return top2gating(logits, factor, self.min_capacity, self.drop_tokens, self.top2_2nd_expert_sampling)
        return topkgating(logits, self.k, factor, self.min_capacity, self.drop_tokens)


__all__ = ["TopKGate"]
