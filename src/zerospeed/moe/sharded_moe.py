"""The expert-parallel MoE computation (DeepSpeed's ``MOELayer``, the layer's ``deepspeed_moe``).

Two dispatches, both exchanging tokens over the expert-parallel :class:`Comm` (global expert
``r * num_local_experts + i`` is local expert i of ep rank r):

* capacity (``drop_tokens=True``): DeepSpeed's GShard dispatch: tokens gathered into an
  ``[E, C, d]`` buffer, one even all-to-all, the experts run on ``[ep, local_E, C, d]``, one
  all-to-all back, combined with the gate weights.
* dropless (``drop_tokens=False``): the ``k * S`` routes are stably sorted by expert; ranks swap
  their per-expert row counts (one small all-to-all), then exactly those rows (one
  ``all_to_all_single`` each way); each local expert runs once over its contiguous rows
  (MegaBlocks' grouping, without its block-sparse kernels). Nothing is padded or dropped, and
  every rank joins every exchange even when it routes or receives no rows, so nothing hangs.

Lifecycle: built unbound; :meth:`MOELayer.bind` attaches the ep Comm (``zerospeed.initialize``
does it). With ``ep_size == 1`` no Comm is needed and nothing is communicated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from zerospeed.distributed.comm import Comm
from zerospeed.moe.alltoall import all_to_all, exchange_counts
from zerospeed.moe.experts import Experts
from zerospeed.moe.gate import TopKGate
from zerospeed.moe.gating import DispatchPlan


class MOELayer(nn.Module):
    """Gate + local experts + the token exchange; ``forward`` sets ``l_aux`` and ``exp_counts``."""

    def __init__(self, gate: TopKGate, experts: Experts, ep_group_name: str, ep_size: int,
                 num_local_experts: int) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self._ep_comm: Comm | None = None
        self.l_aux: Tensor | None = None
        self.exp_counts: Tensor | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    @property
    def ep_comm(self) -> Comm | None:
        return self._ep_comm

    @property
    def ep_group(self) -> Any:
        """The expert-parallel process group (None until bound), as DeepSpeed exposes it."""
        return None if self._ep_comm is None else self._ep_comm.group

    @property
    def ep_rank(self) -> int:
        return 0 if self._ep_comm is None else self._ep_comm.rank

    def bind(self, comm: Comm) -> None:
        """Attach the expert-parallel Comm (its ranks hold the ``ep_size`` slices of the experts)."""
        if comm.world_size != self.ep_size:
            raise ValueError(f"expert-parallel Comm '{comm.name}' has {comm.world_size} ranks but this MoE layer "
                             f"has ep_size={self.ep_size}; pass the Comm of an ep group of {self.ep_size} ranks "
                             f"(ParallelDims(..., ep={self.ep_size}).build().comm('ep'))")
        if self._ep_comm is not None and self._ep_comm is not comm:
            raise RuntimeError(f"this MoE layer is already bound to expert-parallel Comm '{self._ep_comm.name}' "
                               f"(ranks {list(self._ep_comm.global_ranks)}); build a new layer to rebind it")
        self._ep_comm = comm

    def _comm(self) -> Comm | None:
        if self.ep_size == 1:
            return None
        if self._ep_comm is None:
            raise RuntimeError(f"MoE layer with ep_size={self.ep_size} has no expert-parallel group yet; pass the "
                               f"model through zerospeed.initialize, or call layer.bind_expert_parallel(comm) "
                               f"with the 'ep' Comm of a mesh built with ep={self.ep_size}")
        return self._ep_comm

    # -- forward -------------------------------------------------------------------------------
    def forward(self, hidden_states: Tensor, used_token: Tensor | None = None) -> Tensor:
        comm = self._comm()  # checked before any work: an unbound layer fails at once, on every rank
        d_model = hidden_states.shape[-1]
        tokens = hidden_states.reshape(-1, d_model)
        plan = self.gate(tokens, used_token)
        self.l_aux, self.exp_counts = plan.l_aux, plan.exp_counts
        if plan.dropless:
            out = self._dropless(tokens, plan, comm)
        else:
            out = self._capacity(tokens, plan, comm)
        return out.reshape(hidden_states.shape)

    def _capacity(self, tokens: Tensor, plan: DispatchPlan, comm: Comm | None) -> Tensor:
        assert plan.route_slots is not None and plan.expert_weights is not None and plan.capacity is not None
        num_experts, capacity, (num_tokens, d_model) = plan.num_experts, plan.capacity, tokens.shape
        slots = plan.route_slots.reshape(-1)  # [S * k], E * C for a dropped route
        # The buffer as one gather: each slot names its token (a slot nobody fills reads a zero row).
        # Moves S * k rows instead of the O(S * E * C * d) one-hot einsum.
        source = torch.full((num_experts * capacity + 1,), num_tokens, dtype=torch.long, device=tokens.device)
        route_token = torch.arange(num_tokens, device=tokens.device).repeat_interleave(plan.route_slots.shape[1])
        source.scatter_(0, slots, route_token)  # kept slots are unique; dropped routes land on the scratch slot
        padded = torch.cat([tokens, tokens.new_zeros(1, d_model)])
        dispatched = padded.index_select(0, source[:-1]).reshape(num_experts, capacity, d_model)
        if comm is not None:
            dispatched = all_to_all(dispatched, comm)
        expert_in = dispatched.reshape(self.ep_size, self.num_local_experts, capacity, d_model)
        expert_out = self.experts(expert_in).reshape(num_experts * capacity, d_model)
        if comm is not None:
            expert_out = all_to_all(expert_out.reshape(num_experts, capacity, d_model), comm)
            expert_out = expert_out.reshape(num_experts * capacity, d_model)
        padded_out = torch.cat([expert_out, expert_out.new_zeros(1, d_model)])
        routed = padded_out.index_select(0, slots).reshape(num_tokens, -1, d_model)  # [S, k, d]
        # fp32 weights: the sum over a token's routes accumulates in fp32, as the dense einsum did
        combined = (routed * plan.expert_weights.unsqueeze(-1)).sum(dim=1)
        return combined.to(expert_out.dtype)

    def _dropless(self, tokens: Tensor, plan: DispatchPlan, comm: Comm | None) -> Tensor:
        assert plan.expert_indices is not None and plan.expert_weights is not None
        num_tokens, k = plan.expert_indices.shape
        num_experts = self.ep_size * self.num_local_experts
        routes = plan.expert_indices.reshape(-1)
        order = torch.argsort(routes, stable=True)  # route s*k+j of token s, grouped by expert
        rows = tokens.index_select(0, order // k)
        counts = torch.bincount(routes, minlength=num_experts)
        if comm is None:
            out_rows = self.experts.forward_grouped(rows, counts.tolist())
        else:
            out_rows = self._exchange_and_run(rows, counts, comm)
        unsorted = out_rows.index_select(0, torch.argsort(order)).reshape(num_tokens, k, -1)
        combined = (unsorted * plan.expert_weights.unsqueeze(-1)).sum(dim=1)
        return combined.to(out_rows.dtype)

    def _exchange_and_run(self, rows: Tensor, counts: Tensor, comm: Comm) -> Tensor:
        """Send each expert's rows to its rank, run the local experts, send the results back."""
        ep, local = self.ep_size, self.num_local_experts
        got_counts = exchange_counts(comm, counts.reshape(ep, local)).tolist()  # [source rank][local expert]
        send_splits = counts.reshape(ep, local).sum(dim=1).tolist()
        recv_splits = [sum(row) for row in got_counts]
        received = all_to_all(rows, comm, send_splits, recv_splits)
        # Received rows are ordered (source rank, local expert); each expert wants its rows together.
        by_source = received.split([n for row in got_counts for n in row])
        by_expert = torch.cat([by_source[q * local + i] for i in range(local) for q in range(ep)])
        per_expert = [sum(got_counts[q][i] for q in range(ep)) for i in range(local)]
        out = self.experts.forward_grouped(by_expert, per_expert)
        out_parts = out.split([got_counts[q][i] for i in range(local) for q in range(ep)])
        back = torch.cat([out_parts[i * ep + q] for q in range(ep) for i in range(local)])
        return all_to_all(back, comm, recv_splits, send_splits)


__all__ = ["MOELayer"]
