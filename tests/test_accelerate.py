"""A plain Accelerate loop (``prepare``, ``backward``, ``optimizer.step()``, gradient accumulation), unchanged,
on zerospeed through ``ZEROSPEED_AS_DEEPSPEED=1``: 2 ranks on CPU, tiny GPT-2 and Llama in fp32.
``DeepSpeedPlugin(zero_stage=2)`` and ``DeepSpeedPlugin(hf_ds_config=<ZeRO-3>)`` give the loss curve of the
same loop without DeepSpeed (DDP over gloo) within 1e-5. One torchrun launch runs every configuration
(tests/hf_scripts/accelerate_runs.py); a unit test pins the CPU-backend shim (zerospeed/integrations/hf.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from zerospeed.testing import free_port  # noqa: E402
from zerospeed.testing.alias import alias_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "hf_scripts" / "accelerate_runs.py"
KINDS = ("gpt2", "llama")
CONFIGS = ("ddp", "z2", "z3")
RESUMED = ("z2-resume", "z3-resume")  # stopped half way (accelerator.save_state), resumed (load_state)
TOL = 1e-5


@pytest.fixture(scope="module")
def curves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[float]]:
    out = tmp_path_factory.mktemp("accelerate")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         str(SCRIPT), str(out), ",".join(KINDS), ",".join(CONFIGS + RESUMED)],
        cwd=out, capture_output=True, text=True, env=alias_env(), timeout=280)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    with open(out / "curves.json") as f:
        loaded: dict[str, list[float]] = json.load(f)
    return loaded


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("config", CONFIGS[1:])
def test_accelerate_deepspeed_matches_plain_loop(curves: dict[str, list[float]], kind: str, config: str) -> None:
    plain, got = curves[f"{kind}-ddp"], curves[f"{kind}-{config}"]
    assert len(plain) == len(got) == 12
    worst = max(abs(a - b) for a, b in zip(got, plain))
    assert worst <= TOL, f"{kind} {config}: loss differs from the plain loop by {worst:g}\n{got}\n{plain}"
    assert plain[-1] < plain[0] - 0.3, "the tiny model should learn within 12 steps"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("config", RESUMED)
def test_accelerate_save_and_load_state_resume_identically(curves: dict[str, list[float]], kind: str,
                                                           config: str) -> None:
    whole, resumed = curves[f"{kind}-{config.removesuffix('-resume')}"], curves[f"{kind}-{config}"]
    assert len(resumed) == len(whole), (whole, resumed)
    worst = max(abs(a - b) for a, b in zip(whole, resumed))
    assert worst <= TOL, f"{kind} {config}: the resumed run differs by {worst:g}\n{whole}\n{resumed}"


def test_accelerate_sees_deepspeed_after_install() -> None:
    """``install_as_deepspeed()`` in a fresh interpreter: Accelerate reports DeepSpeed available."""
    code = ("import zerospeed; zerospeed.install_as_deepspeed()\n"
            "from accelerate.utils import is_deepspeed_available\n"
            "print(is_deepspeed_available())\n")
    env = {k: v for k, v in alias_env().items() if k != "ZEROSPEED_AS_DEEPSPEED"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True"], done.stdout + done.stderr[-2000:]


def test_backend_shim_only_answers_accelerate_deepspeed_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wrapped ``PartialState._prepare_backend`` names gloo only for a DeepSpeed rank without a device
    backend; without DeepSpeed, with ``cpu=True`` or outside a launched rank it returns Accelerate's answer."""
    from types import SimpleNamespace

    from zerospeed.integrations.hf import patch_accelerate_state

    class PartialState:
        def _prepare_backend(self, cpu: bool = False, sagemaker_dp: bool = False,
                             backend: str | None = None) -> tuple[str | None, str]:
            return backend, "NO"

    module = SimpleNamespace(PartialState=PartialState)
    patch_accelerate_state(module)  # type: ignore[arg-type]
    patch_accelerate_state(module)  # type: ignore[arg-type]  # idempotent
    state = PartialState()
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert state._prepare_backend(False) == ("gloo", "NO")
    assert state._prepare_backend(True) == (None, "NO")
    assert state._prepare_backend(False, False, "nccl") == ("nccl", "NO")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    assert state._prepare_backend(False) == (None, "NO")
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert state._prepare_backend(False) == (None, "NO")


def test_launcher_runner_and_groups_answer_what_accelerate_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    """``accelerate launch`` imports ``DEEPSPEED_ENVIRONMENT_NAME``; Accelerate and transformers ask
    ``deepspeed.utils.groups`` for the sequence-parallel group (none here: KeyError, as DeepSpeed)."""
    import importlib

    import zerospeed.launcher.runner as runner
    from zerospeed.utils import groups

    assert runner.DEEPSPEED_ENVIRONMENT_NAME == os.environ.get("DS_ENV_FILE", ".deepspeed_env")
    monkeypatch.setenv("DS_ENV_FILE", "custom_env")
    try:
        assert importlib.reload(runner).DEEPSPEED_ENVIRONMENT_NAME == "custom_env"
    finally:
        monkeypatch.undo()
        importlib.reload(runner)
    assert groups._get_sequence_parallel_world_size() == 1 and groups._get_sequence_parallel_rank() == 0
    assert groups._get_model_parallel_world_size() == 1
    with pytest.raises(KeyError, match="sequence parallel"):
        groups._get_sequence_parallel_group()
    with pytest.raises(RuntimeError, match="not started"):
        groups._get_data_parallel_world_size()


def test_the_accelerate_example_runs(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         str(ROOT / "examples" / "accelerate_loop.py"), "--zero-stage", "3"],
        cwd=tmp_path, capture_output=True, text=True, env=alias_env(), timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "tensors in the consolidated state dict" in done.stdout
