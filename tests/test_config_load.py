"""load_config sources: dict, Config, JSON/hjson paths, base64; duplicate keys; bad sources."""

from __future__ import annotations

import base64
import json
import pathlib

import pytest

from zerospeed.config import Config, ConfigError, load_config

BASIC = {"train_batch_size": 8, "fp16": {"enabled": True}}


def _b64(obj: object) -> str:
    return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode()


def test_dict_source() -> None:
    cfg = load_config(BASIC)
    assert isinstance(cfg, Config)
    assert cfg.train_batch_size == 8
    assert cfg.train_micro_batch_size_per_gpu == 8
    assert cfg.gradient_accumulation_steps == 1
    assert cfg.fp16.enabled is True
    assert cfg.world_size == 1


def test_dict_is_not_mutated() -> None:
    raw = {"train_batch_size": 8, "zero_optimization": {"stage": 2, "cpu_offload": False}}
    before = json.dumps(raw, sort_keys=True)
    with pytest.warns(DeprecationWarning):
        load_config(raw)
    assert json.dumps(raw, sort_keys=True) == before


def test_config_passes_through_for_same_world_size() -> None:
    cfg = load_config({"train_micro_batch_size_per_gpu": 4}, world_size=2)
    assert load_config(cfg, world_size=2) is cfg


def test_config_rebuilt_for_other_world_size() -> None:
    cfg = load_config({"train_micro_batch_size_per_gpu": 4}, world_size=2)
    assert cfg.train_batch_size == 8
    # Re-derived from what was written (the micro batch), not from the derived values.
    again = load_config(cfg, world_size=4)
    assert (again.train_batch_size, again.train_micro_batch_size_per_gpu,
            again.gradient_accumulation_steps, again.world_size) == (16, 4, 1, 4)
    assert again != cfg


def test_config_with_full_triple_rechecked_for_other_world_size() -> None:
    cfg = load_config({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
                       "gradient_accumulation_steps": 1}, world_size=2)
    with pytest.raises(ConfigError, match=r"^train_batch_size: 8 != "):
        load_config(cfg, world_size=4)


def test_json_file_str_and_pathlib(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(BASIC))
    assert load_config(str(path)).train_batch_size == 8
    assert load_config(path).fp16.enabled is True


def test_hjson_file_with_comments(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "ds.hjson"
    path.write_text("{\n  # comment\n  train_batch_size: 12\n  // another\n"
                    "  zero_optimization: { stage: 1 }\n}\n")
    cfg = load_config(path, world_size=3)
    assert cfg.train_batch_size == 12
    assert cfg.train_micro_batch_size_per_gpu == 4
    assert cfg.zero_optimization.stage == 1


def test_json_file_with_comments_is_read_as_hjson(tmp_path: pathlib.Path) -> None:
    # DeepSpeed reads every config file with hjson, so commented ".json" files work there too.
    path = tmp_path / "ds.json"
    path.write_text('{\n  // micro batch\n  "train_micro_batch_size_per_gpu": 2\n}\n')
    assert load_config(path).train_batch_size == 2


def test_base64_source() -> None:
    cfg = load_config(_b64(BASIC))
    assert cfg.train_batch_size == 8
    assert cfg.fp16.enabled is True


def test_base64_without_padding() -> None:
    text = _b64({"train_micro_batch_size_per_gpu": 3}).rstrip("=")
    assert load_config(text).train_batch_size == 3


def test_duplicate_key_in_json_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "zero_optimization": {"stage": 1, "stage": 2}}')
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (f"{path}: duplicate key 'stage'; each key may appear only once "
                              "in an object")


def test_duplicate_key_in_hjson_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "dup.hjson"
    path.write_text("{\n # c\n train_batch_size: 8\n train_batch_size: 16\n}\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'train_batch_size'"):
        load_config(path)


def test_duplicate_key_in_base64() -> None:
    text = base64.urlsafe_b64encode(b'{"train_batch_size": 8, "train_batch_size": 8}').decode()
    with pytest.raises(ConfigError, match=r"duplicate key 'train_batch_size'"):
        load_config(text)


def test_missing_pathlib_path(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "nope.json"
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: config file does not exist"


def test_missing_path_string_says_what_was_tried() -> None:
    with pytest.raises(ConfigError) as err:
        load_config("configs/does_not_exist.json")
    assert str(err.value) == ("'configs/does_not_exist.json' is not an existing file, and not a "
                              "urlsafe-base64 encoded JSON config either (tried both)")


def test_base64_of_garbage() -> None:
    text = base64.urlsafe_b64encode(b"not json {").decode()
    with pytest.raises(ConfigError) as err:
        load_config(text)
    message = str(err.value)
    assert message.startswith(f"{text!r} is not an existing file; decoded as base64 it is not "
                              "a JSON config: base64 config: ")


def test_unparsable_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"train_batch_size": 8,, }')
    with pytest.raises(ConfigError, match=r"bad.json: not valid JSON \(.*\) nor hjson \(.*\)"):
        load_config(path)


def test_top_level_must_be_object(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: the top level is list, expected a JSON object"


def test_unsupported_source_type() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(42)  # type: ignore[arg-type]
    assert str(err.value) == ("config source of type int is not supported; pass a dict, a path "
                              "to a JSON/hjson file, or a base64-encoded JSON string")


@pytest.mark.parametrize("world_size", [0, -1, True, 1.5])
def test_bad_world_size(world_size: object) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(BASIC, world_size=world_size)  # type: ignore[arg-type]
    assert str(err.value) == f"world_size: {world_size!r} is out of range; expected an integer >= 1"


def test_config_error_is_value_error() -> None:
    assert issubclass(ConfigError, ValueError)
    err = ConfigError(["a: one", "b: two"])
    assert err.problems == ("a: one", "b: two")
    assert str(err) == "a: one\nb: two"


def test_config_is_frozen() -> None:
    cfg = load_config(BASIC)
    with pytest.raises(Exception):
        cfg.train_batch_size = 16  # type: ignore[misc]
    with pytest.raises(Exception):
        cfg.fp16.enabled = False  # type: ignore[misc]


def test_package_exports() -> None:
    import zerospeed.config as c

    assert c.load_config is load_config
    assert c.ConfigError is ConfigError
    assert c.Config is Config
