"""The ZeRO paper's model-state accounting, exactly (Ψ parameters, N ranks)."""

from __future__ import annotations

import pytest

from zerospeed.profiling import model_state_bytes

PSI, N = 100_000_000, 4


@pytest.mark.parametrize("stage, expected", [
    (0, 16 * PSI), (1, 4 * PSI + 12 * PSI // N), (2, 2 * PSI + 14 * PSI // N), (3, 16 * PSI // N)])
def test_paper_figures_for_mixed_precision_adam(stage: int, expected: int) -> None:
    assert model_state_bytes(PSI, stage=stage, world_size=N).total == expected


@pytest.mark.parametrize("stage, extra", [(0, 2 * PSI), (1, 2 * PSI), (2, 2 * PSI // N), (3, 2 * PSI // N)])
def test_fp32_gradient_accumulation_adds_two_bytes_per_gradient(stage: int, extra: int) -> None:
    base = model_state_bytes(PSI, stage=stage, world_size=N).total
    assert model_state_bytes(PSI, stage=stage, world_size=N, grad_bytes=4).total == base + extra


def test_parts_fp32_training_and_rounding() -> None:
    plan = model_state_bytes(PSI, stage=2, world_size=N)
    assert (plan.params, plan.grads, plan.optimizer_states) == (2 * PSI, 2 * PSI // N, 12 * PSI // N)
    fp32 = model_state_bytes(10, stage=0, world_size=3, param_bytes=4, grad_bytes=4, master_weights=False)
    assert (fp32.params, fp32.grads, fp32.optimizer_states) == (40, 40, 80)  # Adam: two fp32 moments
    odd = model_state_bytes(10, stage=3, world_size=3, optimizer="sgd_momentum")
    assert (odd.params, odd.grads, odd.optimizer_states) == (8, 8, 32)  # ceil(10/3) = 4 elements a rank


@pytest.mark.parametrize("kwargs, message", [
    (dict(stage=4, world_size=2), "stage=4 is not a ZeRO stage"),
    (dict(stage=1, world_size=0), "world_size=0 must be >= 1"),
    (dict(stage=1, world_size=2, optimizer="rmsprop"), "optimizer='rmsprop' is not one of"),
])
def test_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        model_state_bytes(10, **kwargs)


# -- zerospeed.plan: DeepSpeed's estimators, the exact model-state lines, the CLI ----------------------
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from zerospeed.launcher.cli import main as cli_main  # noqa: E402
from zerospeed.plan import estimators as est  # noqa: E402
from zerospeed.plan.cli import PlanUsageError, parse_memory  # noqa: E402
from zerospeed.testing import run_distributed  # noqa: E402

pytestmark = pytest.mark.spawns
ROOT = Path(__file__).resolve().parent.parent
DEMO = f"{ROOT / 'examples' / 'plan_models.py'}:demo_gpt"


def test_zero2_estimates_match_deepspeeds_formulas() -> None:
    # hand-computed from DeepSpeed 0.19.6's stage_1_and_2.py for 1B parameters on 1 node x 8 GPUs
    psi = 10**9
    assert est.estimate_zero2_model_states_mem_needs(psi, 8, 1, cpu_offload=True) == (int(psi * 32 * 1.5), 2 * psi)
    assert est.estimate_zero2_model_states_mem_needs(psi, 8, 1, cpu_offload=False) == (
        int(psi * 4 * 8 * 1.5), 2 * psi + int(18 * psi / 8))
    assert est.estimate_zero2_model_states_mem_needs(psi, 1, 1, cpu_offload=True) == (int(psi * 16 * 1.5), 2 * psi)


def test_zero3_estimates_match_deepspeeds_formulas() -> None:
    psi, layer = 10**9, 50_000_000
    f = est.estimate_zero3_model_states_mem_needs
    assert f(psi, layer, 8, 2, True, True, True) == (int(psi * 18 * 0.5 * 1.5), 4 * layer, 4 * layer)
    assert f(psi, layer, 8, 2, True, True, False) == (int(psi * 32 * 1.5), 4 * layer, 4 * layer)
    assert f(psi, layer, 8, 2, True, False, True) == (int(psi * 8 * 1.5), 4 * layer + int(2 * psi / 16), 4 * layer)
    assert f(psi, layer, 8, 2, False, False, True) == (int(layer * 32 * 1.5), 4 * layer + int(18 * psi / 16),
                                                       4 * layer)
    assert f(psi, layer, 8, 2, False, False, False) == (int(psi * 32 * 1.5), 4 * layer + int(18 * psi / 16),
                                                        4 * layer)


def test_printed_tables_and_deepspeed_paths(capsys: pytest.CaptureFixture[str]) -> None:
    from zerospeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live, model_to_params
    from zerospeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_live

    model = torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.Linear(1000, 10))
    assert model_to_params(model) == (1_011_010, 1_001_000)
    estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=4)
    estimate_zero3_model_states_mem_needs_all_live(model)
    out = capsys.readouterr().out.splitlines()
    assert out[:6] == ["Estimated memory needed for params, optim states and gradients for a:",
                       "HW: Setup with 1 node, 4 GPUs per node.", "SW: Model with 1M total params.",
                       "  per CPU  |  per GPU |   Options",
                       "    0.02GB |   0.00GB | offload_optimizer=cpu ",
                       "    0.02GB |   0.01GB | offload_optimizer=none"]
    assert out[8] == "SW: Model with 1M total params, 1M largest layer params."
    assert out[10] == "    0.03GB |   0.00GB | offload_param=cpu , offload_optimizer=cpu , zero_init=1"
    assert len(out) == 16 and out[-1].endswith("offload_param=none, offload_optimizer=none, zero_init=0")


def _states_vs_engine(cases: list[tuple[int, bool, str]], nvme_dir: str) -> list[tuple[dict, dict]]:
    import zerospeed
    from zerospeed.plan.factory import build_on_meta, load_factory, split_result
    from zerospeed.plan.settings import run_settings
    from zerospeed.plan.states import model_state_plan

    out = []
    for stage, bf16, offload in cases:
        config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  "zero_optimization": {"stage": stage, "reduce_bucket_size": 30000,
                                        "stage3_param_persistence_threshold": 1000}}
        if bf16:
            config["bf16"] = {"enabled": True}
        if offload == "cpu":
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        elif offload == "nvme":  # stage 3: parameter shards too, all but those fitting max_in_cpu elements
            config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir}
            if stage == 3:
                config["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir,
                                                                "max_in_cpu": 60_000}
        torch.manual_seed(0)
        model, example = split_result(DEMO, load_factory(DEMO)())
        engine, *_ = zerospeed.initialize(model=model, config=config)
        x = torch.randint(0, 256, (2, 64))
        for _ in range(2):
            engine.backward(engine(x, x))
            engine.step()
        meta, _ = build_on_meta(DEMO)
        planned = model_state_plan(meta, run_settings(config, 2).states, engine.comm.rank).as_breakdown()
        out.append((dict(engine.memory_breakdown()), planned))
    return out


def test_model_state_lines_equal_memory_breakdown_at_every_stage(tmp_path: Path) -> None:
    cases = [(0, True, ""), (1, True, ""), (2, False, ""), (2, True, "cpu"), (3, True, ""), (3, False, "cpu"),
             (2, True, "nvme"), (3, False, "nvme")]
    for rank in run_distributed(_states_vs_engine, 2, cases, str(tmp_path), timeout=240):
        for case, (measured, planned) in zip(cases, rank, strict=True):
            assert measured == planned, case


def test_parse_memory() -> None:
    assert parse_memory("16GB") == 16 * 10**9
    assert parse_memory("1.5GiB") == 3 * 2**29
    assert parse_memory("800 MiB") == 800 * 2**20
    for bad in ("lots", "16XB", "0GB"):
        with pytest.raises(PlanUsageError, match=f"--memory '{bad}'"):
            parse_memory(bad)


def test_cli_prints_the_plan_and_the_cheapest_fitting_configs(capsys: pytest.CaptureFixture[str]) -> None:
    config = str(ROOT / "examples" / "demo_config.json")
    code = cli_main(["plan", config, "--model", DEMO, "--world-size", "2", "--memory", "340MiB",
                     "--baseline", "235MiB", "--runtime", "80MiB", "--malloc", "fixed"])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = {line[:57].strip(): line[57:].strip() for line in out.splitlines()[1:13]}
    assert lines["baseline (idle rank: python, torch, zerospeed, gloo)"] == "235.0 MiB"
    assert lines["parameters"] == f"{832_768 * 2 / 2**20:.1f} MiB"  # 0.83M bf16 parameters
    assert lines["allocator (glibc heap keeping freed transients)"] == "0.0 MiB"  # --malloc fixed
    assert "cheapest configs whose peak per rank fits 340MiB:" in out
    first = out.split("fits 340MiB:\n")[1].splitlines()[0]
    assert first.split()[:6] == ["stage", "0,", "offload_optimizer=none,", "activation_checkpointing=off,",
                                 "micro_batch=4", "336.2"]


@pytest.mark.parametrize("argv, message", [
    (["--model", "no_such_module_xyz:f"], "--model 'no_such_module_xyz:f': cannot import"),
    (["--model", "examples/plan_models.py"], "expected MODULE:FACTORY"),
    (["--model", "examples/plan_models.py:nope"], "has no callable 'nope'"),
    (["--model", DEMO, "--memory", "big"], "--memory 'big': expected a size such as 16GB"),
    (["--model", DEMO, "--world-size", "0"], "--world-size 0: must be at least 1"),
])
def test_cli_errors_name_the_argument_and_the_fix(argv: list[str], message: str,
                                                  capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    code = cli_main(["plan", str(ROOT / "examples" / "demo_config.json"), *argv, "--baseline", "200MiB"])
    assert code == 2
    assert message in capsys.readouterr().err


_LAYOUT_FACTORIES = """
import torch
from torch import nn
from zerospeed.moe.layer import MoE
from zerospeed.pipe import PipelineModule


class MoENet(nn.Module):
    def __init__(self):
        super().__init__()
        self.moe = MoE(8, nn.Linear(8, 8), num_experts=2)

    def forward(self, x):
        return self.moe(x)[0]


def moe():
    return MoENet(), torch.randn(2, 8)


def pipe():
    return PipelineModule([nn.Linear(8, 8), nn.Linear(8, 8)], num_stages=1), torch.randn(2, 8)
"""


@pytest.mark.parametrize("factory, config, what", [
    ("moe", {}, "a model with MoE layers (expert parallelism) is not planned"),
    ("pipe", {}, "a PipelineModule (pipeline parallelism) is not planned"),
    (None, {"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel.autotp_size=2 (tensor parallelism) is not planned"),
])
def test_layouts_the_plan_does_not_model_are_refused_by_name(factory: str | None, config: dict, what: str,
                                                             tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Pipeline, expert and tensor parallelism split parameters and activations in ways the plan does not
    model: refused, naming what, rather than planned as data parallelism."""
    (tmp_path / "layouts.py").write_text(_LAYOUT_FACTORIES)
    (tmp_path / "config.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, **config}))
    model = f"{tmp_path / 'layouts.py'}:{factory}" if factory else DEMO
    code = cli_main(["plan", str(tmp_path / "config.json"), "--model", model, "--world-size", "2",
                     "--baseline", "200MiB"])
    err = capsys.readouterr().err
    assert code == 2 and what in err and "zerospeed plan models data parallelism" in err, err


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(3))
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def test_activation_trace_counts_what_autograd_keeps() -> None:
    from zerospeed.plan.activations import ActivationTrace, trace_activations

    with torch.device("meta"):
        model = _Net()
    trace = trace_activations(model, torch.zeros(1, 8), micro_batch=5)
    row = 5 * 16 * 4  # one [5, 16] fp32 activation
    # inp keeps x (5x8 fp32); block 0 keeps its input and its relu output; blocks 1-2 only their relu
    # output (their input is the previous relu output, one storage); out keeps block 2's output (same)
    assert trace == ActivationTrace(saved=5 * 8 * 4 + 4 * row, in_blocks=4 * row, block_inputs=3 * row,
                                    largest_block=2 * row, largest_tensor=row)
    assert trace.peak(checkpointing=False) == 160 + 4 * row + row
    assert trace.peak(checkpointing=True) == 160 + 3 * row + 2 * row + row
    assert trace_activations(model, torch.zeros(1, 8), micro_batch=10) == trace.scaled(2)


def test_plan_predicts_the_demo_ranks_peak_rss_within_10_percent() -> None:
    """The demo GPT on 2 real ranks (each its own process, as launched) at stage 3 with CPU offload
    (bench_plan.py runs every stage, with and without offload, and the 98M model)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_plan

    from zerospeed.plan.activations import trace_activations
    from zerospeed.plan.baseline import measure_baseline
    from zerospeed.plan.factory import build_on_meta
    from zerospeed.plan.memory_plan import plan_memory
    from zerospeed.plan.settings import run_settings

    baseline = measure_baseline()
    model, example = build_on_meta(DEMO)
    base = json.loads((ROOT / "examples" / "demo_config.json").read_text())
    for stage, offload in ((3, True),):
        config = bench_plan.case_config(base, stage, offload)
        settings = run_settings(config, 2)
        trace = trace_activations(model, example, micro_batch=settings.micro_batch,
                                  compute_dtype=settings.states.param_dtype)
        predicted = plan_memory(model, trace, settings, baseline, traced_batch=settings.micro_batch).peak
        measured = max(r["peak"] for r in bench_plan.run_ranks([DEMO, json.dumps(config), "2"]))
        assert abs(predicted - measured) <= 0.10 * measured, (stage, offload, predicted, measured)
