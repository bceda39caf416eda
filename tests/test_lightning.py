"""PyTorch Lightning and Fabric on zerospeed (``zerospeed.integrations.lightning``).

The multi-rank cases run ``tests/lightning_scripts/parity.py`` twice under ``torch.distributed.run``
(2 CPU ranks, gloo): one launch trains every configuration (DDP references, ZeRO stages 0-3, offload,
accumulation + clipping, bf16, Fabric) and saves checkpoints, a second, new process resumes them.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

from zerospeed.config.errors import ConfigError  # noqa: E402
from zerospeed.testing import free_port  # noqa: E402
from zerospeed.integrations.lightning_config import lightning_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "lightning_scripts" / "parity.py"
TOL = 1e-5


def _launch(phase: str, out: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(SCRIPT), phase, str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=str(out))
    assert done.returncode == 0, f"{phase} failed:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"


@pytest.fixture(scope="module")
def losses(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, list[float]]]:
    """Per rank: configuration name -> per-step losses (both launches)."""
    out = tmp_path_factory.mktemp("lightning")
    _launch("first", out)
    _launch("resume", out)
    result: dict[int, dict[str, list[float]]] = {}
    for rank in (0, 1):
        result[rank] = {**json.loads((out / f"first-rank{rank}.json").read_text()),
                        **json.loads((out / f"resume-rank{rank}.json").read_text())}
    return result


def _close(a: list[float], b: list[float], tol: float = TOL) -> None:
    assert len(a) == len(b), (len(a), len(b))
    worst = max(abs(x - y) for x, y in zip(a, b))
    assert worst <= tol, f"max |diff| {worst:.3g} > {tol}: {a} vs {b}"


@pytest.mark.timeout(480)
@pytest.mark.parametrize("name", ["zs0", "zs1", "zs2", "zs3", "zs3_offload"])
def test_trainer_matches_ddp_over_30_steps(losses: dict[int, dict[str, list[float]]], name: str) -> None:
    for rank in (0, 1):
        assert len(losses[rank]["ddp"]) == 30
        _close(losses[rank][name], losses[rank]["ddp"])


@pytest.mark.timeout(480)
@pytest.mark.parametrize(("name", "reference"), [("zs2_acc_clip", "ddp_acc_clip"), ("zs0_acc", "ddp_acc")])
def test_accumulation_and_clipping_match_ddp(losses: dict[int, dict[str, list[float]]], name: str,
                                             reference: str) -> None:
    """accumulate_grad_batches (15 batches an epoch: windows end at the epoch as with DDP) and clipping."""
    for rank in (0, 1):
        _close(losses[rank][name], losses[rank][reference])


@pytest.mark.timeout(480)
@pytest.mark.parametrize("name", ["zs3_resumed", "zs1_resumed"])
def test_trainer_resumes_from_engine_checkpoint(losses: dict[int, dict[str, list[float]]], name: str) -> None:
    """Saved by trainer.save_checkpoint at epoch 1's end (stage 3), fit(ckpt_path=) in a new process (stage
    3, and stage 1: any stage loads) gives the uninterrupted run's last 15 losses."""
    for rank in (0, 1):
        _close(losses[rank][name], losses[rank]["zs3"][15:])


@pytest.mark.timeout(480)
def test_the_configs_optimizer_section_when_configure_optimizers_is_absent(
        losses: dict[int, dict[str, list[float]]]) -> None:
    for rank in (0, 1):
        _close(losses[rank]["zs2_config_optimizer"], losses[rank]["ddp_const_lr"])


@pytest.mark.timeout(480)
def test_bf16_mixed_trains_close_to_fp32(losses: dict[int, dict[str, list[float]]]) -> None:
    for rank in (0, 1):
        _close(losses[rank]["zs2_bf16"], losses[rank]["ddp"], tol=0.05)


@pytest.mark.timeout(480)
def test_fp16_mixed_trains(losses: dict[int, dict[str, list[float]]]) -> None:
    """fp16 with dynamic loss scaling: the first steps overflow and are skipped (DeepSpeed's 2**16 start),
    then training proceeds."""
    for rank in (0, 1):
        fp16 = losses[rank]["zs2_fp16"]
        assert len(fp16) == 30 and all(math.isfinite(x) for x in fp16)
        assert sum(fp16[-5:]) < sum(fp16[:5])


@pytest.mark.timeout(480)
@pytest.mark.parametrize("name", ["fabric_zs2", "fabric_zs3"])
def test_fabric_matches_ddp(losses: dict[int, dict[str, list[float]]], name: str) -> None:
    for rank in (0, 1):
        _close(losses[rank]["fabric_ddp"], losses[rank]["ddp"])  # the two references agree
        _close(losses[rank][name], losses[rank]["fabric_ddp"])


@pytest.mark.timeout(480)
def test_fabric_save_load_resumes(losses: dict[int, dict[str, list[float]]]) -> None:
    for rank in (0, 1):
        _close(losses[rank]["fabric_zs3_resumed"], losses[rank]["fabric_zs3"][15:])


@pytest.mark.timeout(240)
def test_example_runs_with_lightnings_own_launcher(tmp_path: Path) -> None:
    """examples/lightning_train.py as written: devices=2 started by Lightning itself (it re-runs the
    script), ZeRO 3 with bf16 and accumulation, fit + save + validate."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(ROOT / "examples" / "lightning_train.py"), "--epochs", "1", "--precision",
           "bf16-mixed", "--accumulate", "2"]
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-6000:]
    assert "final train_loss" in done.stdout, done.stdout[-3000:]
    assert (tmp_path / "lightning_zerospeed.ckpt" / "checkpoint").is_dir()


# -- in-process: imports, registries, the config mapping and its refusals ------------------------------------

def test_import_zerospeed_does_not_import_lightning() -> None:
    code = ("import sys, zerospeed, zerospeed.integrations, zerospeed.integrations.lightning_config; "
            "assert not any(m == 'lightning' or m.startswith(('lightning.', 'pytorch_lightning')) "
            "for m in sys.modules), sorted(m for m in sys.modules if 'lightning' in m)")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_registered_by_name_in_trainer_and_fabric() -> None:
    import lightning.pytorch as pl
    from lightning.fabric import Fabric

    from zerospeed.integrations.lightning import ZeroSpeedPrecision, ZeroSpeedStrategy
    from zerospeed.integrations.lightning_fabric import ZeroSpeedFabricPrecision, ZeroSpeedFabricStrategy

    trainer = pl.Trainer(strategy="zerospeed_stage_3", accelerator="cpu", devices=1, precision="bf16-mixed",
                         logger=False, enable_checkpointing=False)
    assert isinstance(trainer.strategy, ZeroSpeedStrategy)
    assert trainer.strategy.config_source == {"zero_optimization": {"stage": 3}}
    assert isinstance(trainer.strategy.precision_plugin, ZeroSpeedPrecision)
    assert trainer.strategy.precision_plugin.precision == "bf16-mixed"
    fabric = Fabric(strategy="zerospeed", accelerator="cpu", devices=1)
    assert isinstance(fabric.strategy, ZeroSpeedFabricStrategy)
    assert isinstance(fabric.strategy.precision, ZeroSpeedFabricPrecision)


def test_unsupported_precision_is_refused_by_name() -> None:
    import lightning.pytorch as pl

    from zerospeed.integrations.lightning import ZeroSpeedStrategy

    with pytest.raises(ValueError, match="precision='bf16-true'.*'bf16-mixed'"):
        pl.Trainer(strategy=ZeroSpeedStrategy(), accelerator="cpu", devices=1, precision="bf16-true")


def test_config_mapping_fills_flags_in() -> None:
    cfg = lightning_config({"zero_optimization": {"stage": 1}}, precision="bf16-mixed", accumulate_grad_batches=4,
                           gradient_clip_val=0.5, gradient_clip_algorithm="norm")
    assert cfg["bf16"] == {"enabled": True} and "fp16" not in cfg
    assert cfg["gradient_accumulation_steps"] == 4 and cfg["gradient_clipping"] == 0.5
    assert cfg["train_micro_batch_size_per_gpu"] == 1
    assert lightning_config(None, precision="32-true")["zero_optimization"] == {"stage": 2}
    # no gradient_clip_val: clipping off, not DeepSpeed's default 1.0
    assert lightning_config({}, precision="32-true")["gradient_clipping"] == 0.0
    assert lightning_config({"gradient_clipping": 2.0}, precision="32-true")["gradient_clipping"] == 2.0
    auto = lightning_config({"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}, precision="16-mixed")
    assert auto["fp16"]["enabled"] is True and auto["bf16"]["enabled"] is False


def test_config_mapping_reads_a_path(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 2}))
    cfg = lightning_config(str(path), precision="32-true", accumulate_grad_batches=1)
    assert cfg["zero_optimization"] == {"stage": 3} and cfg["train_micro_batch_size_per_gpu"] == 2


@pytest.mark.parametrize(("config", "flags", "match"), [
    ({"bf16": {"enabled": True}}, {"precision": "32-true"}, "enables bf16 but the Lightning precision is '32-true'"),
    ({"fp16": {"enabled": True}}, {"precision": "bf16-mixed"}, "enables fp16"),
    ({"bf16": {"enabled": False}}, {"precision": "bf16-mixed"}, "bf16.enabled true, but it is false"),
    ({"gradient_accumulation_steps": 4}, {"precision": "32-true", "accumulate_grad_batches": 2},
     "gradient_accumulation_steps=4 disagrees with accumulate_grad_batches=2"),
    ({"gradient_clipping": 1.0}, {"precision": "32-true", "gradient_clip_val": 0.5},
     "gradient_clipping=1.0 disagrees with gradient_clip_val=0.5"),
    ({}, {"precision": "32-true", "gradient_clip_val": 0.5, "gradient_clip_algorithm": "value"},
     "gradient_clip_algorithm='value' is not supported"),
])
def test_config_conflicts_are_refused(config: dict[str, Any], flags: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        lightning_config(config, **flags)


def test_unknown_precision_names_the_choices() -> None:
    with pytest.raises(ValueError, match="'32-true', 'bf16-mixed', '16-mixed'"):
        lightning_config({}, precision="64-true")


def test_a_device_mismatch_with_zerospeeds_accelerator_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import zerospeed.accelerator as accel
    from zerospeed.integrations.lightning_config import check_device

    monkeypatch.setattr(accel, "get_accelerator", lambda: types.SimpleNamespace(device_type="cuda"))
    with pytest.raises(RuntimeError, match="Lightning runs on 'cpu' but zerospeed's accelerator is 'cuda'"):
        check_device("cpu", owner="ZeroSpeedStrategy")
