"""What a new user meets first, as written: the docs' and README's snippets run, ``initialize`` logs its config
in one line (the full dump at DEBUG, with a documented switch), the demo's "config beyond defaults" lists no
defaults, a dataset smaller than one global batch is named in a warning, and a wrong ``ZEROSPEED_AS_DEEPSPEED``
is reported once."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

import zerospeed
from zerospeed.data import DistributedLoader
from zerospeed.entry import LOG_LEVEL_ENV, _ensure_log_handler
from zerospeed.testing import log_messages, one_process_group

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ZEROSPEED_AS_DEEPSPEED", LOG_LEVEL_ENV)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    return {**env, **extra}


def _code_blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", path.read_text(), flags=re.DOTALL)


# -- docs/pipeline.md -----------------------------------------------------------------------------------------
def test_pipeline_doc_snippet_runs_as_written(tmp_path: Path) -> None:
    """The page's first block is a whole script; run through the launcher on the 2 ranks it names."""
    script = _code_blocks(ROOT / "docs" / "pipeline.md", "python")[0]
    assert "zerospeed --num_procs 2 train_pipe.py" in (ROOT / "docs" / "pipeline.md").read_text()
    (tmp_path / "train_pipe.py").write_text(script)
    done = subprocess.run([sys.executable, "-m", "zerospeed", "--num_procs", "2", "--master_port", "0",
                           "train_pipe.py"], cwd=tmp_path, capture_output=True, text=True, env=_env(), timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    results = dict(re.findall(r"rank (\d): (train loss [\d.]+, eval loss [\d.]+)", done.stdout))
    assert sorted(results) == ["0", "1"] and results["0"] == results["1"], done.stdout  # every stage's loss
    # the config is one line (rank 0's), not DeepSpeed's dump of every default
    logged = done.stdout + done.stderr
    assert logged.count("zerospeed config (resolved)") == 1 and "every default in force" not in logged


# -- README.md ------------------------------------------------------------------------------------------------
def _readme_usage() -> tuple[str, dict[str, Any]]:
    readme = ROOT / "README.md"
    usage = next(block for block in _code_blocks(readme, "python") if "zerospeed.initialize(" in block)
    config = json.loads(_code_blocks(readme, "json")[0])
    assert "`ds_config.json`" in readme.read_text() and 'config="ds_config.json"' in usage
    return usage, config


def test_readme_usage_runs_with_its_ds_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    usage, config = _readme_usage()
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    names: dict[str, Any] = {"model": torch.nn.Linear(4, 2), "loss_fn": torch.nn.functional.mse_loss,
                             "dataset": TensorDataset(torch.randn(64, 4), torch.randn(64, 2))}
    with one_process_group():
        exec(compile(usage, "README.md", "exec"), names)  # noqa: S102 - the README's own lines
    engine = names["engine"]
    # 64 samples in micro-batches of 8, 2 per optimizer step
    assert (engine.global_steps, engine.train_batch_size(), engine.zero_optimization_stage()) == (4, 16, 2)
    assert engine.config.precision.value == "bf16"


def test_readme_names_where_the_cifar_script_lives_and_what_it_needs() -> None:
    text = " ".join((ROOT / "README.md").read_text().split())
    assert "zerospeed --num_procs 2 tests/deepspeed_examples/cifar/cifar10_deepspeed.py" in text
    assert (ROOT / "tests" / "deepspeed_examples" / "cifar" / "cifar10_deepspeed.py").is_file()
    assert "It needs torchvision and reads CIFAR-10 from `./data`" in text


# -- the config at start-up -----------------------------------------------------------------------------------
SMALL = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
         "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
CONFIG_LINE = ("zerospeed config (resolved): batch 8 = micro 4 x accumulation 2 x 1 data-parallel rank(s), fp32, "
               "ZeRO stage 0; features beyond the defaults: optimizer.type=SGD (the full config is logged at "
               "DEBUG: ZEROSPEED_LOG_LEVEL=debug, or logging.getLogger('zerospeed').setLevel(logging.DEBUG))")


def _initialize(level: int, **kwargs: Any) -> tuple[Any, list[str]]:
    with one_process_group(), log_messages(level) as records:
        engine, *_ = zerospeed.initialize(model=torch.nn.Linear(4, 2), config=SMALL, **kwargs)
    return engine, records


def test_initialize_logs_its_config_in_one_line_and_the_whole_of_it_at_debug(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    _, info = _initialize(logging.INFO)
    assert info == [CONFIG_LINE]
    engine, debug = _initialize(logging.DEBUG)
    assert CONFIG_LINE in debug
    assert f"zerospeed config (resolved, every default in force):\n{engine.config.to_json()}" in debug


def test_the_config_line_lists_only_features_beyond_the_defaults() -> None:
    """gradient_clipping is on by default (1.0, as DeepSpeed 0.19.8): listed only when a config sets
    another value, not for every config."""
    from zerospeed.config.policies import TrainingPolicy
    from zerospeed.entry import config_line

    def line(**extra: Any) -> str:
        cfg = zerospeed.load_config({**SMALL, **extra}, world_size=1)
        return config_line(cfg, TrainingPolicy.from_config(cfg))

    assert line() == CONFIG_LINE
    assert line(gradient_clipping=1.0) == CONFIG_LINE  # restating the default asks for nothing
    assert line(gradient_clipping=0) == CONFIG_LINE
    assert "; features beyond the defaults: optimizer.type=SGD, gradient_clipping (" in line(gradient_clipping=0.5)
    assert "; features beyond the defaults: none (" in line(optimizer=None)


def test_log_level_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    logger = logging.getLogger("zerospeed")
    with log_messages(logging.INFO):  # restores the logger's level afterwards
        monkeypatch.setenv(LOG_LEVEL_ENV, "Warning")
        _ensure_log_handler()
        assert logger.level == logging.WARNING
        monkeypatch.setenv(LOG_LEVEL_ENV, "debug")
        _ensure_log_handler()
        assert logger.level == logging.DEBUG
        monkeypatch.setenv(LOG_LEVEL_ENV, "loud")
        with pytest.raises(ValueError) as info:
            _ensure_log_handler()
    assert str(info.value) == ("ZEROSPEED_LOG_LEVEL='loud' is not a log level; use one of debug, info, warning, "
                               "error, critical (debug also logs the whole resolved config) or unset it")


def test_a_level_the_user_set_on_the_logger_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without handlers anywhere zerospeed adds its own; it used to reset the level to INFO too, undoing
    ``logging.getLogger("zerospeed").setLevel(logging.DEBUG)`` (the documented way to see the full config)."""
    logger = logging.getLogger("zerospeed")
    monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # pytest's capture handlers, for this test
    monkeypatch.setattr(logger, "handlers", [])
    previous = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        _ensure_log_handler()
        assert logger.level == logging.DEBUG and len(logger.handlers) == 1
        logger.handlers.clear()
        logger.setLevel(logging.NOTSET)
        _ensure_log_handler()
        assert logger.level == logging.INFO and len(logger.handlers) == 1
    finally:
        logger.setLevel(previous)


def test_a_wrong_log_level_fails_before_initialize_does_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LOG_LEVEL_ENV, "loud")
    with pytest.raises(ValueError) as info:  # no process group, and a config that would fail too
        zerospeed.initialize(model=torch.nn.Linear(4, 2), config={"train_batch_size": "many"})
    assert str(info.value).startswith("ZEROSPEED_LOG_LEVEL='loud' is not a log level; use one of debug, ")


# -- the demo's "config beyond defaults" ----------------------------------------------------------------------
def _demo_report() -> ModuleType:
    spec = importlib.util.spec_from_file_location("zerospeed_demo_report", ROOT / "examples" / "report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_config_beyond_defaults_lists_no_defaults() -> None:
    report = _demo_report()
    config = json.loads((ROOT / "examples" / "demo_config.json").read_text())
    settings = report.non_default_settings(zerospeed.load_config(config, world_size=2), 2)
    assert settings == {
        "optimizer.type": "AdamW", "optimizer.params.lr": 0.003, "optimizer.params.betas": [0.9, 0.95],
        "optimizer.params.eps": 1e-08, "optimizer.params.weight_decay": 0.1,
        "scheduler.type": "WarmupCosineLR", "scheduler.params.total_num_steps": 300,
        "scheduler.params.warmup_num_steps": 20, "scheduler.params.warmup_type": "linear",
        "scheduler.params.cos_min_ratio": 0.1,  # warmup_min_ratio 0.0 is the default the file restates
        "bf16.enabled": True, "zero_optimization.reduce_bucket_size": 500000,
        "csv_monitor.enabled": True, "csv_monitor.job_name": "demo",
    }
    restated = {**config, "optimizer": {**config["optimizer"], "legacy_fusion": False},
                "scheduler": {**config["scheduler"],
                              "params": {**config["scheduler"]["params"], "last_batch_iteration": -1}}}
    assert report.non_default_settings(zerospeed.load_config(restated, world_size=2), 2) == settings


# -- a dataset smaller than one global batch ------------------------------------------------------------------
TINY_WARNING = (
    "the training data holds 3 samples, fewer than one global batch of 16 (train_micro_batch_size_per_gpu 4 x "
    "gradient_accumulation_steps 2 x 2 data-parallel rank(s)): each rank gets 2 sample(s) per epoch (including 1 "
    "repeated, so that every rank gets as many); its only micro-batch holds 2 instead of 4; an epoch is 1 "
    "micro-batch(es), fewer than the 2 of one optimizer step. Add data (at least 16 samples) or lower "
    "train_micro_batch_size_per_gpu / gradient_accumulation_steps")


def test_a_dataset_smaller_than_a_global_batch_is_warned_about_once() -> None:
    data = TensorDataset(torch.arange(3))
    with log_messages(logging.WARNING) as records:
        loaders = [DistributedLoader(data, micro_batch_size=4, rank=rank, world_size=2, gradient_accumulation_steps=2)
                   for rank in range(2)]
    assert records == [TINY_WARNING]  # rank 0 only
    # what the warning says happens: one short micro-batch per rank, one sample seen twice
    batches = [[b.tolist() for (b,) in loader] for loader in loaders]
    assert [len(b) for b in batches] == [1, 1] and [len(b[0]) for b in batches] == [2, 2]
    assert sorted(batches[0][0] + batches[1][0]) in ([0, 0, 1, 2], [0, 1, 1, 2], [0, 1, 2, 2])
    with log_messages(logging.WARNING) as records:
        DistributedLoader(TensorDataset(torch.arange(16)), micro_batch_size=4, rank=0, world_size=2,
                          gradient_accumulation_steps=2)
        DistributedLoader(TensorDataset(torch.arange(3)), micro_batch_size=4, rank=0, world_size=2,
                          drop_last=True, gradient_accumulation_steps=2)
    assert records == [
        "the training data holds 3 samples, fewer than one global batch of 16 (train_micro_batch_size_per_gpu 4 x "
        "gradient_accumulation_steps 2 x 2 data-parallel rank(s)): each rank gets 1 sample(s) per epoch (1 left out "
        "by dataloader_drop_last); an epoch yields no micro-batch at all. Add data (at least 16 samples) or lower "
        "train_micro_batch_size_per_gpu / gradient_accumulation_steps"]


SMALL_DATA_WARNING = (
    "the training data holds 5 samples, fewer than one global batch of 8 (train_micro_batch_size_per_gpu 4 x "
    "gradient_accumulation_steps 2 x 1 data-parallel rank(s)): each rank gets 5 sample(s) per epoch; its last "
    "micro-batch holds 1 instead of 4. Add data (at least 8 samples) or lower train_micro_batch_size_per_gpu / "
    "gradient_accumulation_steps")


def test_initialize_warns_about_training_data_smaller_than_a_global_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    _, records = _initialize(logging.WARNING, training_data=TensorDataset(torch.randn(5, 4), torch.randn(5, 2)))
    assert records == [SMALL_DATA_WARNING]


def test_the_small_data_warning_has_zerospeeds_prefix_and_obeys_its_log_level(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """It was logged before initialize installed its handler: no "[zerospeed]" prefix, and
    ZEROSPEED_LOG_LEVEL=error did not silence it. Here as for a user who configured no logging."""
    logger = logging.getLogger("zerospeed")
    monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # pytest's capture handlers, for this test
    monkeypatch.setattr(logger, "handlers", [])
    previous = logger.level
    data = TensorDataset(torch.randn(5, 4), torch.randn(5, 2))
    try:
        logger.setLevel(logging.NOTSET)
        with one_process_group():
            zerospeed.initialize(model=torch.nn.Linear(4, 2), config=SMALL, training_data=data)
        assert capsys.readouterr().err == f"[zerospeed] {SMALL_DATA_WARNING}\n[zerospeed] {CONFIG_LINE}\n"
        monkeypatch.setenv(LOG_LEVEL_ENV, "error")
        with one_process_group():
            zerospeed.initialize(model=torch.nn.Linear(4, 2), config=SMALL, training_data=data)
        assert capsys.readouterr().err == ""
    finally:
        logger.setLevel(previous)


def test_only_global_rank_0_warns_about_small_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """With pipeline or tensor parallelism every stage has a data-parallel rank 0; the job warns once.
    Here the one process is data-parallel rank 0 and plays global rank 1."""
    import zerospeed.entry

    monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    monkeypatch.setattr(zerospeed.entry, "group_rank", lambda group=None: 1)
    engine, records = _initialize(logging.WARNING, training_data=TensorDataset(torch.randn(5, 4), torch.randn(5, 2)))
    assert engine.dp_world_size == 1 and records == []


# -- ZEROSPEED_AS_DEEPSPEED -----------------------------------------------------------------------------------
def test_a_wrong_alias_switch_is_reported_once() -> None:
    """A venv's site-packages is read twice at interpreter start, which ran the .pth hook twice."""
    installed = Path(sysconfig.get_path("purelib")) / "zerospeed_as_deepspeed.pth"
    assert installed.read_text() == (ROOT / "src" / "zerospeed_as_deepspeed.pth").read_text(), (
        f"{installed} is not this checkout's hook; reinstall (pip install -e .) so this test checks the hook as written")
    done = subprocess.run([sys.executable, "-c", "import sys; print('zerospeed' in sys.modules)"],
                          capture_output=True, text=True, env=_env(ZEROSPEED_AS_DEEPSPEED="maybe"), timeout=60)
    assert done.returncode == 0 and done.stdout == "True\n", done.stderr
    assert done.stderr == ("zerospeed: ZEROSPEED_AS_DEEPSPEED='maybe' is not understood; set it to 1 to make "
                           "`import deepspeed` use zerospeed, or 0 / unset for not\n")
