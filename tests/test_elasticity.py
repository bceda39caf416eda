"""DeepSpeed's ``elasticity`` section: ``compute_elastic_config``'s numbers, the engine's batch sizes at each
world size, and an elastic resume (another world size, same global batch, the data going on at the next
global sample).

The expected values in the tables were computed with DeepSpeed 0.19.7's ``deepspeed.elasticity`` (the last
release with elastic training; 0.19.8 removed it), by calling ``compute_elastic_config`` on each row, and
written here by hand.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import zerospeed
from zerospeed.config import ConfigError, load_config
from zerospeed.data import DistributedLoader
from zerospeed.elasticity import (
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    compute_elastic_config,
    elasticity_enabled,
    ensure_immutable_elastic_config,
)
from zerospeed.testing import run_distributed
from zerospeed.testing.logs import log_messages

DS_TEST = {"enabled": True, "max_train_batch_size": 10000, "micro_batch_sizes": [8, 12, 16, 17], "min_gpus": 32,
           "max_gpus": 1500, "min_time": 20, "version": 0.1}
DS_TEST_VALID = [32, 34, 36, 48, 51, 64, 68, 72, 96, 102, 136, 144, 153, 192, 204, 272, 288, 306, 408, 576, 612,
                 816, 1224]
DEFAULT_VALID = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 15, 20, 21, 24, 28, 30, 35, 40, 42, 56, 60, 70, 84, 105, 120,
                 140, 168, 210, 280, 420, 840]
SMALL = {"enabled": True, "max_train_batch_size": 16, "micro_batch_sizes": [1, 2, 4], "min_gpus": 1, "max_gpus": 4}

# (elasticity section, world_size, return_microbatch, WORLD_SIZE variable, DeepSpeed 0.19.7's result)
TABLE: list[tuple[dict[str, Any], int, bool, str | None, tuple]] = [
    (DS_TEST, 0, False, None, (9792, DS_TEST_VALID)),
    (DS_TEST, 64, False, None, (9792, DS_TEST_VALID, 17)),
    ({"enabled": True, "max_train_batch_size": 32, "micro_batch_sizes": [1, 2, 3, 7], "min_gpus": 1, "max_gpus": 1500,
      "version": 0.1}, 4, False, None, (24, [1, 2, 3, 4, 6, 8, 12, 24], 3)),
    ({"enabled": True, "max_train_batch_size": 100, "micro_batch_sizes": [8, 10, 12], "min_gpus": 1,
      "max_gpus": 1500, "version": 0.1}, 0, False, None, (96, [1, 2, 3, 4, 6, 8, 12])),
    ({"enabled": True, "max_train_batch_size": 100, "micro_batch_sizes": [8, 10, 12], "min_gpus": 1,
      "max_gpus": 1500, "version": 0.1, "prefer_larger_batch": False}, 0, False, None, (96, [1, 2, 3, 4, 6, 8, 12])),
    ({"enabled": True, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6]}, 8, False, None,
     (1680, DEFAULT_VALID, 6)),  # version 0.2 by default
    ({"enabled": True, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "version": 0.1}, 0, False, None,
     (1680, DEFAULT_VALID)),
    ({**DS_TEST, "version": 0.2, "num_gpus_per_node": 8, "model_parallel_size": 4}, 0, True, "16", (9996, [4], 16)),
    # version 0.2 at a size outside the searched set: the batch that fits that size alone
    ({"enabled": True, "max_train_batch_size": 1000, "micro_batch_sizes": [2, 4, 6], "min_gpus": 1, "max_gpus": 16,
      "version": 0.2}, 7, False, None, (994, [7], 2)),
    ({"enabled": True, "max_train_batch_size": 1000, "micro_batch_sizes": [2, 4, 6], "min_gpus": 1, "max_gpus": 16,
      "version": 0.2}, 17, False, None, (986, [17], 2)),
    ({"enabled": True, "max_train_batch_size": 1000, "micro_batch_sizes": [2, 4, 6], "min_gpus": 1, "max_gpus": 16,
      "version": 0.2, "prefer_larger_batch": False}, 17, False, None, (918, [17], 6)),
    ({"enabled": True, "max_train_batch_size": 512, "micro_batch_sizes": [4, 8], "min_gpus": 2, "max_gpus": 64,
      "version": 0.2, "num_gpus_per_node": 4}, 8, False, None, (384, [4, 8, 12, 16, 24, 32, 48], 8)),
    ({"enabled": True, "max_train_batch_size": 24, "micro_batch_sizes": [2], "min_gpus": 1, "max_gpus": 64,
      "version": 0.1}, 6, False, None, (24, [1, 2, 3, 4, 6, 12], 2)),
    ({**SMALL, "version": 0.1}, 0, False, None, (12, [1, 2, 3, 4])),
    ({**SMALL, "version": 0.1}, 0, True, "2", (12, [1, 2, 3, 4], 2)),
    ({**SMALL, "version": 0.2}, 0, True, "4", (12, [1, 2, 3, 4], 1)),
    ({**SMALL, "version": 0.2}, 3, False, None, (12, [1, 2, 3, 4], 4)),
]

# (elasticity section, world_size, target version, DeepSpeed 0.19.7's exception)
ERRORS: list[tuple[dict[str, Any], int, str, type[BaseException]]] = [
    (DS_TEST, 128, "0.19.8", ElasticityIncompatibleWorldSize),
    ({"enabled": True, "max_train_batch_size": 24, "micro_batch_sizes": [2], "version": 0.1}, 5, "0.19.8",
     ElasticityIncompatibleWorldSize),
    (DS_TEST, 0, "0.2", ElasticityError),  # older than 0.3.8
    ({**DS_TEST, "version": "0.3"}, 0, "0.19.8", ElasticityConfigError),
    ({**DS_TEST, "model_parallel_size": 4, "num_gpus_per_node": 8}, 0, "0.19.8", ElasticityConfigError),
    ({**DS_TEST, "version": 0.2, "model_parallel_size": 16, "num_gpus_per_node": 8}, 16, "0.19.8", ElasticityError),
    ({"enabled": True, "max_train_batch_size": 16, "micro_batch_sizes": [32]}, 1, "0.19.8", ValueError),
    ({"enabled": True, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "version": 0.15}, 1, "0.19.8",
     NotImplementedError),
    ({**DS_TEST, "enabled": False}, 0, "0.19.8", ElasticityConfigError),
    ({"enabled": True, "micro_batch_sizes": [2]}, 0, "0.19.8", ElasticityConfigError),
    ({"enabled": True, "max_train_batch_size": 8}, 0, "0.19.8", ElasticityConfigError),
    ({**DS_TEST, "micro_batch_sizes": [1, 4, -1, 2, -10]}, 0, "0.19.8", ElasticityConfigError),
    ({**DS_TEST, "micro_batch_sizes": 5}, 0, "0.19.8", ElasticityConfigError),
    ({**DS_TEST, "micro_batch_sizes": ["a", None, 0.5]}, 0, "0.19.8", ElasticityConfigError),
    ({**DS_TEST, "micro_batch_sizes": [2, 0.5, 4]}, 0, "0.19.8", ElasticityConfigError),
    ({**DS_TEST, "min_gpus": -1}, 0, "0.19.8", ElasticityConfigError),
    ({**DS_TEST, "max_gpus": -1}, 0, "0.19.8", ElasticityConfigError),
    ({**DS_TEST, "min_gpus": 64, "max_gpus": 32}, 0, "0.19.8", ElasticityConfigError),
]


@pytest.mark.parametrize("section, world_size, return_microbatch, env, expected", TABLE)
def test_compute_elastic_config_gives_deepspeeds_numbers(section: dict, world_size: int, return_microbatch: bool,
                                                          env: str | None, expected: tuple,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    if env is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", env)
    result = compute_elastic_config({"elasticity": section}, "0.19.8", world_size=world_size,
                                    return_microbatch=return_microbatch)
    assert result == expected


@pytest.mark.parametrize("section, world_size, target, error", ERRORS)
def test_compute_elastic_config_refuses_as_deepspeed(section: dict, world_size: int, target: str,
                                                      error: type[BaseException]) -> None:
    with pytest.raises(error):
        compute_elastic_config({"elasticity": section}, target, world_size=world_size)


def test_errors_name_the_values_and_the_fix() -> None:
    with pytest.raises(ElasticityIncompatibleWorldSize) as info:
        compute_elastic_config({"elasticity": DS_TEST}, "0.19.8", world_size=128)
    assert str(info.value) == (f"World size (128) is not valid with the current list of valid GPU counts: "
                               f"{DS_TEST_VALID} (global batch 9792); run with one of those data-parallel sizes, or "
                               "change elasticity.min_gpus / max_gpus / micro_batch_sizes / max_train_batch_size")
    with pytest.raises(ElasticityError, match=r"^target_deepspeed_version: 0\.2 is older than 0\.3\.8"):
        compute_elastic_config({"elasticity": DS_TEST}, "0.2")
    with pytest.raises(ElasticityConfigError, match=r"^elasticity\.max_train_batch_size: missing; "):
        compute_elastic_config({"elasticity": {"enabled": True, "micro_batch_sizes": [2]}}, "0.19.8")
    with pytest.raises(ElasticityConfigError, match=r"^'elasticity' is missing from the config"):
        compute_elastic_config({}, "0.19.8")
    with pytest.raises(ValueError, match=r"^ds_config: expected a config dict but received list"):
        compute_elastic_config([], "0.19.8")  # type: ignore[arg-type]


def test_version_0_2_needs_a_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ElasticityConfigError, match=r"WORLD_SIZE is None"):
        compute_elastic_config({"elasticity": {**SMALL, "version": 0.2}}, "0.19.8")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert compute_elastic_config({"elasticity": {**SMALL, "version": 0.2}}, "0.19.8") == (12, [1, 2, 3, 4])


def test_pre_releases_of_the_minimum_version_are_older() -> None:
    section = {"elasticity": {**SMALL, "version": 0.1}}
    for ok in ("0.3.8", "0.3.8.post1", "0.19.8+zerospeed.0.1.0", "v1.0", "0.4"):
        assert compute_elastic_config(section, ok) == (12, [1, 2, 3, 4])
    for old in ("0.3.8rc1", "0.3.8.dev0", "0.3.7", "0.3"):
        with pytest.raises(ElasticityError):
            compute_elastic_config(section, old)


def test_elasticity_enabled() -> None:
    assert not elasticity_enabled({})
    assert not elasticity_enabled({"elasticity": {"max_train_batch_size": 4}})
    assert elasticity_enabled({"elasticity": {"enabled": True}})


def test_scheduler_config_must_match_the_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = {**SMALL, "version": 0.1}
    monkeypatch.delenv("DEEPSPEED_ELASTICITY_CONFIG", raising=False)
    ensure_immutable_elastic_config(runtime)  # nothing to compare with
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", json.dumps({**runtime, "min_gpus": 2, "version": "0.1"}))
    ensure_immutable_elastic_config(runtime)  # only the batch keys and the version must agree
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", json.dumps({**runtime, "max_train_batch_size": 27}))
    with pytest.raises(ElasticityConfigError) as info:
        ensure_immutable_elastic_config(runtime)
    assert str(info.value) == (
        "elasticity.max_train_batch_size: the resource scheduler planned with 27 (DEEPSPEED_ELASTICITY_CONFIG) but "
        "this run's config has 16; the GPU counts it scales the job to would follow another batch arithmetic: give "
        "the scheduler and the job the same elasticity section")
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", json.dumps({**runtime, "micro_batch_sizes": [1, 2]}))
    with pytest.raises(ElasticityConfigError, match=r"^elasticity\.micro_batch_sizes: .* \[1, 2\] "):
        ensure_immutable_elastic_config(runtime)
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", json.dumps({**runtime, "version": 0.2}))
    with pytest.raises(ElasticityConfigError, match=r"^elasticity\.version: "):
        ensure_immutable_elastic_config(runtime)
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", "{not json")
    with pytest.raises(ElasticityConfigError, match=r"^DEEPSPEED_ELASTICITY_CONFIG: not valid JSON"):
        ensure_immutable_elastic_config(runtime)
    # the engine checks it too, before deriving the batch
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", json.dumps({**runtime, "max_train_batch_size": 27}))
    with pytest.raises(ElasticityConfigError):
        load_config({"elasticity": runtime}, world_size=2)


def test_deepspeed_paths_reach_the_same_objects() -> None:
    import importlib

    from zerospeed.deepspeed_alias import install_as_deepspeed, is_installed, uninstall_as_deepspeed

    installed_here = not is_installed()
    if installed_here:
        install_as_deepspeed()
    try:
        config = importlib.import_module("deepspeed.elasticity.config")
        elasticity = importlib.import_module("deepspeed.elasticity")
        assert elasticity.compute_elastic_config is compute_elastic_config
        assert (config.ElasticityError, config.ElasticityConfigError, config.ElasticityIncompatibleWorldSize) == (
            ElasticityError, ElasticityConfigError, ElasticityIncompatibleWorldSize)
        assert importlib.import_module("deepspeed.elasticity.constants").DEEPSPEED_ELASTICITY_CONFIG == (
            "DEEPSPEED_ELASTICITY_CONFIG")
        assert zerospeed.elasticity is elasticity  # a lazy submodule
    finally:
        if installed_here:
            uninstall_as_deepspeed()


# -- the engine's batch sizes ----------------------------------------------------------------------------
ELASTIC_24 = {"enabled": True, "max_train_batch_size": 24, "micro_batch_sizes": [2], "min_gpus": 1, "max_gpus": 64,
              "version": 0.1}


def test_config_derives_the_batch_at_each_world_size_with_one_global_batch() -> None:
    sizes = {}
    for world in (1, 2, 3, 4, 6, 12):
        cfg = load_config({"elasticity": ELASTIC_24}, world_size=world)
        sizes[world] = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps)
    assert sizes == {1: (24, 2, 12), 2: (24, 2, 6), 3: (24, 2, 4), 4: (24, 2, 3), 6: (24, 2, 2), 12: (24, 2, 1)}
    # a config built at one size re-derives at another (what a restart at another world size does)
    at4 = load_config({"elasticity": ELASTIC_24}, world_size=4)
    at2 = load_config(at4, world_size=2)
    assert (at2.train_batch_size, at2.train_micro_batch_size_per_gpu, at2.gradient_accumulation_steps) == (24, 2, 6)


def test_config_refuses_a_world_size_outside_the_valid_set() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"elasticity": ELASTIC_24}, world_size=5)
    assert isinstance(info.value, ElasticityIncompatibleWorldSize)  # what DeepSpeed users catch
    assert str(info.value) == (
        "elasticity: data-parallel world size 5: World size (5) is not valid with the current list of valid GPU "
        "counts: [1, 2, 3, 4, 6, 12] (global batch 24); run with one of those data-parallel sizes, or change "
        "elasticity.min_gpus / max_gpus / micro_batch_sizes / max_train_batch_size")


def test_batch_keys_beside_elasticity_are_refused_unless_ignored() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 2, "gradient_accumulation_steps": 1, "elasticity": ELASTIC_24}, world_size=2)
    assert isinstance(info.value, ElasticityConfigError)
    assert str(info.value) == (
        "train_batch_size, gradient_accumulation_steps: given beside an enabled elasticity section, which derives "
        "the batch sizes from the world size (they would not be used); remove them, or set "
        "elasticity.ignore_non_elastic_batch_info: true to have them ignored")
    with log_messages(logging.WARNING) as messages:
        cfg = load_config({"train_batch_size": 2, "train_micro_batch_size_per_gpu": "auto",
                           "elasticity": {**ELASTIC_24, "ignore_non_elastic_batch_info": True}}, world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (24, 2, 6)
    assert messages == ["[Elasticity] overriding train_batch_size: 2 -> 24",
                        "[Elasticity] overriding train_micro_batch_size_per_gpu: auto -> 2"]
    assert cfg.unresolved_auto() == []


def test_config_errors_are_config_errors() -> None:
    for section, message in (({**ELASTIC_24, "version": 0.15}, "elasticity.version: no elastic batch logic for "
                                                                 "version 0.15; use 0.1 or 0.2"),
                             ({**ELASTIC_24, "micro_batch_sizes": [32]}, "elasticity.micro_batch_sizes: [32] exceed "
                                                                         "max_train_batch_size 24; every micro batch "
                                                                         "must be <= max_train_batch_size")):
        with pytest.raises(ConfigError) as info:
            load_config({"elasticity": section}, world_size=1)
        assert isinstance(info.value, ElasticityConfigError) and str(info.value) == message


def test_config_refuses_a_global_batch_of_zero() -> None:
    # version 0.2 outside the searched set: max_train_batch_size 12 < micro batch 8 x 64 ranks
    section = {"enabled": True, "max_train_batch_size": 12, "micro_batch_sizes": [8, 10, 12], "min_gpus": 2}
    assert compute_elastic_config({"elasticity": section}, "0.19.8", world_size=64) == (0, [64], 12)
    with pytest.raises(ConfigError, match=r"^elasticity\.max_train_batch_size: 12 gives global batch 0 at "
                                          r"data-parallel size 64 .* raise max_train_batch_size to at least 512"):
        load_config({"elasticity": section}, world_size=64)


# -- the data position across a world-size change --------------------------------------------------------
def _order(epoch: int, size: int) -> list[int]:
    """An epoch's sample order: torch's DistributedSampler shuffle (seed 0 + epoch), unpadded."""
    return torch.randperm(size, generator=torch.Generator().manual_seed(epoch)).tolist()


def _take(loader: DistributedLoader, batches: int) -> list[int]:
    out: list[int] = []
    stream = _forever(loader)
    for _ in range(batches):
        out += next(stream)[0].tolist()
    return out


def _forever(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def test_position_resumes_at_the_next_global_sample_on_other_world_sizes() -> None:
    data = TensorDataset(torch.arange(30))
    # 4 ranks (30 samples padded to 32): 3 micro-batches of 2 each -> the first 24 samples of epoch 0
    old = [DistributedLoader(data, micro_batch_size=2, rank=r, world_size=4) for r in range(4)]
    seen = [_take(loader, 3) for loader in old]
    assert sorted(sum(seen, [])) == sorted(_order(0, 30)[:24])
    assert old[0].position() == {"epoch": 0, "samples": 24, "dataset_size": 30}
    rest = _order(0, 30)[24:]
    for world, micro in ((2, 3), (1, 2), (3, 1)):
        new = [DistributedLoader(data, micro_batch_size=micro, rank=r, world_size=world) for r in range(world)]
        for loader in new:
            loader.resume_at(0, 24)
        assert [_take(loader, len(rest) // world // micro) for loader in new] == [rest[r::world] for r in range(world)]
        assert new[0].position() == {"epoch": 1, "samples": 0, "dataset_size": 30}
        # then epoch 1 from its start, sharded as usual
        assert [_take(loader, 1) for loader in new] == [_order(1, 30)[r::world][:micro] for r in range(world)]


def test_a_finished_epoch_is_reported_as_the_next_one() -> None:
    data = TensorDataset(torch.arange(30))
    loaders = [DistributedLoader(data, micro_batch_size=2, rank=r, world_size=4) for r in range(4)]
    for loader in loaders:
        _take(loader, 4)  # 8 samples per rank: the whole padded epoch, the generator not yet past its end
    assert loaders[0].position() == {"epoch": 1, "samples": 0, "dataset_size": 30}


def test_a_start_between_ranks_rounds_down_and_says_so() -> None:
    data = TensorDataset(torch.arange(30))
    loader = DistributedLoader(data, micro_batch_size=2, rank=0, world_size=3)
    with log_messages(logging.WARNING) as messages:
        loader.resume_at(1, 8)
    assert messages == ["data position: epoch 1 resumes at sample 6, the multiple of the 3 data-parallel ranks below "
                        "the saved 8: 2 sample(s) are seen again (save at optimizer-step boundaries with a global "
                        "batch divisible by the world size to resume exactly)"]
    assert _take(loader, 1) == _order(1, 30)[6::3][:2]
    assert loader.state_dict() == {"epoch": 1, "batches_in_epoch": 1, "sample_offset": 2}


# -- an elastic resume at another world size, for real ---------------------------------------------------
ROWS = 30
RESUME_SECTION = {"enabled": True, "max_train_batch_size": 8, "micro_batch_sizes": [2], "min_gpus": 1,
                  "max_gpus": 4, "version": 0.1}  # valid at 1, 2 and 4 ranks with a global batch of 8


def _rows() -> TensorDataset:
    gen = torch.Generator().manual_seed(5)
    return TensorDataset(torch.arange(ROWS), torch.randn(ROWS, 3, generator=gen), torch.randn(ROWS, 1, generator=gen))


def _elastic_engine() -> Any:
    logging.getLogger("zerospeed").setLevel(logging.ERROR)
    torch.manual_seed(0)
    config = {"elasticity": RESUME_SECTION, "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
              "steps_per_print": 10**9}
    engine, _, loader, _ = zerospeed.initialize(model=nn.Linear(3, 1), config=config, training_data=_rows())
    assert loader is engine.training_dataloader
    return engine


def _train_ids(engine: Any, steps: int) -> list[int]:
    ids: list[int] = []
    stream = _forever(engine.training_dataloader)
    for _ in range(steps * engine.gradient_accumulation_steps()):
        index, x, y = next(stream)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        ids += index.tolist()
    return ids


def _batch_facts(engine: Any) -> tuple[int, int, int, int, int]:
    return (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(),
            engine.global_steps, engine.global_samples)


def _train_and_save(root: str) -> dict[str, Any]:
    engine = _elastic_engine()
    ids = _train_ids(engine, 5)
    engine.save_checkpoint(root)
    return {"ids": ids, "batch": _batch_facts(engine)}


def _load_and_train(root: str) -> dict[str, Any]:
    engine = _elastic_engine()
    engine.load_checkpoint(root)
    resumed = _batch_facts(engine)
    return {"ids": _train_ids(engine, 3), "resumed": resumed, "batch": _batch_facts(engine)}


def test_elastic_resume_on_fewer_ranks_keeps_the_global_batch_and_the_data_order(tmp_path: Path) -> None:
    saved = run_distributed(_train_and_save, 2, str(tmp_path))
    # 2 ranks: micro batch 2 x accumulation 2 x 2 = 8; 5 steps = epoch 0 (30 samples, each rank's last
    # micro-batch holds 1) and the first 8 samples of epoch 1
    assert [s["batch"] for s in saved] == [(8, 2, 2, 5, 40)] * 2
    epoch0, epoch1, epoch2 = _order(0, ROWS), _order(1, ROWS), _order(2, ROWS)
    for rank, run in enumerate(saved):
        assert run["ids"] == epoch0[rank::2] + epoch1[rank::2][:4]
    (resumed,) = run_distributed(_load_and_train, 1, str(tmp_path))
    # 1 rank: the same global batch of 8 = micro batch 2 x accumulation 4; the counters go on
    assert resumed["resumed"] == (8, 2, 4, 5, 40)
    assert resumed["batch"] == (8, 2, 4, 8, 64)
    # the rest of epoch 1 from its 9th sample, then epoch 2: what an uninterrupted 1-rank run sees from there
    assert resumed["ids"] == epoch1[8:] + epoch2[:2]
