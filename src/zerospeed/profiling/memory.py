"""How many bytes of model state each rank holds, before a run: the ZeRO paper's accounting.

A pure estimate to plan with (and to check the engine's measured ``memory_breakdown`` against):
parameters in the compute dtype, gradients in the accumulation dtype, and optimizer state (fp32
master weights when training in 16 bits, plus the optimizer's own per-parameter state), each either
replicated or divided by the data-parallel world size depending on the ZeRO stage.
"""

from __future__ import annotations

from dataclasses import dataclass

# Per-parameter optimizer state in fp32 elements (beyond the master copy).
STATE_ELEMENTS = {"adam": 2, "adamw": 2, "lamb": 2, "adagrad": 1, "sgd_momentum": 1, "sgd": 0}


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes of model state on one rank."""

    params: int
    grads: int
    optimizer_states: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_states


def model_state_bytes(num_params: int, *, stage: int, world_size: int, param_bytes: int = 2,
                      grad_bytes: int = 2, master_weights: bool = True, optimizer: str = "adam") -> MemoryPlan:
    """Per-rank model-state bytes for ``num_params`` parameters (the ZeRO paper's Ψ).

    With the defaults (16-bit parameters and gradients, fp32 master weights, Adam) this gives the
    paper's 16Ψ at stage 0, 4Ψ + 12Ψ/N at stage 1, 2Ψ + 14Ψ/N at stage 2 and 16Ψ/N at stage 3.
    Shards are rounded up (a rank holds ``ceil(Ψ/N)`` elements).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage} is not a ZeRO stage; expected 0, 1, 2 or 3")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if optimizer not in STATE_ELEMENTS:
        raise ValueError(f"optimizer={optimizer!r} is not one of {', '.join(STATE_ELEMENTS)}")
    shard = -(-num_params // world_size)
    state_per_param = 4 * STATE_ELEMENTS[optimizer] + (4 if master_weights else 0)
    return MemoryPlan(
        params=param_bytes * (shard if stage >= 3 else num_params),
        grads=grad_bytes * (shard if stage >= 2 else num_params),
        optimizer_states=state_per_param * (shard if stage >= 1 else num_params),
    )
