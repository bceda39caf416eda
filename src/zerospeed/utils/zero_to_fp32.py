"""DeepSpeed's ``deepspeed.utils.zero_to_fp32``: full fp32 weights from a checkpoint of any world size
and ZeRO stage, over :mod:`zerospeed.checkpoint.consolidate` (which streams instead of holding every
rank's shards). ``python -m zerospeed.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR`` works as
DeepSpeed's script does."""

from __future__ import annotations

import json
import logging
import os
import sys

import torch
from torch import nn

from zerospeed.checkpoint.consolidate import (
    convert_checkpoint,
    get_fp32_state_dict,
    load_state_dict_from_checkpoint,
    parse_size,
)
from zerospeed.checkpoint.layout import CheckpointError, CheckpointMismatchError

log = logging.getLogger("zerospeed")


def _refuse_frozen(exclude_frozen_parameters: bool, caller: str) -> None:
    if exclude_frozen_parameters:
        raise NotImplementedError(f"{caller}(exclude_frozen_parameters=True): leave frozen parameters out when "
                                  f"saving instead (engine.save_checkpoint(..., exclude_frozen_parameters=True))")


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The model's fp32 ``state_dict`` on CPU. ``lazy_mode`` is accepted; the tensors are read at once
    (each still answers ``.contiguous()``, which is all DeepSpeed's lazy tensors are used for)."""
    _refuse_frozen(exclude_frozen_parameters, "get_fp32_state_dict_from_zero_checkpoint")
    return get_fp32_state_dict(checkpoint_dir, tag)


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str, tag: str | None = None) -> nn.Module:
    """Load the checkpoint's weights into ``model`` on CPU and return it. Like DeepSpeed it tolerates
    keys that do not match, but it says which ones."""
    model = model.cpu()
    try:
        return load_state_dict_from_checkpoint(model, checkpoint_dir, tag, strict=True)
    except CheckpointMismatchError as exc:
        log.warning("load_state_dict_from_zero_checkpoint: %s (loading the keys that match)", exc)
        return load_state_dict_from_checkpoint(model, checkpoint_dir, tag, strict=False)


def _bin_shards(state: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    return shards


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_dir: str, max_shard_size: str | int = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> None:
    """Write the fp32 weights under ``output_dir`` as Hugging Face does: ``model.safetensors`` (or
    shards plus ``model.safetensors.index.json``) with ``safe_serialization``, else
    ``pytorch_model.bin`` (or ``pytorch_model-0000K-of-0000N.bin`` shards plus an index)."""
    _refuse_frozen(exclude_frozen_parameters, "convert_zero_checkpoint_to_fp32_state_dict")
    if safe_serialization:
        convert_checkpoint(checkpoint_dir, output_dir, tag=tag, max_shard_size=max_shard_size)
        return
    state = get_fp32_state_dict(checkpoint_dir, tag)
    shards = _bin_shards(state, parse_size(max_shard_size))
    os.makedirs(output_dir, exist_ok=True)
    if len(shards) == 1:
        torch.save(state, os.path.join(output_dir, "pytorch_model.bin"))
        return
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        name = f"pytorch_model-{i:05d}-of-{len(shards):05d}.bin"
        torch.save(shard, os.path.join(output_dir, name))
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(output_dir, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def main(argv: list[str] | None = None) -> int:
    """DeepSpeed's script: ``zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [--max_shard_size] [--safe_serialization] [-t TAG]``."""
    import argparse

    parser = argparse.ArgumentParser(description="fp32 weights from a zerospeed checkpoint")
    parser.add_argument("checkpoint_dir")
    parser.add_argument("output_dir")
    parser.add_argument("--max_shard_size", default="5GB")
    parser.add_argument("--safe_serialization", action="store_true")
    parser.add_argument("-t", "--tag", default=None)
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    args = parser.parse_args(argv)
    try:
        convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir, args.max_shard_size,
                                                   args.safe_serialization, args.tag, args.exclude_frozen_parameters)
    except (CheckpointError, ValueError, OSError, NotImplementedError) as exc:
        print(f"zero_to_fp32: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint"]
