"""1-bit Adam, 0/1 Adam and 1-bit LAMB at ZeRO stages 1 and 2 (issue 21), on real gloo ranks.

The warm-up runs on ZeRO's shards; when the optimizer starts exchanging by itself the state is
handed over to a replicated one (:mod:`zerospeed.zero.handover`). Stage 0 runs the same algorithm
with no hand-over and is tested exactly against a replay of DeepSpeed's algorithm (test_onebit_adam,
test_zoadam, test_onebit_lamb), so here every rank's parameters must equal the stage-0 run's at
every step, before and after the hand-over; checkpoints written in either phase resume exactly and
load at another stage.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy as np
import pytest
import torch

import zerospeed
from zerospeed.config import ConfigError
from zerospeed.optim.onebit import OnebitAdam
from zerospeed.testing import run_distributed
from zerospeed.testing.configs import train_config
from zerospeed.testing.data import train_on_regression_batches
from zerospeed.testing.models import seeded_mlp
from zerospeed.testing.parity import as_numpy_tree
from zerospeed.zero.handover import HandoverState

pytestmark = pytest.mark.spawns

IN, HIDDEN, OUT, ROWS = 6, 10, 3, 4
COMMON = {"lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01}
OPTIMIZERS = {
    "OneBitAdam": {"freeze_step": 3},
    # variance every step for two updates, then every other step (exchanged steps in between), local from step 7
    "ZeroOneAdam": {"var_freeze_step": 6, "var_update_scaler": 2, "local_step_scaler": 2, "local_step_clipper": 2},
    "OneBitLamb": {"freeze_step": 3, "max_coeff": 10.0, "min_coeff": 0.01},
}


def _engine(kind: str, stage: int, accum: int = 1, **top: Any) -> tuple[Any, torch.optim.Optimizer]:
    model = seeded_mlp(IN, HIDDEN, OUT, seed=3)
    optimizer = {"type": kind, "params": {**COMMON, **OPTIMIZERS[kind]}}
    config = train_config(micro=ROWS, accum=accum, optimizer=optimizer, zero={"stage": stage}, **top)
    engine, opt, _, _ = zerospeed.initialize(model=model, config=config)
    return engine, opt


def _train(engine: Any, steps: int, accum: int = 1, start: int = 0) -> list[float]:
    return train_on_regression_batches(engine, steps, accum=accum, start=start, rows=ROWS, inputs=IN, outputs=OUT)


def _phase(engine: Any) -> str:
    state = engine.state
    return state.phase.value if isinstance(state, HandoverState) else "stage 0"


def _trajectory(kind: str, stage: int, steps: int, accum: int, **top: Any) -> dict[str, Any]:
    engine, _ = _engine(kind, stage, accum, **top)
    params, phases, sent = [], [], []
    for step in range(steps):
        _train(engine, 1, accum, start=step)
        params.append([p.detach().clone() for p in engine.module.parameters()])
        phases.append(_phase(engine))
        sent.append(engine.comm_bytes()["step"])
        if step == 0:  # the set-up step made the states
            first_memory = engine.memory_breakdown()
    return as_numpy_tree({"params": params, "phases": phases, "sent": sent, "first_memory": first_memory,
                          "memory": engine.memory_breakdown()})


def _max_difference(a: list[list[np.ndarray]], b: list[list[np.ndarray]]) -> float:
    return max(float(np.abs(x - y).max()) for step_a, step_b in zip(a, b) for x, y in zip(step_a, step_b))


#: The step after which each optimizer first leaves a window's gradients local (the hand-over): 1-bit Adam and
#: LAMB at freeze_step; 0/1 Adam after its variance interval doubles (steps 2 and 3 update the variance at
#: interval 1, step 4 at interval 2, and step 5 is the first exchanged one).
HANDED_OVER_AFTER = {"OneBitAdam": 3, "ZeroOneAdam": 4, "OneBitLamb": 3}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_zero_stages_1_and_2_follow_the_stage_0_run_step_by_step(kind: str) -> None:
    steps = 10
    plain = run_distributed(_trajectory, 2, kind, 0, steps, 1)
    for stage in (1, 2):
        zero = run_distributed(_trajectory, 2, kind, stage, steps, 1)
        for rank in range(2):
            # LAMB's trust ratios sum the pieces' squared norms in float64 across ranks: last-bit differences
            tolerance = 1e-6 if kind == "OneBitLamb" else 0.0
            assert _max_difference(zero[rank]["params"], plain[rank]["params"]) <= tolerance, (kind, stage, rank)
            handed = HANDED_OVER_AFTER[kind]
            assert zero[rank]["phases"] == ["sharded"] * (handed - 1) + ["replicated"] * (steps - handed + 1)
        # ZeRO's masters and states are shards while warming up; after the hand-over the state and the bytes
        # on the wire are stage 0's
        assert zero[0]["first_memory"]["optimizer_states"] < plain[0]["first_memory"]["optimizer_states"] / 1.5
        assert zero[0]["memory"] == plain[0]["memory"]
        assert zero[0]["sent"][-1] == plain[0]["sent"][-1]


@pytest.mark.parametrize("kind,stage,world,accum,top", [
    ("OneBitAdam", 2, 4, 2, {}),
    ("ZeroOneAdam", 1, 2, 1, {"bf16": {"enabled": True}}),
    ("OneBitLamb", 2, 2, 2, {"fp16": {"enabled": True, "initial_scale_power": 8}}),
])
def test_more_ranks_accumulation_and_16_bit_training_follow_stage_0(kind: str, stage: int, world: int, accum: int,
                                                                    top: dict[str, Any]) -> None:
    steps = 9
    zero = run_distributed(_trajectory, world, kind, stage, steps, accum, **top)
    plain = run_distributed(_trajectory, world, kind, 0, steps, accum, **top)
    for rank in range(world):
        assert _max_difference(zero[rank]["params"], plain[rank]["params"]) <= 1e-6, (kind, rank)
        assert zero[rank]["phases"][-1] == "replicated"


def _save_and_go_on(path: str, kind: str, stage: int, save_after: int, tail: int) -> dict[str, Any]:
    engine, _ = _engine(kind, stage)
    _train(engine, save_after)
    phase = _phase(engine)
    engine.save_checkpoint(path, tag="t")
    losses = _train(engine, tail, start=save_after)
    return as_numpy_tree({"phase": phase, "tail": losses, "params": list(engine.module.parameters())})


def _load_and_go_on(path: str, kind: str, stage: int, save_after: int, tail: int) -> dict[str, Any]:
    engine, opt = _engine(kind, stage)
    engine.load_checkpoint(path, tag="t")
    phase = _phase(engine)
    losses = _train(engine, tail, start=save_after)
    return as_numpy_tree({"phase": phase, "tail": losses, "params": list(engine.module.parameters()),
                          "reduces": opt.reduces_gradients()})


@pytest.mark.parametrize("kind,save_after,saved_phase", [
    ("OneBitAdam", 2, "sharded"),      # warm-up: ZeRO's shards are saved
    ("OneBitAdam", 5, "replicated"),   # compressing: error buffers per rank
    ("ZeroOneAdam", 9, "replicated"),  # local steps: each rank's own parameters and momenta
    ("OneBitLamb", 5, "replicated"),   # frozen coefficients, scaling, padding carry
])
def test_checkpoints_of_either_phase_resume_exactly_at_any_of_stages_0_to_2(kind: str, save_after: int,
                                                                            saved_phase: str) -> None:
    tail = 4
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        first = run_distributed(_save_and_go_on, 2, path, kind, 1, save_after, tail)
        assert first[0]["phase"] == saved_phase
        for stage in (0, 1, 2):
            again = run_distributed(_load_and_go_on, 2, path, kind, stage, save_after, tail)
            for rank in range(2):
                # a load that restores the compressing phase hands over before the next forward
                assert again[rank]["phase"] == ("stage 0" if stage == 0 else saved_phase), (stage, rank)
                assert again[rank]["tail"] == first[rank]["tail"], (stage, rank)
                assert all((a == b).all() for a, b in zip(again[rank]["params"], first[rank]["params"])), (stage, rank)


def _load_elsewhere(path: str) -> dict[str, Any]:
    engine, opt = _engine("OneBitAdam", 2)
    engine.load_checkpoint(path, tag="t")
    phase = _phase(engine)
    losses = _train(engine, 3, start=5)
    return {"phase": phase, "frozen": opt.frozen, "finite": bool(np.isfinite(losses).all()),
            "params": as_numpy_tree([p.detach().clone() for p in engine.module.parameters()])}


def test_a_compressing_checkpoint_loads_at_another_world_size_and_stage() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        run_distributed(_save_and_go_on, 2, path, "OneBitAdam", 1, 5, 1)
        grown = run_distributed(_load_elsewhere, 4, path)
    for r in grown:
        assert r["phase"] == "replicated" and r["frozen"] and r["finite"]
        # every rank applies the same averaged momentum to the same parameters
        assert all((a == b).all() for a, b in zip(r["params"], grown[0]["params"]))


def _client_optimizer_at(stage: int) -> str:
    model = seeded_mlp(IN, HIDDEN, OUT, seed=3)
    config = train_config(micro=ROWS, optimizer={"type": "Adam"}, zero={"stage": stage})
    del config["optimizer"]  # the client's optimizer object instead
    try:
        zerospeed.initialize(model=model, optimizer=OnebitAdam(model.parameters(), freeze_step=2), config=config)
    except ConfigError as exc:
        return str(exc)
    return "accepted"


def _refusal(model: torch.nn.Module, stage: int) -> str:
    """What ``initialize`` says to a 1-bit Adam config at ``stage`` ("accepted" when it trains)."""
    config = train_config(micro=1, optimizer={"type": "OneBitAdam", "params": {"lr": 0.1}}, zero={"stage": stage})
    try:
        zerospeed.initialize(model=model, config=config)
    except ValueError as exc:  # ConfigError is a ValueError
        return str(exc)
    return "accepted"


def _tiny_model_at_stage_1() -> str:
    return _refusal(torch.nn.Linear(1, 1, bias=False), 1)


def test_refusals_name_the_stage_and_the_fix() -> None:
    assert run_distributed(_client_optimizer_at, 2, 1) == ["accepted", "accepted"]
    message = run_distributed(_client_optimizer_at, 2, 3)[0]
    assert "zero_optimization.stage: 3 cannot be combined with OnebitAdam" in message and "stage 0, 1 or 2" in message
    refusal = run_distributed(_tiny_model_at_stage_1, 2)
    assert "rank 1 holds no element of any trainable parameter" in refusal[1]
    assert "use zero_optimization.stage 0" in refusal[0]


def _two_groups_save_load(path: str, save: bool) -> dict[str, Any]:
    """Two parameter groups, the second (the last bias) held by rank 1 alone at stage 1: rank 0's optimizer has
    an empty group while warming up, yet its compressing checkpoint holds error buffers for both groups."""
    model = seeded_mlp(IN, HIDDEN, OUT, seed=3)
    params = list(model.parameters())
    optimizer = OnebitAdam([{"params": params[:-1]}, {"params": params[-1:]}], lr=0.01, freeze_step=3)
    config = train_config(micro=ROWS, optimizer={"type": "Adam"}, zero={"stage": 1})
    del config["optimizer"]
    engine, opt, _, _ = zerospeed.initialize(model=model, optimizer=optimizer, config=config)
    pieces = [len(group["params"]) for group in opt.param_groups]
    if save:
        _train(engine, 5)
        engine.save_checkpoint(path, tag="t")
    else:
        engine.load_checkpoint(path, tag="t")
    tail = _train(engine, 3, start=5)
    return as_numpy_tree({"pieces": pieces, "tail": tail, "params": list(engine.module.parameters())})


def test_a_group_without_pieces_on_a_rank_saves_and_resumes_exactly() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        first = run_distributed(_two_groups_save_load, 2, path, True)
        again = run_distributed(_two_groups_save_load, 2, path, False)
    assert first[0]["pieces"][1] == 0 < first[1]["pieces"][1]  # the case: rank 0 holds nothing of group 1
    for rank in range(2):
        assert again[rank]["tail"] == first[rank]["tail"]
        assert all((a == b).all() for a, b in zip(again[rank]["params"], first[rank]["params"]))


def _moe_with_onebit(stage: int) -> str:
    from zerospeed.moe.layer import MoE

    torch.manual_seed(3)
    return _refusal(torch.nn.Sequential(torch.nn.Linear(8, 8), MoE(8, torch.nn.Linear(8, 8), num_experts=2)), stage)


def test_a_model_with_experts_is_refused_at_every_stage() -> None:
    """SplitState steps the shared optimizer once per replica group: a 1-bit optimizer would count two steps
    per window (its set-up step and freeze shift) and compress in the middle of a window."""
    for stage in (0, 1):
        message = run_distributed(_moe_with_onebit, 2, stage)[0]
        assert "OnebitAdam cannot train a model with expert (MoE) layers" in message and "use Adam" in message
