"""Automatic tensor parallelism for serving: split an existing model over a tensor-parallel ``Comm``.

The attention and MLP linears are split by the training AutoTP (:func:`zerospeed.tensor_parallel.apply_autotp`,
whose pure plan refuses, naming the layer, what it cannot split: heads not divisible by the degree,
sizes that do not divide...). Serving adds three things training does not split:

- the LM head, by vocabulary rows, its logits all-gathered so ``generate`` sees full logits on every
  rank (:class:`~zerospeed.inference.tp_layers.VocabParallelHead`); when the head is tied to the input
  embedding (GPT-2), the embedding is split the same way and keeps sharing the tensor;
- fused experts (transformers' Mixtral ``gate_up_proj``/``down_proj``): each rank keeps ``E/tp`` whole
  experts, the router runs everywhere (:class:`~zerospeed.inference.tp_layers.ExpertShard`);
- DeepSpeed's ``injection_policy`` (``{BlockClass: ("attn.out_proj", "mlp.fc2")}``): in every block of
  that class the named linears are row-parallel and the other linears column-parallel; the head-count
  attributes DeepSpeed divides (``num_heads``, ``embed_dim``...) are divided on the modules that own a
  split linear, unless the plan already knows the attention module (Llama-style, GPT-2).

Which rules apply: an ``injection_policy`` if given; otherwise the built-in rules for the model's
``config.model_type`` (Llama, Mistral, Qwen2, GPT-2 from the training AutoTP, and Mixtral's attention
here); other models are refused with the fix (give an ``injection_policy``).
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from zerospeed.config.schema_tp import AutoTPPartitionConfig, TPLayerSpecConfig
from zerospeed.distributed.comm import Comm
from zerospeed.inference.tp_layers import (ExpertShard, VocabParallelHead, VocabParallelInputEmbedding,
                                           check_fused_experts, is_fused_experts)
from zerospeed.tensor_parallel.autotp import apply_autotp
from zerospeed.tensor_parallel.autotp_plan import (DEFAULT_RULES, AutoTPError, Split, describe_model, is_hf_conv1d,
                                                   plan_autotp)
from zerospeed.tensor_parallel.layers import TensorParallelLayer

InjectionPolicy = tuple[tuple[type, tuple[str, ...]], ...]

_ATTENTION_ONLY = tuple(TPLayerSpecConfig.model_validate({"patterns": [p], "partition_type": t}) for p, t in (
    (r".*\.self_attn\.o_proj\.weight$", "row"), (r".*\.self_attn\.[qkv]_proj\.weight$", "column")))
#: Serving rules by ``config.model_type`` beyond the training AutoTP's (experts are split separately).
SERVING_RULES: dict[str, tuple[TPLayerSpecConfig, ...]] = {"mixtral": _ATTENTION_ONLY}
#: The attributes DeepSpeed's AutoTP divides on a module owning split linears (``update_mp_params``).
HEAD_ATTRIBUTES = ("n_heads", "n_head", "num_heads", "num_kv", "num_attention_heads", "num_attn_heads",
                   "num_key_value_heads", "num_kv_heads", "kv_n_heads", "inner_dim", "all_head_size", "embed_dim",
                   "hidden_size", "d_model")


def known_model_types() -> list[str]:
    return sorted({*DEFAULT_RULES, *SERVING_RULES})


def split_model(model: nn.Module, comm: Comm, *, injection_policy: InjectionPolicy | None = None) -> nn.Module:
    """Split ``model`` in place over ``comm`` (its size is the degree) and return it."""
    if any(isinstance(m, (TensorParallelLayer, VocabParallelHead, ExpertShard)) for m in model.modules()):
        raise AutoTPError("the model already holds tensor-parallel layers; pass the unsplit model to init_inference")
    if any(p.is_meta for p in model.parameters()):
        raise AutoTPError("the model has parameters on the meta device; build it on the host (set_empty_params "
                          "loading is not built)")
    tp = comm.world_size
    if injection_policy is not None:
        specs, owners = _policy_specs(model, injection_policy)
    else:
        specs, owners = _builtin_specs(model), set()
    partition = AutoTPPartitionConfig(layer_specs=specs, use_default_specs=False)
    plan = plan_autotp(describe_model(model), tp, partition_config=partition)  # refusals happen here, before edits
    heads_to_divide = _divisions(model, owners - set(plan.heads), plan, tp)
    experts = _experts(model) if injection_policy is None else []
    for name, module in experts:
        check_fused_experts(module, name)
        if int(getattr(module, "gate_up_proj").shape[0]) % tp:
            raise AutoTPError(f"{name}: {int(getattr(module, 'gate_up_proj').shape[0])} experts are not divisible "
                              f"by the tensor-parallel size {tp}: each rank must hold whole experts; choose a "
                              f"tensor-parallel size that divides the expert count")
    apply_autotp(model, comm, partition_config=partition)
    for module, attr, value in heads_to_divide:
        setattr(module, attr, value)
    for name, module in experts:
        _replace(model, name, ExpertShard(module, comm, name=name))
    _split_vocabulary(model, comm)
    return model


def _builtin_specs(model: nn.Module) -> tuple[TPLayerSpecConfig, ...]:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    key = model_type.lower() if isinstance(model_type, str) else ""
    if key in SERVING_RULES:
        return SERVING_RULES[key]
    if key in DEFAULT_RULES:
        return DEFAULT_RULES[key]
    raise AutoTPError(f"tensor-parallel inference has no built-in rules for model_type={model_type!r} "
                      f"({type(model).__name__}; it knows {known_model_types()}); give "
                      f"injection_policy={{BlockClass: ('<attention output linear>', '<MLP output linear>')}} naming "
                      f"the row-parallel linears of the model's transformer block")


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_hf_conv1d(module)


def _is_instance_of(module: nn.Module, cls: type) -> bool:
    """Exactly of class ``cls`` (DeepSpeed matches the policy's class itself, not subclasses)."""
    return module.__class__ is cls


def _policy_specs(model: nn.Module, policy: InjectionPolicy) -> tuple[tuple[TPLayerSpecConfig, ...], set[str]]:
    """Exact-name rules for every linear in the policy's blocks, and the paths of modules owning them."""
    rows: dict[str, tuple[str, str]] = {}  # linear path -> (split, the block class that decided it)
    owners: set[str] = set()
    for block_cls, row_names in policy:
        blocks = [(n, m) for n, m in model.named_modules() if _is_instance_of(m, block_cls)]
        if not blocks:
            raise AutoTPError(f"injection_policy: the model has no {block_cls.__name__} module; the keys are the "
                              f"model's block classes")
        for path, block in blocks:
            linears = {n: m for n, m in block.named_modules() if n and _is_linear(m)}
            for row in row_names:
                if row not in linears:
                    raise AutoTPError(f"injection_policy: {block_cls.__name__} at {path!r} has no linear layer "
                                      f"{row!r} (its linears: {sorted(linears)}); name the row-parallel linears "
                                      f"relative to the block")
            for rel in linears:
                full = f"{path}.{rel}" if path else rel
                kind = "row" if rel in row_names else "column"
                before = rows.setdefault(full, (kind, block_cls.__name__))
                if before[0] != kind:
                    raise AutoTPError(f"injection_policy: {full!r} is {before[0]}-parallel under {before[1]} but "
                                      f"{kind}-parallel under {block_cls.__name__} (one block holds the other); "
                                      f"describe each linear once: drop one of the two entries")
                owners.add(full.rpartition(".")[0])
    specs = tuple(TPLayerSpecConfig.model_validate({"patterns": [rf"^{re.escape(name)}\.weight$"],
                                                    "partition_type": kind}) for name, (kind, _) in rows.items())
    return specs, owners


def _divisions(model: nn.Module, owners: set[str], plan: Any, tp: int) -> list[tuple[nn.Module, str, int]]:
    """DeepSpeed's ``update_mp_params`` on the modules owning split linears (checked before any edit)."""
    split = {name.rpartition(".")[0] for name, p in plan.layers.items() if p.split is not Split.REPLICATE}
    out = []
    for path in sorted(owners & split):
        module = model.get_submodule(path)
        for attr in HEAD_ATTRIBUTES:
            value = getattr(module, attr, None)
            if not isinstance(value, int) or isinstance(value, bool):
                continue
            if value % tp:
                raise AutoTPError(f"{path or type(model).__name__} ({type(module).__name__}): {attr} = {value} is "
                                  f"not divisible by the tensor-parallel size {tp}; each rank must hold whole heads: "
                                  f"choose a tensor-parallel size that divides it")
            out.append((module, attr, value // tp))
    return out


def _experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if n and is_fused_experts(m)]


def _replace(model: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, child, new)


def _output_head(model: nn.Module) -> tuple[str, nn.Linear] | None:
    """The LM head: ``get_output_embeddings()`` (Hugging Face) or a child named ``lm_head``."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear):
        return None
    return next(((n, m) for n, m in model.named_modules() if m is head), None)


def _split_vocabulary(model: nn.Module, comm: Comm) -> None:
    """Split the LM head by vocabulary rows; a tied input embedding is split alike and shares the rows."""
    found = _output_head(model)
    if found is None:
        return
    head_path, head = found
    embedding = next(((n, m) for n, m in model.named_modules()
                      if isinstance(m, nn.Embedding) and m.weight is head.weight), None)
    shared = None
    if embedding is not None:
        emb_path, emb = embedding
        new_emb = VocabParallelInputEmbedding(emb, comm)
        _replace(model, emb_path, new_emb)
        shared = new_emb.weight
    _replace(model, head_path, VocabParallelHead.from_linear(head, comm, weight=shared))


__all__ = ["HEAD_ATTRIBUTES", "SERVING_RULES", "known_model_types", "split_model"]
