"""DeepSpeed's ``MoE`` layer (``deepspeed.moe.layer.MoE``): same constructor, names and outputs.

``forward`` returns ``(output, l_aux, exp_counts)``. The state dict holds the gate as
``deepspeed_moe.gate.wg.weight`` and this rank's experts as
``deepspeed_moe.experts.deepspeed_experts.<local index>.*`` (global index
``ep_rank * num_local_experts + local index``); a residual MoE (PR-MoE) adds ``mlp.*`` and
``coefficient.*``. Expert parallelism needs the ep Comm, bound by
:meth:`MoE.bind_expert_parallel` (``zerospeed.initialize`` calls it).
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from zerospeed.distributed.comm import Comm
from zerospeed.moe.experts import Experts
from zerospeed.moe.gate import TopKGate
from zerospeed.moe.sharded_moe import MOELayer


def _check_positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"MoE: {name}={value!r} must be an integer >= 1")


class MoE(nn.Module):
    """A mixture-of-experts layer: ``num_experts`` copies of ``expert``, ``ep_size``-way expert parallel.

    ``k`` experts per token; ``drop_tokens=False`` is the dropless mode (no capacity, nothing
    dropped). ``use_tutel`` and ``enable_expert_tensor_parallelism`` are refused (not built here).
    """

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("num_experts", num_experts), ("ep_size", ep_size),
                            ("k", k)):
            _check_positive(name, value)
        if num_experts % ep_size:
            raise ValueError(f"MoE: num_experts={num_experts} is not divisible by ep_size={ep_size}; every "
                             f"expert-parallel rank holds the same number of experts, so choose an ep_size "
                             f"that divides num_experts")
        if k > num_experts:
            raise ValueError(f"MoE: k={k} exceeds num_experts={num_experts}; use k <= num_experts")
        if use_tutel:
            raise ValueError("MoE: use_tutel=True is not supported: zerospeed has no Tutel kernels; set "
                             "use_tutel=False (drop_tokens=False gives the dropless grouped dispatch)")
        if enable_expert_tensor_parallelism:
            raise ValueError("MoE: enable_expert_tensor_parallelism=True is not built yet (experts are not split "
                             "over tensor-parallel ranks); set it to False")
        if capacity_factor <= 0 or eval_capacity_factor <= 0:
            raise ValueError(f"MoE: capacity_factor={capacity_factor} and eval_capacity_factor="
                             f"{eval_capacity_factor} must be > 0")
        if min_capacity < 0:
            raise ValueError(f"MoE: min_capacity={min_capacity} must be >= 0")
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, top2_2nd_expert_sampling)
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)  # mixes expert and dense outputs per token

    # -- expert parallelism --------------------------------------------------------------------
    @property
    def is_bound(self) -> bool:
        """Whether the layer can run: ep_size 1, or an expert-parallel Comm is bound."""
        return self.ep_size == 1 or self.deepspeed_moe.ep_comm is not None

    @property
    def expert_offset(self) -> int:
        """The global index of this rank's first local expert (its ep rank times ``num_local_experts``)."""
        return self.deepspeed_moe.ep_rank * self.num_local_experts

    def bind_expert_parallel(self, comm: Comm) -> None:
        """Attach the expert-parallel Comm of this rank's ep group (``mesh.comm('ep')``).

        Its world size must equal ``ep_size``; this rank then holds global experts
        ``comm.rank * num_local_experts`` onwards. Binding the same Comm again is a no-op.
        """
        self.deepspeed_moe.bind(comm)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """DeepSpeed's hook creates process groups from globals; here the engine binds the mesh's ep Comm."""
        if use_data_before_expert_parallel_:
            raise ValueError("MoE.set_deepspeed_parallelism: use_data_before_expert_parallel_=True is not supported; "
                             "zerospeed's expert groups split the data-parallel axis (ParallelDims ep)")
        if not self.is_bound:
            raise RuntimeError(f"MoE with ep_size={self.ep_size}: zerospeed binds expert groups in "
                               f"zerospeed.initialize; outside it call bind_expert_parallel(mesh.comm('ep'))")

    # -- forward -------------------------------------------------------------------------------
    def forward(self, hidden_states: Tensor, used_token: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``(output, l_aux, exp_counts)``: the layer output (shape of the input), the load-balancing
        loss to add to the model's loss, and the routes per expert on this rank."""
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            if isinstance(dense, tuple):
                dense = dense[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        l_aux, exp_counts = self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
        assert l_aux is not None and exp_counts is not None
        return output, l_aux, exp_counts


__all__ = ["MoE"]
