"""Expert parameters in the engine: reduced over their expert-data-parallel group, averaged over the whole
data-parallel size, clipped by the true global norm; against a single-process reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zerospeed.testing import run_distributed

HIDDEN, EP, WORLD, ACCUM, STEPS, CLIP = 6, 2, 4, 2, 3, 0.05


class LocalExpert(nn.Module):
    """A stand-in expert layer: this rank holds expert ``global_index`` (its expert-parallel rank) and
    applies it to its own tokens, so no tokens move; its parameters are marked as DeepSpeed marks experts."""

    def __init__(self, global_index: int):
        super().__init__()
        self.ep_size = EP
        self.global_index = global_index
        self.expert = _expert(global_index)
        for p in self.expert.parameters():
            p.allreduce = False  # type: ignore[attr-defined]
            p.group_name = f"ep_size_{EP}"  # type: ignore[attr-defined]
        self.bound_rank: int | None = None

    def bind_expert_parallel(self, comm) -> None:  # noqa: ANN001 - a zerospeed Comm
        if comm.world_size != self.ep_size:
            raise ValueError("wrong group")
        self.bound_rank = comm.rank

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.expert(h)


def _expert(index: int) -> nn.Linear:
    torch.manual_seed(100 + index)
    return nn.Linear(HIDDEN, HIDDEN)


def _dense() -> nn.Linear:
    torch.manual_seed(7)
    return nn.Linear(HIDDEN, HIDDEN)


class Model(nn.Module):
    def __init__(self, expert: nn.Module):
        super().__init__()
        self.dense = _dense()
        self.moe = expert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(torch.tanh(self.dense(x)))


def _batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(3, HIDDEN, generator=g), torch.randn(3, HIDDEN, generator=g)


def _adamw(params) -> torch.optim.Optimizer:  # noqa: ANN001
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.01)


def _rank(config_optimizer: bool) -> dict:
    import torch.distributed as dist

    import zerospeed
    from zerospeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    rank = dist.get_rank()
    ep_rank = rank % EP  # the mesh's expert-parallel groups: consecutive data-parallel ranks
    model = Model(LocalExpert(ep_rank))
    config = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": ACCUM, "gradient_clipping": CLIP}
    if config_optimizer:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01}}
        engine, _, _, _ = zerospeed.initialize(model=model, config=config)
    else:
        groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                       "name": "all"})
        engine, _, _, _ = zerospeed.initialize(model=model, config=config, optimizer=_adamw(groups))
    norms = []
    for step in range(STEPS):
        for micro in range(ACCUM):
            x, y = _batch(step, micro, rank)
            engine.backward(F.mse_loss(engine(x), y))
            engine.step()
        norms.append(engine.get_global_grad_norm())
    return {"bound": model.moe.bound_rank, "ep_rank": ep_rank, "norms": norms,
            "dense": [p.detach().clone().tolist() for p in model.dense.parameters()],
            "expert": [p.detach().clone().tolist() for p in model.moe.expert.parameters()]}


def _reference() -> dict:
    dense = _dense()
    experts = [_expert(i) for i in range(EP)]
    params = list(dense.parameters()) + [p for e in experts for p in e.parameters()]
    opt = _adamw(params)
    norms = []
    for step in range(STEPS):
        for micro in range(ACCUM):
            losses = []
            for rank in range(WORLD):
                x, y = _batch(step, micro, rank)
                losses.append(F.mse_loss(experts[rank % EP](torch.tanh(dense(x))), y))
            (torch.stack(losses).mean() / ACCUM).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        opt.step()
        opt.zero_grad()
    return {"norms": norms, "dense": [p.detach() for p in dense.parameters()],
            "experts": [[p.detach() for p in e.parameters()] for e in experts]}


@pytest.mark.spawns
@pytest.mark.parametrize("config_optimizer", [False, True], ids=["client-groups", "config-optimizer"])
def test_expert_gradients_average_over_all_ranks_and_the_norm_is_global(config_optimizer: bool) -> None:
    results = run_distributed(_rank, WORLD, config_optimizer)
    ref = _reference()
    for rank, got in enumerate(results):
        assert got["bound"] == got["ep_rank"]
        assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        for value, want in zip(got["dense"], ref["dense"], strict=True):
            torch.testing.assert_close(torch.tensor(value), want, rtol=0, atol=1e-5)
        for value, want in zip(got["expert"], ref["experts"][got["ep_rank"]], strict=True):
            torch.testing.assert_close(torch.tensor(value), want, rtol=0, atol=1e-5)
