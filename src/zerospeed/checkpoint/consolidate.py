"""A checkpoint as a plain ``state_dict``, without an engine and without holding it all in memory.

``convert_checkpoint`` (the ``zerospeed convert`` command) streams every tensor from the ranks'
fragments into (sharded) safetensors files a chunk at a time, so its peak memory is a few chunks
whatever the model size; ``get_fp32_state_dict`` returns the whole dict for the cases that want
it; ``load_state_dict_from_checkpoint`` reads straight into a model's own tensors. Every tensor is
checked against the checkpoint's CRC-32s as it is read (:class:`CheckpointSet`), so a damaged
checkpoint is refused, naming the file, the tensor and the tag to use instead, never exported.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zerospeed.checkpoint.layout import (BUFFER, MASTER, CheckpointError, CheckpointMismatchError, fsync_dir, resolve,
                                         why_no_checkpoint)
from zerospeed.checkpoint.reader import CheckpointSet
from zerospeed.checkpoint.safetensors_io import StreamingWriter
from zerospeed.checkpoint.topology import checkpoint_topology
from zerospeed.tensor_parallel.layout import TPLayout, tp_layout

if TYPE_CHECKING:
    from zerospeed.checkpoint.contract import CheckpointedEngine

CHUNK_BYTES = 16 * 1024 * 1024
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
INDEX_NAME = "model.safetensors.index.json"
_OWN_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")  # names convert writes into a directory


def _open(checkpoint_dir: str, tag: str | None, layout: TPLayout | None = None) -> CheckpointSet:
    """The checkpoint as a model of ``layout`` reads it (default: unsplit, so tensor-parallel parts
    come back joined along their split dimension)."""
    resolved, path = resolve(os.fspath(checkpoint_dir), tag)
    if path is None:
        raise CheckpointError(f"nothing to read: {why_no_checkpoint(os.fspath(checkpoint_dir))}")
    return CheckpointSet(path, layout)


def _entries(ckpt: CheckpointSet) -> list[tuple[str, str, str]]:
    """``(state_dict key, kind, stored name)`` in the saved order; tied parameters under every name."""
    aliases: dict[str, list[str]] = {}
    for alias, canonical in ckpt.manifest.get("aliases", {}).items():
        aliases.setdefault(canonical, []).append(alias)
    out = []
    for param in ckpt.manifest["params"]:
        for key in [param["name"], *aliases.get(param["name"], [])]:
            out.append((key, MASTER, param["name"]))
    out += [(buf["name"], BUFFER, buf["name"]) for buf in ckpt.manifest.get("buffers", [])]
    return out


def _shape(ckpt: CheckpointSet, kind: str, name: str) -> tuple[int, ...]:
    if kind == MASTER:
        return tuple(ckpt.params[name]["shape"])
    return next(tuple(buf["shape"]) for buf in ckpt.manifest["buffers"] if buf["name"] == name)


def get_fp32_state_dict(checkpoint_dir: str, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The model's full-precision ``state_dict`` from a checkpoint of any world size and stage
    (DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``): parameters are the fp32 masters,
    floating buffers are cast to fp32, others kept. Tied parameters share one tensor."""
    with _open(checkpoint_dir, tag) as ckpt:
        out: dict[str, torch.Tensor] = {}
        loaded: dict[tuple[str, str], torch.Tensor] = {}
        for key, kind, name in _entries(ckpt):
            if (kind, name) not in loaded:
                stored = ckpt.stored_dtype(kind, name)  # floating buffers as fp32 too, as convert writes them
                dtype = torch.float32 if kind == MASTER or stored.is_floating_point else stored
                tensor = torch.empty(_shape(ckpt, kind, name), dtype=dtype)
                ckpt.read_range(kind, name, 0, tensor.numel(), tensor)
                loaded[(kind, name)] = tensor
            out[key] = loaded[(kind, name)]
        return out


def load_state_dict_from_checkpoint(model: nn.Module, checkpoint_dir: str, tag: str | None = None,
                                    strict: bool = True) -> nn.Module:
    """Read a checkpoint's weights straight into ``model``'s tensors (cast to their dtypes), one
    tensor at a time; returns ``model``. ``strict`` refuses missing or unexpected keys. A
    tensor-parallel ``model`` reads its own slices, from a checkpoint of any tensor-parallel degree."""
    with _open(checkpoint_dir, tag, tp_layout(model)) as ckpt:
        ckpt.check_layout()
        stored = {key: (kind, name) for key, kind, name in _entries(ckpt)}
        targets = dict(model.state_dict(keep_vars=True))
        missing = sorted(set(targets) - set(stored))
        unexpected = sorted(set(stored) - set(targets))
        if strict and (missing or unexpected):
            raise CheckpointMismatchError(f"{ckpt.path} does not match the model: missing {missing[:8] or 'none'}, "
                                  f"unexpected {unexpected[:8] or 'none'}; pass strict=False to load what matches")
        with torch.no_grad():
            for key, tensor in targets.items():
                if key not in stored:
                    continue
                kind, name = stored[key]
                if tuple(tensor.shape) != _shape(ckpt, kind, name):
                    raise CheckpointError(f"{key}: checkpoint shape {_shape(ckpt, kind, name)}, model "
                                          f"{tuple(tensor.shape)}")
                ckpt.read_range(kind, name, 0, tensor.numel(), tensor.data)
    return model


def parse_size(text: str | int) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"`` or a number of bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(f"size {text!r} is not understood; write e.g. 5GB, 500MB or 1073741824")
    unit = match.group(2).upper().rstrip("B")
    scale = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    return int(float(match.group(1)) * scale)


def convert_checkpoint(checkpoint_dir: str, output: str, *, tag: str | None = None, dtype: str = "fp32",
                       max_shard_size: str | int = "5GB", chunk_bytes: int = CHUNK_BYTES) -> list[str]:
    """Write the checkpoint's model as safetensors: one file when ``output`` ends in ``.safetensors``,
    else a directory with ``model.safetensors`` or ``model-0000K-of-0000N.safetensors`` shards and
    ``model.safetensors.index.json``. Streams chunk by chunk; returns the files written."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    out_dtype = DTYPES[dtype]
    limit = parse_size(max_shard_size)
    if limit <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size!r}")
    with _open(checkpoint_dir, tag) as ckpt:
        tensors = []
        for key, kind, name in _entries(ckpt):
            stored = ckpt.stored_dtype(kind, name)
            target = out_dtype if stored.is_floating_point else stored
            tensors.append((key, kind, name, target, _shape(ckpt, kind, name)))
        shards = _pack(tensors, limit)
        single = output.endswith(".safetensors")
        if single and len(shards) > 1:
            raise CheckpointError(f"the model needs {len(shards)} files of at most {max_shard_size}; give a "
                                  f"directory as OUTPUT (or a larger --max_shard_size) instead of {output!r}")
        folder = os.path.dirname(os.path.abspath(output)) if single else os.path.abspath(output)
        os.makedirs(folder, exist_ok=True)
        names = [os.path.basename(output)] if single else (
            ["model.safetensors"] if len(shards) == 1 else
            [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
        written = []
        try:
            for name, shard in zip(names, shards):
                path = os.path.join(folder, name)
                written.append(path)
                _write_shard(ckpt, path + ".partial", shard, chunk_bytes)
            if not single:
                index = {"metadata": {"total_size": sum(_nbytes(t) for s in shards for t in s), "format": "pt"},
                         "weight_map": {t[0]: name for name, shard in zip(names, shards) for t in shard}}
                with open(os.path.join(folder, INDEX_NAME + ".partial"), "w") as f:
                    json.dump(index, f, indent=1)
                written.append(os.path.join(folder, INDEX_NAME))
        except BaseException:
            for path in written:
                if os.path.exists(path + ".partial"):
                    os.remove(path + ".partial")
            raise
        for path in written:
            os.replace(path + ".partial", path)
        if not single:  # shards of an earlier conversion into this directory would look like part of this one
            for name in os.listdir(folder):
                if _OWN_FILE.fullmatch(name) and os.path.join(folder, name) not in written:
                    os.remove(os.path.join(folder, name))
        fsync_dir(folder)
        return written


def _nbytes(entry: tuple) -> int:
    _, _, _, dtype, shape = entry
    return math.prod(shape) * torch.empty(0, dtype=dtype).element_size()


def _pack(tensors: list[tuple], limit: int) -> list[list[tuple]]:
    """Consecutive tensors into files of at most ``limit`` bytes (a bigger tensor gets its own)."""
    shards: list[list[tuple]] = [[]]
    size = 0
    for entry in tensors:
        nbytes = _nbytes(entry)
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def _write_shard(ckpt: CheckpointSet, path: str, shard: list[tuple], chunk_bytes: int) -> None:
    """Stream ``shard``'s tensors into ``path`` chunk by chunk. The chunks of a stored tensor are read
    in order, so its CRC-32 runs along and the chunk that completes it raises on a mismatch (each byte
    is read once); written chunks stay in ``path``, which the caller removes on any error."""
    with StreamingWriter(path, [(key, dtype, shape) for key, _, _, dtype, shape in shard],
                         {"format": "pt"}) as writer, ckpt.reading_in_order():
        for key, kind, name, dtype, shape in shard:
            numel = _nbytes((key, kind, name, dtype, shape)) // torch.empty(0, dtype=dtype).element_size()
            step = max(chunk_bytes // torch.empty(0, dtype=dtype).element_size(), 1)
            buffer = torch.empty(min(step, max(numel, 1)), dtype=dtype)
            for lo in range(0, numel, step):
                part = buffer[: min(step, numel - lo)]
                ckpt.read_range(kind, name, lo, lo + part.numel(), part)
                writer.write(part)


# -- 16-bit weights from a live engine -----------------------------------------------------------
def consolidated_16bit_state_dict(engine: CheckpointedEngine,
                                  exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor] | None:
    """The model's whole state dict on CPU, in the compute dtype, on rank 0 (None on the other ranks).
    Every rank must call it: ZeRO-3 shards are gathered, tensor-parallel slices joined along their
    split dimension. Tied parameters stay one tensor under each key."""
    topo = checkpoint_topology(engine)
    if topo.pipeline_degree > 1:  # rank 0 holds only its stage's layers (the same on every rank: no hang)
        raise CheckpointError(f"save_16bit_model with pipeline parallelism (pp={topo.pipeline_degree}) is not "
                              f"supported yet; save_checkpoint(dir) and convert it with `zerospeed convert dir "
                              f"out.safetensors` (or zerospeed.checkpoint.get_fp32_state_dict(dir))")
    rank0 = topo.comm.rank == 0
    module = engine.module
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    weights = {}
    for name, value in engine.state.full_param_values():
        split = topo.layout.splits.get(name)
        if split is not None:  # every rank takes part, in the same order of names
            parts = [torch.empty_like(value) for _ in range(split.degree)]
            engine.mesh.comm("tp").all_gather(parts, value.detach().contiguous())
            value = torch.cat(parts, dim=split.dim)
        if rank0 and (name in trainable or not exclude_frozen_parameters):
            weights[name] = value.detach().to("cpu", copy=True)
    if not rank0:
        return None
    canonical = {id(p): n for n, p in module.named_parameters()}
    state: dict[str, torch.Tensor] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, nn.Parameter):
            owner = canonical.get(id(value))
            if owner is not None and owner in weights:
                state[key] = weights[owner]
        else:
            state[key] = value.detach().to("cpu", copy=True)
    return state


def save_16bit_model(engine: CheckpointedEngine, save_dir: str, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> bool:
    """See :meth:`zerospeed.engine.Engine.save_16bit_model`."""
    state = consolidated_16bit_state_dict(engine, exclude_frozen_parameters)
    if state is not None:
        os.makedirs(save_dir, exist_ok=True)
        path = os.path.join(save_dir, save_filename)
        tmp = path + ".partial"
        if save_filename.endswith(".safetensors"):
            with StreamingWriter(tmp, [(k, v.dtype, tuple(v.shape)) for k, v in state.items()],
                                 {"format": "pt"}) as writer:
                for value in state.values():
                    writer.write(value)
        else:
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    checkpoint_topology(engine).comm.barrier()  # every rank returns once the file is there
    return True


def convert_main(argv: list[str]) -> int:
    """``zerospeed convert CHECKPOINT_DIR OUTPUT [--tag T] [--dtype fp32|bf16|fp16] [--max_shard_size 5GB]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="zerospeed convert", description=(
        "Write a zerospeed checkpoint (any world size, any ZeRO stage) as a plain state_dict in safetensors, "
        "streaming tensor by tensor."))
    parser.add_argument("checkpoint_dir", help="the directory given to save_checkpoint, or one tag inside it")
    parser.add_argument("output", help="a directory (sharded files + index), or a file ending in .safetensors")
    parser.add_argument("--tag", default=None, help="which checkpoint (default: the one 'latest' names)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                        help="dtype of the floating-point tensors written (default: fp32, the master weights "
                             "unrounded; integer buffers keep their dtype)")
    parser.add_argument("--max_shard_size", default="5GB",
                        help="largest output file, e.g. 5GB or 500MB (default: 5GB)")
    args = parser.parse_args(argv)
    try:
        if args.tag is None and resolve(args.checkpoint_dir, None)[1] is None:  # say what is there, in --tag terms
            raise CheckpointError(f"nothing to convert: {why_no_checkpoint(args.checkpoint_dir, pick='--tag {}')}")
        files = convert_checkpoint(args.checkpoint_dir, args.output, tag=args.tag, dtype=args.dtype,
                                   max_shard_size=args.max_shard_size)
    except (CheckpointError, ValueError, OSError) as exc:
        print(f"zerospeed convert: error: {exc}", file=sys.stderr)
        return 2
    for path in files:
        print(path)
    return 0


__all__ = ["convert_checkpoint", "get_fp32_state_dict", "load_state_dict_from_checkpoint", "parse_size",
           "save_16bit_model"]
