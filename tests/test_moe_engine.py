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

    @property
    def expert_offset(self) -> int:
        return self.global_index

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


# -- the real layer: ep=2 with 4 experts on 4 ranks, dropless, through initialize ---------------------
D, EXPERTS, TOKENS = 8, 4, 6


def _moe_model(k: int, ep_size: int, num_experts: int = EXPERTS, starve: bool = False) -> nn.Module:
    """``starve``: the gate scores the last expert by the first input feature alone, so rank 0 (whose
    tokens have it at +3) sends it nothing while the other ranks always do."""
    from zerospeed.moe.layer import MoE

    torch.manual_seed(3)
    embed = nn.Identity() if starve else nn.Linear(D, D)
    expert = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
    moe = MoE(D, expert, num_experts=num_experts, ep_size=ep_size, k=k, drop_tokens=False,
              top2_2nd_expert_sampling=False)
    if starve:
        with torch.no_grad():
            wg = moe.deepspeed_moe.gate.wg.weight
            wg.mul_(0.1)
            wg[-1].zero_()
            wg[-1, 0] = -4.0
    head = nn.Linear(D, D)
    parts = {"embed": embed, "moe": moe, "head": head}
    return nn.ModuleDict({**parts, "starve": nn.Identity()} if starve else parts)


def _moe_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    inputs = x if "starve" in model else torch.tanh(model["embed"](x))
    h, l_aux, _ = model["moe"](inputs)
    return F.mse_loss(model["head"](h), y) + 0.01 * l_aux


def _moe_batch(step: int, micro: int, rank: int, starve: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5000 + 100 * step + 10 * micro + rank)
    x, y = torch.randn(TOKENS, D, generator=g), torch.randn(TOKENS, D, generator=g)
    if starve:
        x[:, 0] = 3.0 if rank == 0 else -3.0
    return x, y


class _Wrap(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _moe_loss(self.inner, x, y)


def _expert_values(model: nn.Module) -> dict[str, list]:
    """Every parameter by name, experts under their global index."""
    moe = model["moe"]
    out = {}
    for name, p in model.named_parameters():
        if ".deepspeed_experts." in name:
            prefix, rest = name.split(".deepspeed_experts.")
            local, tail = rest.split(".", 1)
            global_index = moe.deepspeed_moe.ep_rank * moe.num_local_experts + int(local)
            name = f"{prefix}.deepspeed_experts.{global_index}.{tail}"
        out[name] = p.detach().clone().tolist()
    return out


def _moe_rank(k: int, stage: int = 0, starve: bool = False, offload: str = "") -> dict:
    import torch.distributed as dist

    import zerospeed

    rank = dist.get_rank()
    model = _moe_model(k, EP, starve=starve)
    config = {"train_micro_batch_size_per_gpu": TOKENS, "gradient_accumulation_steps": ACCUM,
              "gradient_clipping": 0.5, "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}},
              "zero_optimization": {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {}),
                                    **({"offload_param": {"device": "cpu"}} if offload == "params" else {})}}
    engine, _, _, _ = zerospeed.initialize(model=_Wrap(model), config=config)
    losses, starved = [], []
    for step in range(STEPS + 2):
        for micro in range(ACCUM):
            loss = engine(*_moe_batch(step, micro, rank, starve))
            starved.append(int(model["moe"].deepspeed_moe.exp_counts[-1]))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
    if stage == 3:
        from zerospeed.zero import GatheredParameters

        with GatheredParameters(list(model.parameters())):
            values = _expert_values(model)
    else:
        values = _expert_values(model)
    return {"losses": losses, "params": values, "has_moe": engine.has_moe_layers, "last_expert_tokens": starved}


def _moe_reference(k: int, starve: bool = False) -> dict:
    model = _moe_model(k, 1, starve=starve)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    losses: list[list[float]] = [[] for _ in range(WORLD)]
    for step in range(STEPS + 2):
        for micro in range(ACCUM):
            per_rank = [_moe_loss(model, *_moe_batch(step, micro, rank, starve)) for rank in range(WORLD)]
            for rank, loss in enumerate(per_rank):
                losses[rank].append(float(loss.detach()))
            (torch.stack(per_rank).mean() / ACCUM).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}


@pytest.mark.spawns
@pytest.mark.parametrize("k,stage,starve,offload", [
    (1, 0, False, ""), (2, 0, False, ""), (2, 1, False, ""), (1, 2, False, ""), (2, 3, False, ""),
    (2, 2, True, ""), (2, 3, True, ""), (2, 2, False, "optimizer"), (2, 3, False, "params")])
def test_moe_ep2_on_4_ranks_trains_as_one_process(k: int, stage: int, starve: bool, offload: str) -> None:
    results = run_distributed(_moe_rank, WORLD, k, stage, starve, offload)
    ref = _moe_reference(k, starve)
    if starve:  # the case is real: the last expert got no token from rank 0, and tokens from the others
        assert set(results[0]["last_expert_tokens"]) == {0}
        assert all(min(got["last_expert_tokens"]) > 0 for got in results[1:])
    for rank, got in enumerate(results):
        assert got["has_moe"] is True
        assert got["losses"] == pytest.approx(ref["losses"][rank], rel=1e-5, abs=1e-6)
        held = {name: value for name, value in got["params"].items()}
        names = {name.removeprefix("inner.") for name in held}
        assert {n for n in ref["params"] if ".deepspeed_experts." not in n} <= names
        for name, value in held.items():
            torch.testing.assert_close(torch.tensor(value), ref["params"][name.removeprefix("inner.")],
                                       rtol=0, atol=1e-5)
