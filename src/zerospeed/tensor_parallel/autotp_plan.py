"""AutoTP's plan: which layers of an existing model are column-split, row-split or replicated.

Pure: :func:`describe_model` reads names, layer kinds and shapes off a model into a
:class:`ModelDescription` value (nothing is changed), and :func:`plan_autotp` turns that, a
tensor-parallel size and DeepSpeed's ``partition_config`` / ``preset_model`` into an
:class:`AutoTPPlan`, or refuses with the layer and the fix. ``autotp.apply_autotp`` executes a plan.

Rules are DeepSpeed's ``TPLayerSpec`` s (regular expressions on parameter names, first match wins,
matched against ``<module>.weight``). The user's ``layer_specs`` come first; with
``use_default_specs`` (the default) they are followed by the preset's (``preset_model``) or, without a
preset, by zerospeed's built-in rules for the model type (Hugging Face Llama-style models and GPT-2).
A ``shape`` of ``[n, -1]`` marks ``n`` equal tensors fused along the split dimension (GPT-2's
``c_attn`` holds q, k and v): each is split on its own so every rank keeps whole heads of each.

Embeddings and the LM head stay replicated by default: splitting them needs a vocabulary-parallel
loss the Hugging Face models do not call, and GPT-2 ties its LM head to the input embedding (a tied
weight cannot be split by one layer alone, so it is refused). Attention modules whose projections are
split get per-rank head counts; the counts (and GPT-2's ``split_size``) must divide evenly.
"""

from __future__ import annotations

import enum
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping

from pydantic import ValidationError
from torch import nn

from zerospeed.config.schema_tp import PRESET_MODELS, AutoTPPartitionConfig, TPLayerSpecConfig
from zerospeed.config.translate import config_error


class Split(str, enum.Enum):
    """How one layer is split: output features (column), input features (row), or not at all."""

    COLUMN = "column"
    ROW = "row"
    REPLICATE = "skip"


class LayerKind(str, enum.Enum):
    LINEAR = "linear"  # nn.Linear: weight [out, in]
    CONV1D = "conv1d"  # transformers' Conv1D: weight [in, out]
    OTHER = "other"  # anything else holding parameters (embeddings, norms...)


@dataclass(frozen=True)
class LayerInfo:
    """A module holding parameters directly: its path, kind, features and parameter names."""

    name: str
    kind: LayerKind
    type_name: str
    in_features: int = 0
    out_features: int = 0
    tied: bool = False  # its weight is also another module's (GPT-2's lm_head and wte)
    params: tuple[str, ...] = ("weight",)


@dataclass(frozen=True)
class AttentionInfo:
    """An attention module whose head counts follow its projections' sizes."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    projections: tuple[str, ...]  # the paths of its q/k/v projections (GPT-2: c_attn)
    has_split_size: bool = False  # GPT-2 splits c_attn's output with ``split_size``


@dataclass(frozen=True)
class ModelDescription:
    model_type: str | None
    layers: tuple[LayerInfo, ...]
    attentions: tuple[AttentionInfo, ...] = ()


@dataclass(frozen=True)
class LayerPlan:
    split: Split
    parts: int = 1  # equal tensors fused along the split dimension, each split on its own
    gather_output: bool = False


@dataclass(frozen=True)
class HeadPlan:
    """Per-rank head counts of one attention module (``split_size``: GPT-2's, else None)."""

    num_heads: int
    num_kv_heads: int
    split_size: int | None = None


@dataclass(frozen=True)
class AutoTPPlan:
    """Every Linear-like layer's split (replicated ones included) and the attention modules to adjust."""

    tp_size: int
    layers: Mapping[str, LayerPlan] = field(default_factory=dict)
    heads: Mapping[str, HeadPlan] = field(default_factory=dict)

    def split_layers(self) -> dict[str, LayerPlan]:
        return {name: p for name, p in self.layers.items() if p.split is not Split.REPLICATE}


def _specs(*rows: tuple[str, str] | tuple[str, str, int]) -> tuple[TPLayerSpecConfig, ...]:
    """Rules from ``(pattern, partition_type[, fused parts])`` rows."""
    out = []
    for row in rows:
        spec: dict[str, object] = {"patterns": [row[0]], "partition_type": row[1]}
        if len(row) == 3:
            spec["shape"] = [row[2], -1]
        out.append(TPLayerSpecConfig.model_validate(spec))
    return tuple(out)


_LLAMA = _specs((r".*\.self_attn\.o_proj\.weight$", "row"), (r".*\.self_attn\.[qkv]_proj\.weight$", "column"),
                (r".*\.mlp\.down_proj\.weight$", "row"), (r".*\.mlp\.(up|gate)_proj\.weight$", "column"))
_GPT2 = _specs((r".*\.attn\.c_attn\.weight$", "column", 3), (r".*\.attn\.c_proj\.weight$", "row"),
               (r".*\.mlp\.c_fc\.weight$", "column"), (r".*\.mlp\.c_proj\.weight$", "row"))
#: Built-in rules by Hugging Face ``config.model_type`` (used when no preset is named).
DEFAULT_RULES: Mapping[str, tuple[TPLayerSpecConfig, ...]] = {
    "llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "gpt2": _GPT2}
#: DeepSpeed's ``AutoTPPresets`` (same patterns; ``llama_gqa`` needs sizes and is not a named preset there).
PRESETS: Mapping[str, tuple[TPLayerSpecConfig, ...]] = {
    "llama": _LLAMA, "qwen2": _LLAMA,
    "bloom": _specs((r".*\.self_attention\.dense\.weight$", "row"),
                    (r".*\.self_attention\.query_key_value\.weight$", "column"),
                    (r".*\.mlp\.dense_4h_to_h\.weight$", "row"), (r".*\.mlp\.dense_h_to_4h\.weight$", "column")),
    "chatglm": _specs((r".*\.self_attention\.dense\.weight$", "row"),
                      (r".*\.self_attention\.query_key_value\.weight$", "column", 3),
                      (r".*\.mlp\.dense_4h_to_h\.weight$", "row"),
                      (r".*\.mlp\.dense_h_to_4h\.weight$", "column", 2)),
    "mixtral": _specs((r".*\.self_attn\.o_proj\.weight$", "row"), (r".*\.self_attn\.[qkv]_proj\.weight$", "column"),
                      (r".*\.block_sparse_moe\.experts\.\d+\.w2\.weight$", "row"),
                      (r".*\.block_sparse_moe\.experts\.\d+\.w[13]\.weight$", "column"),
                      (r".*\.block_sparse_moe\.gate\.weight$", "skip")),
    "deepseek_v2": _specs((r".*\.self_attn\.o_proj\.weight$", "row"),
                          (r".*\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight$", "skip"),
                          (r".*\.self_attn\.(q_b_proj|kv_b_proj)\.weight$", "column"),
                          (r".*\.mlp\.experts\.\d+\.down_proj\.weight$", "row"),
                          (r".*\.mlp\.experts\.\d+\.(up|gate)_proj\.weight$", "column"),
                          (r".*\.mlp\.gate\.weight$", "skip"),
                          (r".*\.mlp\.shared_experts\.down_proj\.weight$", "row"),
                          (r".*\.mlp\.shared_experts\.(up|gate)_proj\.weight$", "column")),
    "phi3": _specs((r".*\.self_attn\.o_proj\.weight$", "row"), (r".*\.self_attn\.qkv_proj\.weight$", "column", 3),
                   (r".*\.mlp\.down_proj\.weight$", "row"), (r".*\.mlp\.gate_up_proj\.weight$", "column", 2)),
}
assert set(PRESETS) == set(PRESET_MODELS)


class AutoTPError(ValueError):
    """A model AutoTP cannot split as asked; the message names the layer and what to change."""


def is_hf_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2), recognized without importing transformers."""
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers")


def describe_model(model: nn.Module) -> ModelDescription:
    """The facts the plan needs, read off ``model`` (which is not changed)."""
    owners = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    layers: list[LayerInfo] = []
    attentions: list[AttentionInfo] = []
    for name, module in model.named_modules():
        own = tuple(n for n, _ in module.named_parameters(recurse=False))
        weight = getattr(module, "weight", None)
        tied = isinstance(weight, nn.Parameter) and owners[id(weight)] > 1
        if isinstance(module, nn.Linear):
            layers.append(LayerInfo(name, LayerKind.LINEAR, type(module).__name__, module.in_features,
                                    module.out_features, tied, own))
        elif is_hf_conv1d(module):
            nx, nf = module.weight.shape
            layers.append(LayerInfo(name, LayerKind.CONV1D, type(module).__name__, int(nx), int(nf), tied, own))
        elif own:
            layers.append(LayerInfo(name, LayerKind.OTHER, type(module).__name__, params=own))
        found = _attention(name, module)
        if found is not None:
            attentions.append(found)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    return ModelDescription(model_type if isinstance(model_type, str) else None, tuple(layers), tuple(attentions))


def _attention(name: str, module: nn.Module) -> AttentionInfo | None:
    """Llama-style (separate q/k/v projections and ``head_dim``) or GPT-2 (fused ``c_attn``, ``num_heads``)."""
    prefix = f"{name}." if name else ""
    head_dim = getattr(module, "head_dim", None)
    if not isinstance(head_dim, int) or head_dim <= 0:
        return None
    q, k, v = (getattr(module, f"{x}_proj", None) for x in "qkv")
    if all(isinstance(m, nn.Linear) for m in (q, k, v)):
        assert isinstance(q, nn.Linear) and isinstance(k, nn.Linear)
        return AttentionInfo(name, q.out_features // head_dim, k.out_features // head_dim, head_dim,
                             tuple(f"{prefix}{x}_proj" for x in "qkv"))
    c_attn, heads = getattr(module, "c_attn", None), getattr(module, "num_heads", None)
    if c_attn is not None and is_hf_conv1d(c_attn) and isinstance(heads, int):
        return AttentionInfo(name, heads, heads, head_dim, (f"{prefix}c_attn",),
                             has_split_size=hasattr(module, "split_size"))
    return None


def parse_partition_config(config: Mapping | AutoTPPartitionConfig | None) -> AutoTPPartitionConfig | None:
    """DeepSpeed's ``partition_config`` dict, validated as the config file's would be."""
    if config is None or isinstance(config, AutoTPPartitionConfig):
        return config
    try:
        return AutoTPPartitionConfig.model_validate(dict(config))
    except ValidationError as err:
        lines = config_error(err, AutoTPPartitionConfig).problems
        raise AutoTPError("\n".join(f"partition_config.{line}" for line in lines)) from None


def rules_for(model_type: str | None, partition_config: AutoTPPartitionConfig | None,
              preset_model: str | None) -> tuple[TPLayerSpecConfig, ...]:
    """The rules in matching order: the user's specs, then (``use_default_specs``) the preset's or the
    built-in rules for ``model_type``."""
    preset: tuple[TPLayerSpecConfig, ...] = ()
    if preset_model is not None:
        key = preset_model.lower()
        if key not in PRESETS:
            raise AutoTPError(f"preset_model={preset_model!r} is not a preset; choose one of {sorted(PRESETS)} or "
                              f"give partition_config.layer_specs")
        preset = PRESETS[key]
    elif model_type is not None:
        preset = DEFAULT_RULES.get(model_type.lower(), ())
    if partition_config is None:
        if not preset:
            raise AutoTPError(f"AutoTP has no built-in rules for model_type={model_type!r} (it knows "
                              f"{sorted(DEFAULT_RULES)}); name a preset_model (one of {sorted(PRESETS)}) or give "
                              f"partition_config.layer_specs saying which layers are column- and row-parallel")
        return preset
    user = partition_config.layer_specs
    return user + preset if partition_config.use_default_specs else user


def _match(rules: tuple[TPLayerSpecConfig, ...], param: str, model_type: str | None) -> TPLayerSpecConfig | None:
    for rule in rules:
        if rule.model_types is not None and (model_type or "").lower() not in {t.lower() for t in rule.model_types}:
            continue
        if any(re.match(p, param) for p in rule.patterns):
            return rule
    return None


def _layer_plan(layer: LayerInfo, rule: TPLayerSpecConfig, tp_size: int, lm_head: bool) -> LayerPlan:
    """One matched Linear-like layer's split, or the refusal naming it."""
    what = f"layer {layer.name!r} ({layer.type_name}, in={layer.in_features}, out={layer.out_features})"
    if rule.partition_type == "skip":
        if rule.grad_allreduce:
            raise AutoTPError(f"{what}: grad_allreduce (replicated parameters whose gradients are summed over "
                              f"the group) is not built; drop grad_allreduce from its layer spec")
        return LayerPlan(Split.REPLICATE)
    split = Split(rule.partition_type)
    if layer.tied:
        raise AutoTPError(f"{what} shares its weight with another module (tied embeddings), so it cannot be "
                          f"split alone; keep it replicated (partition_type \"skip\") or untie the weights")
    if lm_head and split is Split.COLUMN and not rule.gather_output:
        raise AutoTPError(f"{what} is the LM head: a column split without gather_output gives each rank a slice "
                          f"of the vocabulary, which the model's loss does not expect; set gather_output: true "
                          f"in its layer spec or keep it replicated")
    if split is Split.ROW and rule.gather_output:
        raise AutoTPError(f"{what}: gather_output applies to column-parallel layers only; remove it")
    natural = {(LayerKind.LINEAR, Split.COLUMN): 0, (LayerKind.LINEAR, Split.ROW): 1,
               (LayerKind.CONV1D, Split.COLUMN): 1, (LayerKind.CONV1D, Split.ROW): 0}[(layer.kind, split)]
    if rule.partition_dim is not None and rule.partition_dim != natural:
        raise AutoTPError(f"{what}: partition_dim {rule.partition_dim} is not the weight dimension a {split.value} "
                          f"split of a {layer.type_name} cuts ({natural}); leave partition_dim out")
    parts = 1
    if rule.shape is not None:
        fused = rule.shape[rule.effective_partition_dim]
        if isinstance(fused, tuple) or fused < 1 or len(rule.shape) != 2 or split is Split.ROW:
            raise AutoTPError(f"{what}: shape {list(rule.shape)} is not supported; AutoTP splits equal fused "
                              f"tensors of a column-parallel layer only (shape [n, -1])")
        parts = fused
    size = layer.out_features if split is Split.COLUMN else layer.in_features
    dim_name = "output" if split is Split.COLUMN else "input"
    if size % (parts * tp_size):
        fused_note = f" ({parts} fused tensors of {size // parts})" if parts > 1 else ""
        raise AutoTPError(f"{what}: its {dim_name} size {size}{fused_note} is not divisible by the tensor-parallel "
                          f"size {tp_size}; choose a tensor-parallel size that divides it or keep the layer "
                          f"replicated (partition_type \"skip\")")
    return LayerPlan(split, parts, rule.gather_output)


def plan_autotp(desc: ModelDescription, tp_size: int, *,
                partition_config: Mapping | AutoTPPartitionConfig | None = None,
                preset_model: str | None = None) -> AutoTPPlan:
    """Decide every Linear-like layer's split and the attention modules' per-rank head counts."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise AutoTPError(f"tp_size={tp_size!r} must be an integer >= 1")
    config = parse_partition_config(partition_config)
    rules = rules_for(desc.model_type, config, preset_model)
    lm_heads = config.lm_head_patterns if config is not None else ("lm_head", "embed_out")
    layers: dict[str, LayerPlan] = {}
    for layer in desc.layers:
        if layer.kind is LayerKind.OTHER:
            for param in layer.params:
                rule = _match(rules, f"{layer.name}.{param}", desc.model_type)
                if rule is not None and rule.partition_type != "skip":
                    raise AutoTPError(
                        f"layer spec {list(rule.patterns)} ({rule.partition_type}) matches {layer.name}.{param} "
                        f"of a {layer.type_name}, which AutoTP cannot split (it splits nn.Linear and "
                        f"transformers Conv1D layers); narrow the pattern or use partition_type \"skip\"")
            continue
        rule = _match(rules, f"{layer.name}.weight", desc.model_type)
        if rule is None:
            if config is not None and config.strict_mode:
                raise AutoTPError(f"strict_mode: no layer spec matches {layer.name}.weight ({layer.type_name}); "
                                  f"add a spec for it (partition_type \"skip\" keeps it replicated)")
            layers[layer.name] = LayerPlan(Split.REPLICATE)
            continue
        tail = layer.name.rpartition(".")[2]
        is_head = any(tail == p or re.fullmatch(p, layer.name) for p in lm_heads)
        layers[layer.name] = _layer_plan(layer, rule, tp_size, is_head)
    return AutoTPPlan(tp_size, layers, _head_plans(desc, layers, tp_size))


def _head_plans(desc: ModelDescription, layers: Mapping[str, LayerPlan], tp_size: int) -> dict[str, HeadPlan]:
    heads: dict[str, HeadPlan] = {}
    for attn in desc.attentions:
        splits = {layers[p].split for p in attn.projections if p in layers}
        if splits in (set(), {Split.REPLICATE}):
            continue
        if splits != {Split.COLUMN}:
            raise AutoTPError(f"attention {attn.name!r}: its projections {list(attn.projections)} are split "
                              f"differently ({sorted(s.value for s in splits)}); split q, k and v all column-"
                              f"parallel or keep them all replicated")
        for count, what in ((attn.num_heads, "attention heads"), (attn.num_kv_heads, "key/value heads")):
            if count % tp_size:
                raise AutoTPError(f"attention {attn.name!r} has {count} {what}, not divisible by the tensor-"
                                  f"parallel size {tp_size}: each rank must hold whole heads; choose a "
                                  f"tensor-parallel size that divides {count}")
        split_size = attn.num_heads * attn.head_dim // tp_size if attn.has_split_size else None
        heads[attn.name] = HeadPlan(attn.num_heads // tp_size, attn.num_kv_heads // tp_size, split_size)
    return heads


__all__ = ["AttentionInfo", "AutoTPError", "AutoTPPlan", "DEFAULT_RULES", "HeadPlan", "is_hf_conv1d", "LayerInfo", "LayerKind",
           "LayerPlan", "ModelDescription", "PRESETS", "Split", "describe_model", "parse_partition_config",
           "plan_autotp", "rules_for"]
