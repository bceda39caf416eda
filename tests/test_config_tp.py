"""``tensor_parallel``: DeepSpeed 0.19.8's TPTrainingConfig keys, partition_config validated at load,
options zerospeed does not implement listed as features (so the engine refuses them by name)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerospeed.config import ConfigError, DType, load_config

BATCH = {"train_batch_size": 8, "gradient_clipping": 0.0}


def tp(section: dict[str, Any]) -> Any:
    return load_config({**BATCH, "tensor_parallel": section}).tensor_parallel


def problems(section: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as err:
        load_config({**BATCH, "tensor_parallel": section})
    return str(err.value)


def test_defaults_are_deepspeeds() -> None:
    cfg = tp({})
    assert (cfg.dtype, cfg.autotp_size, cfg.tp_overlap_comm, cfg.vocab_parallel_lm_head,
            cfg.vocab_parallel_ce_backend) == (DType.FP16, 0, False, None, "torch")
    assert (cfg.tensor_parallel.tp_size, cfg.tensor_parallel.tp_grain_size, cfg.tensor_parallel.mpu,
            cfg.tensor_parallel.tp_group) == (1, 1, None, None)
    assert (cfg.injection_policy_tuple, cfg.partition_config, cfg.preset_model, cfg.keep_module_on_host,
            cfg.replace_with_kernel_inject) == (None, None, None, False, False)


def test_aliases_and_torch_dtypes() -> None:
    cfg = tp({"tp": {"tp_size": 2}, "autotp_size": 2, "kernel_inject": False, "dtype": torch.bfloat16})
    assert cfg.tensor_parallel.tp_size == 2 and cfg.dtype is DType.BF16 and not cfg.replace_with_kernel_inject
    assert "also given as tp" in problems({"tensor_parallel": {}, "tp": {}})


def test_partition_config_is_typed_and_prints_back() -> None:
    spec = {"patterns": [r".*\.gate_up_proj\.weight$"], "partition_type": "Column", "shape": [2, -1],
            "partition_dim": 0}
    cfg = tp({"autotp_size": 2, "partition_config": {"use_default_specs": False, "layer_specs": [spec]}})
    (layer,) = cfg.partition_config.layer_specs
    assert (layer.partition_type, layer.shape, layer.effective_partition_dim) == ("column", (2, -1), 0)
    printed = load_config({**BATCH, "tensor_parallel": {"partition_config": {"layer_specs": [spec]}}}).to_dict()
    assert printed["tensor_parallel"]["partition_config"]["layer_specs"][0]["shape"] == [2, -1]


@pytest.mark.parametrize("section, message", [
    ({"partition_config": {"layer_specs": [{"patterns": ["x"], "partiton_type": "row"}]}},
     "tensor_parallel.partition_config.layer_specs[0].partiton_type: unknown key; did you mean partition_type?"),
    ({"partition_config": {"layer_specs": [{"patterns": ["x"], "partition_type": "diagonal"}]}},
     'tensor_parallel.partition_config.layer_specs[0].partition_type: "diagonal" is not allowed; expected one of '
     '"column", "row", "skip"'),
    ({"partition_config": {"use_default_spec": False}},
     "tensor_parallel.partition_config.use_default_spec: unknown key; did you mean use_default_specs?"),
    ({"partition_config": {"layer_specs": [{"partition_type": "row"}]}},
     "tensor_parallel.partition_config.layer_specs[0].patterns: a layer spec needs at least one pattern"),
    ({"partition_config": {"layer_specs": [{"patterns": ["(q"]}]}},
     'tensor_parallel.partition_config.layer_specs[0].patterns[0]: "(q" is not a regular expression'),
    ({"partition_config": {"layer_specs": [{"patterns": ["q"], "shape": [2, 0]}]}},
     "tensor_parallel.partition_config.layer_specs[0].shape[1]: 0 is not a size"),
    ({"partition_config": {"layer_specs": [{"patterns": ["q"], "shape": [2, -1], "partition_dim": 2}]}},
     "tensor_parallel.partition_config.layer_specs[0].partition_dim: 2 is outside shape [2, -1]"),
    ({"tp": {"tp_sise": 2}}, "tensor_parallel.tp.tp_sise: unknown key; did you mean tp_size?"),
    ({"autotp_size": 2, "tp": {"tp_size": 4}},
     "tensor_parallel.tensor_parallel.tp_size: 4 does not match autotp_size 2"),
    ({"preset_model": "gpt9"}, 'tensor_parallel.preset_model: "gpt9" is not allowed; expected one of "llama"'),
    ({"vocab_parallel_ce_backend": "triton"}, 'tensor_parallel.vocab_parallel_ce_backend: "triton" is not allowed'),
    ({"dtype": "int8"}, 'tensor_parallel.dtype: "int8" is not a dtype'),
    ({"autotp_size": -1}, "tensor_parallel.autotp_size:"),
    ({"overlap_comm": True}, "tensor_parallel.overlap_comm: unknown key; did you mean tp_overlap_comm?"),
])
def test_mistakes_are_named(section: dict[str, Any], message: str) -> None:
    assert problems(section).startswith(message)


def test_options_not_implemented_are_features() -> None:
    cfg = load_config({**BATCH, "tensor_parallel": {
        "autotp_size": 2, "tp_overlap_comm": True, "vocab_parallel_ce_backend": "liger", "kernel_inject": True,
        "keep_module_on_host": True, "vocab_parallel_lm_head": False, "preset_model": "Qwen2",
        "partition_config": {"layer_specs": [{"patterns": ["q"]}]}, "tp": {"tp_grain_size": 64}}})
    assert cfg.features_in_use() == (
        "tensor_parallel", "tensor_parallel.tp_overlap_comm", "tensor_parallel.keep_module_on_host",
        "tensor_parallel.replace_with_kernel_inject", "tensor_parallel.vocab_parallel_lm_head=False",
        "tensor_parallel.vocab_parallel_ce_backend=liger", "tensor_parallel.partition_config",
        "tensor_parallel.preset_model=qwen2", "tensor_parallel.tensor_parallel.tp_grain_size")
    with pytest.raises(NotImplementedError, match="tensor_parallel.tp_overlap_comm, .*vocab_parallel_ce_backend=liger"):
        cfg.check_implemented(frozenset({"tensor_parallel"}))
    assert load_config({**BATCH, "tensor_parallel": {"autotp_size": 2}}).features_in_use() == ("tensor_parallel",)
