"""Progressive layer drop (``progressive_layer_drop``): theta(t) as DeepSpeed 0.19.6 keeps it, the keywords
the engine passes to training forwards, the keep probabilities and draws of ``zerospeed.layer_drop``, the
example GPT's use of them, resume, refusals. Engines run on a one-process gloo group in this process, except
one 2-rank run of the example GPT at ZeRO stages 0 and 3."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerospeed
from zerospeed.config import ConfigError, load_config
from zerospeed.layer_drop import LayerDropPlan, LayerDropSchedule, keep_probability
from zerospeed.runtime.progressive_layer_drop import ProgressiveLayerDrop
from zerospeed.testing import one_process_group, run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

THETA, GAMMA = 0.5, 0.1


def deepspeed_theta(step: int, theta: float = THETA, gamma: float = GAMMA) -> float:
    """DeepSpeed 0.19.6's ``_prob(global_step, gamma, theta)``."""
    return (1.0 - theta) * math.exp(-gamma * step) + theta


# -- the schedule and DeepSpeed's class --------------------------------------------------------------------
def test_schedule_is_the_paper_formula_with_deepspeeds_timing() -> None:
    schedule = LayerDropSchedule(theta=THETA, gamma=GAMMA)
    assert [schedule.theta_at(t) for t in range(50)] == [deepspeed_theta(t) for t in range(50)]
    assert schedule.theta_during(0) == 1.0  # DeepSpeed's current_theta before the first update
    assert [schedule.theta_during(g) for g in range(1, 20)] == [deepspeed_theta(g - 1) for g in range(1, 20)]
    assert schedule.forward_kwargs(3) == {"progressive_layer_drop": True, "pld_theta": deepspeed_theta(2)}
    assert LayerDropSchedule(theta=0.2, gamma=0.0).theta_at(10**6) == 1.0  # gamma 0: theta stays 1
    with pytest.raises(ValueError, match=r"theta=1.5.*\[0, 1\]"):
        LayerDropSchedule(theta=1.5, gamma=0.1)
    with pytest.raises(ValueError, match="gamma=-1"):
        LayerDropSchedule(theta=0.5, gamma=-1)


def test_deepspeeds_stateful_class() -> None:
    pld = ProgressiveLayerDrop(theta=THETA, gamma=GAMMA)
    assert pld.get_theta() == 1.0 and pld.get_state() == {"progressive_layer_drop": True, "pld_theta": 1.0}
    pld.update_state(7)
    assert pld.get_theta() == deepspeed_theta(7)
    assert pld.get_state() == {"progressive_layer_drop": True, "pld_theta": deepspeed_theta(7)}


# -- keep probabilities and draws --------------------------------------------------------------------------
def test_keep_probability_is_the_papers_p_l() -> None:
    assert [keep_probability(i, 4, 0.5) for i in range(4)] == [0.875, 0.75, 0.625, 0.5]
    assert [keep_probability(i, 3, 1.0) for i in range(3)] == [1.0, 1.0, 1.0]
    assert keep_probability(11, 12, 0.3) == pytest.approx(0.3)  # the last block: theta itself
    with pytest.raises(ValueError, match="index must be in"):
        keep_probability(4, 4, 0.5)
    with pytest.raises(ValueError, match="pld_theta must be in"):
        keep_probability(0, 4, 1.2)


def test_draws_skip_each_block_with_its_probability_and_scale_the_kept() -> None:
    gen = torch.Generator().manual_seed(0)
    n, layers, theta = 20000, 4, 0.4
    probs = [keep_probability(i, layers, theta) for i in range(layers)]
    kept = torch.zeros(layers)
    for _ in range(n):
        plan = LayerDropPlan.draw(layers, theta, generator=gen)
        for i in range(layers):
            if plan.kept(i):
                kept[i] += 1
                assert plan.scale(i) == 1.0 / probs[i]
    for i, p in enumerate(probs):  # binomial standard deviation <= 0.0035 at n = 20000
        assert abs(float(kept[i]) / n - p) < 0.015, (i, float(kept[i]) / n, p)
    # the same seed, the same draws (what keeps ranks in step)
    a = [LayerDropPlan.draw(6, 0.5, generator=torch.Generator().manual_seed(3)).scales for _ in range(2)]
    assert a[0] == a[1]


def test_plan_for_forward_and_apply() -> None:
    assert LayerDropPlan.for_forward(3, training=False, progressive_layer_drop=True, pld_theta=0.1).scales == (1.0,) * 3
    assert LayerDropPlan.for_forward(3, training=True).scales == (1.0,) * 3  # PLD off
    plan = LayerDropPlan((None, 2.0, 1.0))
    x = torch.ones(2)

    def block(t: torch.Tensor) -> torch.Tensor:
        return t + 3.0

    assert torch.equal(plan.apply(0, block, x), x)  # skipped: identity
    assert torch.equal(plan.apply(1, block, x), x + 6.0)  # residual update scaled by 1/p
    assert torch.equal(plan.apply(2, block, x), x + 3.0)
    assert plan.fraction_kept == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="skipped"):
        plan.scale(0)


# -- the example GPT ---------------------------------------------------------------------------------------
def _gpt(layers: int = 4) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=layers, n_heads=2))


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    t = torch.randint(0, 32, (2, 9), generator=gen)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def test_gpt_skips_blocks_with_their_frequency_in_training_only() -> None:
    model, (x, y) = _gpt(), _tokens()
    calls = [0] * 4
    for i, block in enumerate(model.blocks):
        block.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    n = 400  # seeded: the counts are fixed; 0.08 is over 3 binomial standard deviations
    with torch.no_grad():
        for _ in range(n):
            model(x, y, progressive_layer_drop=True, pld_theta=0.5)
    for i, p in enumerate([0.875, 0.75, 0.625, 0.5]):
        assert abs(calls[i] / n - p) < 0.08, (i, calls[i] / n, p)
    calls[:] = [0] * 4
    model.eval()  # evaluation: every block, unscaled, whatever the keywords say
    with torch.no_grad():
        full = model(x, y)
        assert torch.equal(model(x, y, progressive_layer_drop=True, pld_theta=0.1), full)
    assert calls == [2] * 4


def test_gpt_without_layer_drop_is_unchanged_and_draws_agree_across_instances() -> None:
    (x, y) = _tokens()
    a, b = _gpt(), _gpt()
    assert torch.equal(a(x, y), b(x, y, progressive_layer_drop=False, pld_theta=0.2))
    assert torch.equal(a(x, y, progressive_layer_drop=True, pld_theta=1.0), b(x, y))  # theta 1: nothing dropped
    # two models with the same pld_seed draw the same blocks (every rank skips the same ones)
    c, d = _gpt(), _gpt()
    with torch.no_grad():
        assert [float(c(x, y, progressive_layer_drop=True, pld_theta=0.3)) for _ in range(5)] == \
            [float(d(x, y, progressive_layer_drop=True, pld_theta=0.3)) for _ in range(5)]


# -- the engine --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    """A one-process gloo group for this module (torn down after it)."""
    with one_process_group():
        yield


class Recorder(nn.Module):
    """Records the keywords of every forward (DeepSpeed's PLD test model takes ``**kwargs`` too)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 1)
        self.seen: list[dict[str, Any]] = []

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.seen.append(dict(kwargs))
        return self.lin(x).pow(2).mean()


def _config(accum: int = 1, stage: int = 0, **pld: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accum,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "zero_optimization": {"stage": stage},
            "progressive_layer_drop": {"enabled": True, "theta": THETA, "gamma": GAMMA, **pld}}


def _engine(model: nn.Module, config: dict[str, Any]) -> Any:
    engine, *_ = zerospeed.initialize(model=model, config=config)
    return engine


def _train(engine: Any, micro_batches: int) -> None:
    for _ in range(micro_batches):
        engine.backward(engine(torch.ones(2, 3)))
        engine.step()


@pytest.mark.parametrize("accum", [1, 3])
def test_theta_follows_optimizer_steps_and_reaches_the_forward(one_rank: None, accum: int) -> None:
    model = Recorder()
    engine = _engine(model, _config(accum))
    assert engine.get_pld_theta() == 1.0  # before the first step
    steps = 8
    after_step: list[float] = []
    for micro in range(steps * accum):
        engine.backward(engine(torch.ones(2, 3)))
        engine.step()
        if (micro + 1) % accum == 0:
            after_step.append(engine.get_pld_theta())
    # DeepSpeed's own unit test: after step i (0-based) get_pld_theta() is theta(i); t counts optimizer steps
    assert after_step == [deepspeed_theta(i) for i in range(steps)]
    # each micro-batch of the window after k steps saw theta(k - 1) (1.0 in the first window)
    expected = [{"progressive_layer_drop": True, "pld_theta": 1.0 if k == 0 else deepspeed_theta(k - 1)}
                for k in range(steps) for _ in range(accum)]
    assert model.seen == expected
    assert engine.pld_enabled() and engine.pld_theta() == THETA and engine.pld_gamma() == GAMMA
    assert engine.pld_params() == {"theta": THETA, "gamma": GAMMA}


def test_eval_forwards_get_no_keywords(one_rank: None) -> None:
    model = Recorder()
    engine = _engine(model, _config())
    _train(engine, 2)
    engine.eval()
    with torch.no_grad():
        engine(torch.ones(2, 3))
    engine.train()
    engine(torch.ones(2, 3), extra=1)
    assert model.seen[2] == {}  # as DeepSpeed: only when module.training
    assert model.seen[3] == {"extra": 1, "progressive_layer_drop": True, "pld_theta": deepspeed_theta(1)}


def test_disabled_passes_nothing_and_answers_none(one_rank: None) -> None:
    model = Recorder()
    config = _config()
    del config["progressive_layer_drop"]
    engine = _engine(model, config)
    _train(engine, 2)
    assert engine.get_pld_theta() is None and model.seen == [{}, {}]
    assert not engine.pld_enabled() and engine.pld_params() is False  # DeepSpeed: no section -> False


def test_resume_continues_theta_from_global_steps(one_rank: None, tmp_path: Path) -> None:
    first = _engine(Recorder(), _config(accum=2))
    _train(first, 2 * 5)
    first.save_checkpoint(str(tmp_path))
    _train(first, 2)
    uninterrupted = first.module.seen[-2:]
    resumed_model = Recorder()
    resumed = _engine(resumed_model, _config(accum=2))
    assert resumed.get_pld_theta() == 1.0
    resumed.load_checkpoint(str(tmp_path))
    assert resumed.global_steps == 5 and resumed.get_pld_theta() == deepspeed_theta(4)
    _train(resumed, 2)
    assert resumed_model.seen == uninterrupted == [{"progressive_layer_drop": True, "pld_theta": deepspeed_theta(4)}] * 2
    assert resumed.get_pld_theta() == deepspeed_theta(5)


def test_example_gpt_trains_under_the_engine(one_rank: None) -> None:
    model, (x, y) = _gpt(), _tokens()
    engine = _engine(model, _config(gamma=1.0))
    losses = []
    for _ in range(6):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    assert all(math.isfinite(v) for v in losses)
    assert engine.get_pld_theta() == deepspeed_theta(5, gamma=1.0)


# -- refusals ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("section, message", [
    ({"theta": 1.5}, "progressive_layer_drop.theta: 1.5 is out of range; expected a number between 0 and 1"),
    ({"theta": -0.1}, "progressive_layer_drop.theta: -0.1 is out of range; expected a number between 0 and 1"),
    ({"gamma": -1}, "progressive_layer_drop.gamma: -1 is out of range; expected a number >= 0"),
])
def test_bad_values_are_config_errors(section: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config({"train_batch_size": 1, "progressive_layer_drop": {"enabled": True, **section}}, world_size=1)
    assert err.value.problems == (message,)


def test_a_model_that_cannot_take_the_keywords_is_refused_at_initialize(one_rank: None) -> None:
    with pytest.raises(ConfigError, match=r"progressive_layer_drop.enabled=true: .*Linear.forward does not accept "
                                          r"them; add keyword parameters progressive_layer_drop"):
        _engine(nn.Linear(3, 1), _config())


def test_pipeline_module_is_refused_by_name(one_rank: None) -> None:
    from zerospeed.pipe import PipelineModule

    module = PipelineModule([nn.Linear(3, 3), nn.Linear(3, 1)], num_stages=1, loss_fn=nn.functional.mse_loss)
    with pytest.raises(ConfigError, match="progressive_layer_drop.enabled=true: not supported with a PipelineModule"):
        _engine(module, _config())


# -- two ranks: the example GPT skips the same blocks on every rank, so ZeRO-3's gathers stay matched ------------
def _gpt_losses(stages: tuple[int, ...]) -> dict[int, list[float]]:
    out = {}
    for stage in stages:
        model = _gpt()
        engine = _engine(model, _config(accum=2, stage=stage, gamma=0.5, theta=0.3))
        gen = torch.Generator().manual_seed(10 + dist.get_rank())
        losses = []
        for _ in range(4 * 2):
            t = torch.randint(0, 32, (2, 9), generator=gen)
            loss = engine(t[:, :-1].contiguous(), t[:, 1:].contiguous())
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        out[stage] = losses
        engine.destroy()
    return out


def test_two_ranks_stage3_matches_stage0_under_layer_drop() -> None:
    ranks = run_distributed(_gpt_losses, 2, (0, 3), timeout=240)
    for per_rank in ranks:
        assert per_rank[0] == pytest.approx(per_rank[3], rel=1e-4, abs=1e-5)
