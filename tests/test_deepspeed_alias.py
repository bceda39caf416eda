"""``zerospeed.install_as_deepspeed`` / ``ZEROSPEED_AS_DEEPSPEED=1``: ``deepspeed.X`` is the same module
object as ``zerospeed.X``, the "deepspeed" package metadata passes the frameworks' version gates, and the
real DeepSpeed is never shadowed."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Iterator

import pytest

import zerospeed
from zerospeed.deepspeed_alias import (
    DEEPSPEED_API_VERSION,
    DeepSpeedInstalledError,
    install_as_deepspeed,
    install_from_environment,
    is_installed,
    metadata_version,
    pth_hook_installed,
    uninstall_as_deepspeed,
)

ROOT = Path(__file__).resolve().parents[1]

# DeepSpeed's module paths that scripts and frameworks import (DeepSpeedExamples, transformers, accelerate,
# Lightning), each with the names they take from it and the zerospeed object each must be.
PATHS = {
    "deepspeed": {"initialize": "zerospeed.entry.initialize", "add_config_arguments": "zerospeed.entry.add_config_arguments",
                  "init_distributed": "zerospeed.distributed.env.init_distributed",
                  "DeepSpeedEngine": "zerospeed.engine.Engine", "get_accelerator": "zerospeed.accelerator.get_accelerator"},
    "deepspeed.accelerator": {"get_accelerator": "zerospeed.accelerator.get_accelerator"},
    "deepspeed.comm": {"get_rank": "zerospeed.comm.api.get_rank", "init_distributed": "zerospeed.comm.api.init_distributed",
                       "configure": "zerospeed.comm.summary.configure", "log_summary": "zerospeed.comm.summary.log_summary",
                       "reset_log": "zerospeed.comm.summary.reset_log"},
    "deepspeed.runtime.engine": {"DeepSpeedEngine": "zerospeed.engine.Engine"},
    "deepspeed.runtime.zero": {"Init": "zerospeed.zero.init.Init", "GatheredParameters": "zerospeed.zero.init.GatheredParameters"},
    "deepspeed.runtime.zero.partition_parameters": {"Init": "zerospeed.zero.init.Init",
                                                    "GatheredParameters": "zerospeed.zero.init.GatheredParameters",
                                                    "register_external_parameter": "zerospeed.zero.external.register_external_parameter"},
    "deepspeed.runtime.lr_schedules": {"WarmupLR": "zerospeed.lr_schedules.WarmupLR",
                                       "VALID_LR_SCHEDULES": "zerospeed.lr_schedules.VALID_LR_SCHEDULES"},
    "deepspeed.runtime.activation_checkpointing.checkpointing": {"checkpoint": "zerospeed.checkpointing.checkpoint",
                                                                 "configure": "zerospeed.checkpointing.configure"},
    "deepspeed.runtime.dataloader": {"RepeatingLoader": "zerospeed.data.loader.RepeatingLoader"},
    "deepspeed.runtime.utils": {"see_memory_usage": None, "set_random_seed": None, "move_to_device": None},
    "deepspeed.runtime.base_optimizer": {"DeepSpeedOptimizer": None},
    "deepspeed.runtime.progressive_layer_drop": {"ProgressiveLayerDrop": None},
    "deepspeed.runtime.comm.compressed": {"CompressedBackend": None},
    "deepspeed.runtime.comm.nccl": {"NcclBackend": "zerospeed.runtime.comm.compressed.CompressedBackend"},
    "deepspeed.runtime.comm.mpi": {"MpiBackend": None},
    "deepspeed.runtime.fp16.onebit.adam": {"OnebitAdam": "zerospeed.optim.onebit.adam.OnebitAdam"},
    "deepspeed.runtime.fp16.onebit.zoadam": {"ZeroOneAdam": "zerospeed.optim.onebit.zoadam.ZeroOneAdam"},
    "deepspeed.runtime.fp16.onebit.lamb": {"OnebitLamb": "zerospeed.optim.onebit.lamb.OnebitLamb"},
    "deepspeed.checkpointing": {"checkpoint": "zerospeed.checkpointing.checkpoint", "configure": "zerospeed.checkpointing.configure"},
    "deepspeed.checkpoint.utils": {"clone_tensors_for_torch_save": None},
    "deepspeed.zero": {"Init": "zerospeed.zero.init.Init", "GatheredParameters": "zerospeed.zero.init.GatheredParameters",
                       "register_external_parameter": "zerospeed.zero.external.register_external_parameter"},
    "deepspeed.utils": {"logger": "zerospeed.utils.logging.logger", "log_dist": "zerospeed.utils.logging.log_dist",
                        "RepeatingLoader": "zerospeed.data.loader.RepeatingLoader",
                        "safe_get_full_fp32_param": "zerospeed.utils.safe_get_full_fp32_param"},
    "deepspeed.utils.logging": {"logger": "zerospeed.utils.logging.logger"},
    "deepspeed.utils.groups": {"_get_sequence_parallel_world_size": None, "_get_data_parallel_group": None},
    "deepspeed.launcher.runner": {"DEEPSPEED_ENVIRONMENT_NAME": None, "main": None},
    "deepspeed.utils.zero_to_fp32": {"get_fp32_state_dict_from_zero_checkpoint": None,
                                     "load_state_dict_from_zero_checkpoint": None,
                                     "convert_zero_checkpoint_to_fp32_state_dict": None},
    "deepspeed.ops.adam": {"DeepSpeedCPUAdam": "zerospeed.ops.adam.CPUAdam"},
    "deepspeed.ops.adagrad": {"DeepSpeedCPUAdagrad": "zerospeed.ops.adagrad.CPUAdagrad"},
    "deepspeed.ops.lion": {"DeepSpeedCPULion": "zerospeed.ops.lion.CPULion"},
    "deepspeed.moe.utils": {"is_moe_param": None, "split_params_into_different_moe_groups_for_optimizer": None},
    "deepspeed.monitor.monitor": {"MonitorMaster": "zerospeed.monitor.monitor.MonitorMaster",
                                  "Monitor": "zerospeed.monitor.base.Monitor"},
    "deepspeed.monitor.csv_monitor": {"csvMonitor": None},
    "deepspeed.monitor.tensorboard": {"TensorBoardMonitor": None},
    "deepspeed.monitor.wandb": {"WandbMonitor": None},
    "deepspeed.monitor.comet": {"CometMonitor": None},
    "deepspeed.monitor.config": {"get_monitor_config": None, "DeepSpeedMonitorConfig": None},
    "deepspeed.monitor.utils": {"check_tb_availability": None, "check_wandb_availability": None,
                                "check_comet_availability": None},
}


def _resolve(dotted: str) -> object:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.fixture
def as_deepspeed() -> Iterator[None]:
    if is_installed():  # the whole test process runs with ZEROSPEED_AS_DEEPSPEED=1: leave it so
        yield
        return
    install_as_deepspeed()
    try:
        yield
    finally:
        uninstall_as_deepspeed()


def test_every_path_is_the_zerospeed_module_and_object(as_deepspeed: None) -> None:
    import deepspeed

    assert deepspeed is zerospeed
    for path, names in PATHS.items():
        module = importlib.import_module(path)
        own = "zerospeed" + path[len("deepspeed"):]
        assert module is importlib.import_module(own), path  # one module object, not a copy
        assert module.__name__ == own and module.__spec__.name == own, path  # it keeps its own identity
        for name, original in names.items():
            value = getattr(module, name)
            if original is not None:
                assert value is _resolve(original), f"{path}.{name}"
            if isinstance(value, (type, types.FunctionType)):  # defined by zerospeed, not borrowed
                assert value.__module__.startswith("zerospeed."), f"{path}.{name}"


def test_issue_acceptance_accelerator_identity(as_deepspeed: None) -> None:
    import deepspeed.accelerator as a
    import zerospeed.accelerator as b

    assert a is b
    assert sys.modules["deepspeed.accelerator"] is sys.modules["zerospeed.accelerator"]


def test_attribute_chains_after_a_bare_import(as_deepspeed: None) -> None:
    """accelerate and Lightning read these right after ``import deepspeed``."""
    import deepspeed

    assert "WarmupLR" in deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES
    assert deepspeed.utils.logging.logger is deepspeed.utils.logger
    assert deepspeed.zero.GatheredParameters is deepspeed.runtime.zero.GatheredParameters
    assert deepspeed.checkpointing.configure is deepspeed.runtime.activation_checkpointing.checkpointing.configure
    assert callable(deepspeed.comm.get_rank)
    assert deepspeed.monitor.monitor.MonitorMaster is deepspeed.monitor.MonitorMaster
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        deepspeed.runtime.nothing


def test_metadata_passes_the_frameworks_gates(as_deepspeed: None) -> None:
    version = importlib.metadata.version("deepspeed")
    assert version == metadata_version() == f"{DEEPSPEED_API_VERSION}+zerospeed.{zerospeed.__version__}"
    assert importlib.metadata.metadata("deepspeed")["Name"] == "deepspeed"
    assert importlib.util.find_spec("deepspeed") is not None  # transformers' and accelerate's availability check
    assert "deepspeed" in importlib.metadata.packages_distributions()
    public = tuple(int(x) for x in version.split("+")[0].split("."))
    assert public >= (0, 16, 4) and public >= (0, 9, 3) and public >= (0, 16, 0)  # accelerate, transformers, Lightning


def test_unknown_paths_are_missing_not_invented(as_deepspeed: None) -> None:
    with pytest.raises(ModuleNotFoundError, match="deepspeed.nothing_here"):
        importlib.import_module("deepspeed.nothing_here")
    assert importlib.util.find_spec("deepspeed.nothing_here") is None  # probes see "absent", not an error


def test_install_is_idempotent_and_uninstall_restores() -> None:
    if is_installed():
        pytest.skip("this test process runs with ZEROSPEED_AS_DEEPSPEED=1")
    install_as_deepspeed()
    install_as_deepspeed()
    import deepspeed.runtime.engine  # noqa: F401

    finders = [f for f in sys.meta_path if type(f).__name__ == "DeepSpeedAliasFinder"]
    assert len(finders) == 1
    uninstall_as_deepspeed()
    assert not is_installed()
    assert not [name for name in sys.modules if name == "deepspeed" or name.startswith("deepspeed.")]
    assert importlib.util.find_spec("deepspeed") is None
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("deepspeed")
    assert sys.modules["zerospeed.runtime.engine"].__spec__.name == "zerospeed.runtime.engine"


def test_import_zerospeed_as_deepspeed_needs_no_install() -> None:
    import zerospeed as deepspeed

    assert deepspeed.initialize is zerospeed.entry.initialize
    assert deepspeed.zero.Init is zerospeed.zero.Init
    assert deepspeed.DeepSpeedEngine is zerospeed.Engine


def test_init_inference_is_the_inference_engine() -> None:
    from zerospeed.inference.engine import init_inference

    assert zerospeed.init_inference is init_inference  # built now (tests/test_inference_engine.py runs it)
    with pytest.raises(TypeError, match="model is a object; expected a torch.nn.Module"):
        zerospeed.init_inference(object())


def test_tp_model_init_is_autotp() -> None:
    from zerospeed.tensor_parallel.autotp import tp_model_init

    assert zerospeed.tp_model_init is tp_model_init  # built now (tests/test_autotp.py runs it)


# -- the real DeepSpeed installed: refuse ------------------------------------------------------------------
def _python(code: str, *, env_extra: dict[str, str], path: list[Path]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "ZEROSPEED_AS_DEEPSPEED"}
    env.update(env_extra)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, path), str(ROOT / "src")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=60)


@pytest.fixture
def real_deepspeed_package(tmp_path: Path) -> Path:
    package = tmp_path / "deepspeed"
    package.mkdir()
    (package / "__init__.py").write_text("REAL = True\n__version__ = '0.19.8'\n")
    return tmp_path


@pytest.fixture
def real_deepspeed_metadata_only(tmp_path: Path) -> Path:
    info = tmp_path / "deepspeed-0.19.8.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.19.8\n")
    return tmp_path


def test_install_refuses_when_the_real_deepspeed_is_importable(real_deepspeed_package: Path) -> None:
    done = _python("""
        import zerospeed
        try:
            zerospeed.install_as_deepspeed()
        except zerospeed.deepspeed_alias.DeepSpeedInstalledError as exc:
            print("REFUSED", exc)
        import deepspeed
        print("REAL" if getattr(deepspeed, "REAL", False) else "SHADOWED")
    """, env_extra={}, path=[real_deepspeed_package])
    assert done.returncode == 0, done.stderr
    assert "REFUSED" in done.stdout and "REAL" in done.stdout.splitlines()[-1], done.stdout
    assert str(real_deepspeed_package / "deepspeed") in done.stdout
    assert "pip uninstall deepspeed" in done.stdout and "import zerospeed as deepspeed" in done.stdout


def test_install_refuses_on_real_deepspeed_metadata(real_deepspeed_metadata_only: Path) -> None:
    done = _python("""
        import zerospeed
        zerospeed.install_as_deepspeed()
    """, env_extra={}, path=[real_deepspeed_metadata_only])
    assert done.returncode != 0
    assert "DeepSpeedInstalledError" in done.stderr and "deepspeed 0.19.8" in done.stderr, done.stderr


# -- the environment switch (the .pth hook run at interpreter start) -------------------------------------
def test_the_pth_hook_is_installed_with_the_package() -> None:
    assert pth_hook_installed(), ("zerospeed_as_deepspeed.pth is not in site-packages, so ZEROSPEED_AS_DEEPSPEED=1 does "
                               "nothing: install the package (make install; setup.py puts it in wheels and editable installs)")


def test_environment_switch_installs_at_interpreter_start() -> None:
    done = _python("""
        import sys
        assert "zerospeed.deepspeed_alias" in sys.modules  # done by the .pth file, before this code
        import deepspeed, zerospeed, importlib.metadata
        print(deepspeed is zerospeed, importlib.metadata.version("deepspeed"))
    """, env_extra={"ZEROSPEED_AS_DEEPSPEED": "1"}, path=[])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", metadata_version()]


@pytest.mark.parametrize("value", ["0", ""])
def test_environment_switch_off_leaves_deepspeed_absent(value: str) -> None:
    done = _python("""
        import sys, importlib.util
        print(importlib.util.find_spec("deepspeed") is None, "zerospeed" in sys.modules)
    """, env_extra={"ZEROSPEED_AS_DEEPSPEED": value}, path=[])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False"]  # interpreter start does not even import zerospeed


def test_environment_switch_with_the_real_deepspeed_warns_and_keeps_it(real_deepspeed_package: Path) -> None:
    done = _python("import deepspeed; print(getattr(deepspeed, 'REAL', False))",
                   env_extra={"ZEROSPEED_AS_DEEPSPEED": "1"}, path=[real_deepspeed_package])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
    assert "ZEROSPEED_AS_DEEPSPEED=1 ignored" in done.stderr and "the real DeepSpeed is installed" in done.stderr


def test_environment_switch_rejects_unknown_values(capsys: pytest.CaptureFixture[str]) -> None:
    assert install_from_environment({"ZEROSPEED_AS_DEEPSPEED": "maybe"}) is False
    assert "ZEROSPEED_AS_DEEPSPEED='maybe' is not understood; set it to 1" in capsys.readouterr().err
    assert install_from_environment({}) is False
