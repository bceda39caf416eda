"""Resharding (issue 5): a checkpoint written at one world size and ZeRO stage loads at another.

Saves at 4 ranks stage 3 load at 2 ranks stage 1 and at 1 rank stage 0; saves at 2 ranks stage 2
load at 3 ranks stage 2; saves at 1 rank stage 0 load at 3 ranks stage 3; and pairs where the
gradient accumulation changes with the world size (4 ranks x 3 micro-batches -> 1 x 12, 2 x 6 -> 3 x 4),
which must resume at the start of a window of the new topology. Every run trains on the
same global batch of 12 rows (each rank its slices by rank), so gradient averaging makes the training
independent of the world size up to float rounding, and a plain single-process PyTorch loop (AdamW +
WarmupLR + clipping on the full batch) is the reference for all of them: the steps after a load must
match its steps 4-6 (losses and parameters ≤ 1e-5), and the Adam states right after the load must be
its states after step 3. The model ties its embedding to its output head, has a frozen parameter, a
0-dim parameter, a non-contiguous persistent buffer and parameters that split unevenly over 3 and 4
ranks; ``get_fp32_state_dict`` of every saved checkpoint is checked against the gathered parameters.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.checkpoint import get_fp32_state_dict
from zerospeed.testing import run_distributed
from zerospeed.testing.reference import train_reference
from zerospeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

VOCAB, DIM, SEQ, ODD = 13, 12, 4, 53
GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 ranks
STEPS, SAVE_AT = 6, 3
LR = 0.05
ADAMW = {"lr": LR, "weight_decay": 0.01}
WARMUP = {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 4, "warmup_type": "linear"}
ATOL = 1e-5
STATE_RTOL = 1e-4  # Adam moments: rounding differs with the reduction order only; tolerances relative to
# each tensor's largest value, since exp_avg_sq is tiny (~1e-6) and an absolute 1e-6 would accept anything
STATE_KEYS = ("exp_avg", "exp_avg_sq")

# (name, world, stage, accumulation, source or None): sources train 3 steps and save, targets load and
# train 3 more. Each step is one global batch: world x accumulation micro-batches of 12 / (world x acc) rows.
RUNS = {
    "save w4 s3": (4, 3, 1, None),
    "save w2 s2": (2, 2, 1, None),
    "save w1 s0": (1, 0, 1, None),
    "save w4 s3 a3": (4, 3, 3, None),
    "save w2 s2 a6": (2, 2, 6, None),
    "load w2 s1 from w4 s3": (2, 1, 1, "save w4 s3"),
    "load w1 s0 from w4 s3": (1, 0, 1, "save w4 s3"),
    "load w3 s2 from w2 s2": (3, 2, 1, "save w2 s2"),
    "load w3 s3 from w1 s0": (3, 3, 1, "save w1 s0"),  # replicated fragments into stage-3 pieces
    "load w1 s0 a12 from w4 s3 a3": (1, 0, 12, "save w4 s3 a3"),  # saved at micro step 9: resumes at 36
    "load w3 s1 a4 from w2 s2 a6": (3, 1, 4, "save w2 s2 a6"),  # saved at micro step 18: resumes at 12
}
SOURCES = [name for name, (*_, source) in RUNS.items() if source is None]
SPAWNS = {4: ["save w4 s3", "save w4 s3 a3"], 1: ["save w1 s0", "load w1 s0 from w4 s3", "load w1 s0 a12 from w4 s3 a3"],
          2: ["save w2 s2", "save w2 s2 a6", "load w2 s1 from w4 s3"],
          3: ["load w3 s2 from w2 s2", "load w3 s3 from w1 s0", "load w3 s1 a4 from w2 s2 a6"]}
# (in this order: sources are saved before loads)


class Net(nn.Module):
    """Tied embedding/head (156 elements), a frozen parameter, a 53-element table, a 0-dim parameter
    (its Adam moments are 0-dim like ``step`` at stage 0, 1-element pieces at stages 1-3), a
    non-contiguous buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Parameter(torch.randn(DIM) * 0.1, requires_grad=False)
        self.odd = nn.Parameter(torch.randn(ODD) * 0.1)
        self.fc = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.temperature = nn.Parameter(torch.tensor(1.0))
        # random (a target's differs until the load sets it) and transposed: a non-contiguous buffer
        self.register_buffer("pos_scale", torch.rand(DIM, SEQ).t() + 0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1])
        h = self.emb(ids) * self.pos_scale + self.frozen
        h = h + torch.tanh(self.fc(self.norm(h)))
        h = h + self.odd[(ids * 7 + pos) % ODD].unsqueeze(-1)
        return self.head(h) * self.temperature


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch."""
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)
    return ids, (ids * 3 + 1) % VOCAB


def _config(world: int, stage: int, accumulation: int) -> dict:
    return {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // (world * accumulation),
            "gradient_accumulation_steps": accumulation,
            "gradient_clipping": 1.0, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": ADAMW},
            "scheduler": {"type": "WarmupLR", "params": WARMUP},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 50, "stage3_param_persistence_threshold": 0}}


# ---------------------------------------------------------------------------------------------------
# Inside the ranks


def _gathered(engine: Any) -> dict[str, Any]:
    """Full fp32 parameters and Adam states by name (collectives: every rank calls them)."""
    out: dict[str, Any] = {"params": {}, **{key: {} for key in STATE_KEYS}}
    for name, p in engine.module.named_parameters():
        out["params"][name] = safe_get_full_fp32_param(p).tolist()
        if p.requires_grad:
            for key in STATE_KEYS:
                value = safe_get_full_optimizer_state(p, key)
                out[key][name] = None if value is None else value.tolist()
    return out


def _run(name: str, root: str) -> dict[str, Any]:
    world, stage, accumulation, source = RUNS[name]
    rank = torch.distributed.get_rank()
    torch.manual_seed(0 if source is None else 77)  # a target starts from other weights: the load must set them
    engine, *_ = zerospeed.initialize(model=Net(), config=_config(world, stage, accumulation))
    out: dict[str, Any] = {}
    first = 0
    if source is not None:
        out["path"], _ = engine.load_checkpoint(str(Path(root) / source))
        out["loaded"] = _gathered(engine)
        out["loaded_counters"] = [engine.global_steps, engine.global_samples, engine.micro_steps]
        out["loaded_lr"] = engine.get_lr()
        first = SAVE_AT
    losses, applied = [], []
    micro = GLOBAL_BATCH // (world * accumulation)
    for step in range(first, first + SAVE_AT):
        ids, targets = _batch(step)
        window = torch.zeros(())
        for m in range(accumulation):  # this rank's slices of the global batch, one per micro-batch
            rows = slice((rank * accumulation + m) * micro, (rank * accumulation + m + 1) * micro)
            loss = _loss(engine(ids[rows]), targets[rows])
            engine.backward(loss)
            engine.step()
            applied.append(engine.was_step_applied())
            window += loss.detach()
        torch.distributed.all_reduce(window)
        losses.append(float(window) / (world * accumulation))
    out["applied"] = applied
    out["losses"] = losses
    out["end"] = _gathered(engine)
    out["tied"] = engine.module.head.weight is engine.module.emb.weight
    out["frozen_requires_grad"] = engine.module.frozen.requires_grad
    if source is None:
        out["path"] = engine.save_checkpoint(str(Path(root) / name))
    return out


def _spawn(names: list[str], root: str) -> dict[str, dict]:
    logging.getLogger("zerospeed").addHandler(logging.NullHandler())
    logging.getLogger("zerospeed").setLevel(logging.WARNING)
    return {name: _run(name, root) for name in names}


# ---------------------------------------------------------------------------------------------------
# The reference and the spawns


def _reference() -> dict[str, Any]:
    """Plain PyTorch on the full global batch: losses of all 6 steps, parameters and Adam states
    after steps 3 and 6."""
    from zerospeed.optim.schedules import WarmupLR

    torch.manual_seed(0)
    model = Net()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, **ADAMW)
    sched = WarmupLR(opt, **WARMUP)
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, Any] = {}

    def snapshot(step: int) -> None:
        if step + 1 in (SAVE_AT, STEPS):
            snap = {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                    "lr": [g["lr"] for g in opt.param_groups]}
            for key in STATE_KEYS:
                snap[key] = {names[id(p)]: opt.state[p][key].clone() for p in trainable}
            out[f"after {step + 1}"] = snap

    run = train_reference(model, opt, batch=lambda step, _rank, _micro: _batch(step), loss_fn=_loss, steps=STEPS,
                          clip=1.0, scheduler=sched, after_step=snapshot)
    out["losses"] = run.losses[0]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("reshard"))
    results: dict[str, list[dict]] = {}
    for world, names in SPAWNS.items():
        per_rank = run_distributed(_spawn, world, names, root, timeout=300.0)
        for name in names:
            results[name] = [ranks[name] for ranks in per_rank]
    return {"root": root, "results": results, "reference": _reference()}


def _compare(actual: dict[str, Any], expected: dict[str, Any], kinds: tuple[str, ...], atol: float | None,
             where: str) -> list[str]:
    """Differences beyond ``atol`` (None: ``STATE_RTOL`` of each tensor's largest magnitude)."""
    problems = []
    for kind in kinds:
        if set(actual[kind]) != set(expected[kind]):
            problems.append(f"{where}: {kind} names {sorted(actual[kind])} != {sorted(expected[kind])}")
            continue
        for name, value in expected[kind].items():
            got = actual[kind][name]
            if got is None:
                problems.append(f"{where}: no {kind} for {name}")
                continue
            got = torch.tensor(got)
            if got.shape != value.shape:
                problems.append(f"{where}: {kind} of {name} has shape {tuple(got.shape)} != {tuple(value.shape)}")
            elif not torch.allclose(got, value, rtol=STATE_RTOL if atol is None else 1e-4,
                                    atol=STATE_RTOL * float(value.abs().max()) if atol is None else atol):
                problems.append(f"{where}: {kind} of {name} max abs diff {float((got - value).abs().max()):.3g}")
    return problems


def _losses_problem(actual: list[float], expected: list[float], where: str) -> list[str]:
    if torch.allclose(torch.tensor(actual), torch.tensor(expected), rtol=0, atol=ATOL):
        return []
    return [f"{where}: losses {actual} != reference {expected}"]


def test_sources_match_the_reference_before_saving(runs: dict[str, Any]) -> None:
    """The premise: at 4, 2 and 1 ranks the first 3 steps are the reference's (else nothing below means much)."""
    ref = runs["reference"]
    problems = []
    for name in SOURCES:
        for rank, got in enumerate(runs["results"][name]):
            where = f"[{name}, rank {rank}]"
            problems += _losses_problem(got["losses"], ref["losses"][:SAVE_AT], where)
            problems += _compare(got["end"], ref[f"after {SAVE_AT}"], ("params",), ATOL, where)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", [n for n, (*_, source) in RUNS.items() if source is not None])
def test_resharded_load_continues_like_the_uninterrupted_run(runs: dict[str, Any], name: str) -> None:
    ref = runs["reference"]
    source = RUNS[name][3]
    problems = []
    for rank, got in enumerate(runs["results"][name]):
        where = f"[{name}, rank {rank}]"
        assert got["path"] == runs["results"][source][0]["path"]
        accumulation = RUNS[name][2]
        if got["loaded_counters"] != [SAVE_AT, SAVE_AT * GLOBAL_BATCH, SAVE_AT * accumulation]:
            problems.append(f"{where}: counters (steps, samples, micro steps) after load {got['loaded_counters']} "
                            f"!= {[SAVE_AT, SAVE_AT * GLOBAL_BATCH, SAVE_AT * accumulation]}")
        if got["applied"] != ([False] * (accumulation - 1) + [True]) * SAVE_AT:  # a step at each window's end
            problems.append(f"{where}: optimizer steps applied after micro-batches {got['applied']}")
        if not torch.allclose(torch.tensor(got["loaded_lr"]), torch.tensor(ref[f"after {SAVE_AT}"]["lr"]), atol=1e-12):
            problems.append(f"{where}: lr after load {got['loaded_lr']} != {ref[f'after {SAVE_AT}']['lr']}")
        # the weights and Adam states as saved, resharded to this topology
        problems += _compare(got["loaded"], ref[f"after {SAVE_AT}"], ("params",), ATOL, f"{where} after load")
        problems += _compare(got["loaded"], ref[f"after {SAVE_AT}"], STATE_KEYS, None, f"{where} after load")
        problems += _losses_problem(got["losses"], ref["losses"][SAVE_AT:], where)
        problems += _compare(got["end"], ref[f"after {STEPS}"], ("params",), ATOL, f"{where} after 3 more steps")
        if not got["tied"] or got["frozen_requires_grad"]:
            problems.append(f"{where}: tied {got['tied']}, frozen requires_grad {got['frozen_requires_grad']}")
    assert not problems, "\n".join(problems)


def test_resharded_load_keeps_the_frozen_parameter(runs: dict[str, Any]) -> None:
    """The frozen parameter comes from the checkpoint (the targets were initialised with another seed)."""
    ref = runs["reference"][f"after {STEPS}"]["params"]["frozen"]
    for name, (*_, source) in RUNS.items():
        if source is not None:
            for got in runs["results"][name]:
                assert torch.equal(torch.tensor(got["end"]["params"]["frozen"]), ref)


@pytest.mark.parametrize("source", SOURCES)
def test_fp32_state_dict_equals_the_gathered_parameters_and_loads_strictly(runs: dict[str, Any],
                                                                          source: str) -> None:
    state = get_fp32_state_dict(str(Path(runs["root"]) / source))
    torch.manual_seed(0)
    saved_buffer = Net().pos_scale
    torch.manual_seed(5)
    model = Net()
    assert set(state) == set(model.state_dict())  # tied keys (head.weight) and the buffer included
    gathered = runs["results"][source][0]["end"]["params"]
    for name, value in gathered.items():
        assert state[name].dtype == torch.float32
        assert torch.equal(state[name], torch.tensor(value)), name
    assert torch.equal(state["head.weight"], state["emb.weight"])
    assert torch.equal(state["pos_scale"], saved_buffer) and not torch.equal(model.pos_scale, saved_buffer)
    model.load_state_dict(state, strict=True)
    assert model.head.weight is model.emb.weight
    ids, targets = _batch(SAVE_AT)
    with torch.no_grad():
        loss = _loss(model(ids), targets).item()
    assert abs(loss - runs["reference"]["losses"][SAVE_AT]) <= ATOL
