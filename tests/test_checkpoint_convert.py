"""Consolidation: ``zerospeed convert``, ``get_fp32_state_dict``, ``load_state_dict_from_checkpoint``,
``engine.save_16bit_model``.

A checkpoint written by 2 ranks at stage 3 (bf16 compute, so the fp32 masters differ from the model's
weights) and by 1 rank at stage 0 (fp32) must come out as a plain ``state_dict`` that loads with
``strict=True`` into the model built from code, tied, frozen parameters and persistent buffers
included, equal to the engine's own gathered values; and the conversion must stream (peak RSS).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

import zerospeed
from zerospeed.checkpoint import CheckpointError, get_fp32_state_dict, load_state_dict_from_checkpoint
from zerospeed.checkpoint.consolidate import convert_main
from zerospeed.testing import run_distributed
from zerospeed.utils import safe_get_full_fp32_param

VOCAB, WIDTH, STEPS = 13, 8, 2
TAG = f"global_step{STEPS}"


class Net(nn.Module):
    """Tied embedding / head, a frozen layer, BatchNorm running stats and a registered buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.bn = nn.BatchNorm1d(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor([1.5, 0.25]))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)  # not in state_dict: not saved

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.bn(torch.tanh(self.frozen(self.emb(idx))) * self.scale[0])
        return self.head(torch.tanh(self.fc(x)))


def _flat(t: torch.Tensor) -> tuple[str, list[int], list]:
    """A picklable exact copy (bf16 and fp32 values are exact as Python floats)."""
    t = t.detach().cpu()
    return str(t.dtype).removeprefix("torch."), list(t.shape), t.reshape(-1).tolist()


def _tensor(flat: tuple[str, list[int], list]) -> torch.Tensor:
    dtype, shape, values = flat
    return torch.tensor(values, dtype=getattr(torch, dtype)).reshape(shape)


def _train_and_save(stage: int, bf16: bool, ckpt_dir: str, weights_dir: str) -> dict:
    """Train a few steps, save a checkpoint and the 16-bit weights (both file formats); return the
    gathered fp32 masters and the compute-dtype state dict (rank 0's buffers) to compare against."""
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if bf16:
        config["bf16"] = {"enabled": True}
    engine, *_ = zerospeed.initialize(model=Net(), config=config)
    rank = engine.comm.rank
    for step in range(STEPS):
        idx = torch.randint(0, VOCAB, (4,), generator=torch.Generator().manual_seed(10 * step + rank))
        engine.backward(nn.functional.cross_entropy(engine(idx).float(), idx.roll(1)))
        engine.step()
    fp32 = {name: _flat(safe_get_full_fp32_param(p))
            for name, p in engine.module.named_parameters(remove_duplicate=False)}
    with zerospeed.zero.GatheredParameters(list(engine.module.parameters())):
        compute = {key: _flat(value) for key, value in engine.module.state_dict().items()}
    assert engine.save_checkpoint(ckpt_dir) == os.path.join(ckpt_dir, TAG)
    engine.save_16bit_model(weights_dir, "model.safetensors")
    engine.save_16bit_model(weights_dir)  # the default name: torch.save format
    return {"fp32": fp32, "compute": compute}


@pytest.fixture(scope="module", params=["stage3_2ranks_bf16", "stage0_1rank_fp32"])
def trained(request, tmp_path_factory) -> dict:
    stage, world, bf16 = {"stage3_2ranks_bf16": (3, 2, True), "stage0_1rank_fp32": (0, 1, False)}[request.param]
    root = tmp_path_factory.mktemp(request.param)
    results = run_distributed(_train_and_save, world, stage, bf16, str(root / "ckpt"), str(root / "weights"))
    for other in results[1:]:  # the gathered values are the same on every rank
        assert other["fp32"] == results[0]["fp32"]
    fp32 = {k: _tensor(v) for k, v in results[0]["fp32"].items()}
    compute = {k: _tensor(v) for k, v in results[0]["compute"].items()}
    assert set(fp32) == {n for n, _ in Net().named_parameters(remove_duplicate=False)}  # tied alias included
    buffers = {k: v for k, v in compute.items() if k not in fp32}
    assert set(buffers) == {"scale", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    assert buffers["bn.num_batches_tracked"].item() == STEPS  # the buffers were really trained
    return {"name": request.param, "ckpt": root / "ckpt", "weights": root / "weights", "out": root / "out",
            "fp32": fp32, "compute": compute, "buffers": buffers, "bf16": bf16}


def _convert(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "zerospeed", "convert", *map(str, args)],
                          capture_output=True, text=True, timeout=120)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def _expected(trained: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What a conversion to ``dtype`` must hold: the fp32 masters cast, the buffers as saved (floats cast)."""
    out = {k: v.to(dtype) for k, v in trained["fp32"].items()}
    out.update({k: v.to(dtype) if v.is_floating_point() else v for k, v in trained["buffers"].items()})
    return out


def _assert_state_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype, key
        assert got[key].shape == value.shape, key
        assert torch.equal(got[key], value), key


def _loads_strictly(state: dict[str, torch.Tensor]) -> None:
    model = Net()
    model.load_state_dict(state, strict=True)
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key].to(value.dtype)), key


def test_convert_to_one_fp32_file(trained):
    out = trained["out"] / "fp32" / "consolidated.safetensors"
    proc = _convert(trained["ckpt"], out)
    assert proc.stdout.split() == [str(out)]
    state = load_file(str(out))
    _assert_state_equal(state, _expected(trained, torch.float32))
    _loads_strictly(state)
    if trained["bf16"]:  # the masters, not the bf16 weights: they differ somewhere
        assert any(not torch.equal(trained["fp32"][k], trained["compute"][k].float()) for k in trained["fp32"])
    assert sorted(os.listdir(out.parent)) == ["consolidated.safetensors"]  # no .partial left behind


def test_convert_to_sharded_bf16_with_an_index(trained):
    out = trained["out"] / "bf16"
    _convert(trained["ckpt"], out, "--dtype", "bf16", "--max_shard_size", "300B", "--tag", TAG)
    with open(out / "model.safetensors.index.json") as f:
        index = json.load(f)
    assert set(index) == {"metadata", "weight_map"}
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3
    assert sorted(os.listdir(out)) == sorted([*files, "model.safetensors.index.json"])
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(files):05d}\.safetensors", f) for f in files)
    state: dict[str, torch.Tensor] = {}
    for file in files:
        assert os.path.getsize(out / file) < 300 + 2048  # 300 B of data (or one bigger tensor) + header
        with safe_open(str(out / file), framework="pt") as f:
            keys = set(f.keys())
            assert keys == {k for k, v in index["weight_map"].items() if v == file}
            state.update({k: f.get_tensor(k) for k in keys})
    expected = _expected(trained, torch.bfloat16)
    _assert_state_equal(state, expected)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in expected.values())
    _loads_strictly(state)


def test_convert_to_a_directory_without_sharding(trained):
    out = trained["out"] / "dir"
    out.mkdir(parents=True)
    for stale in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "notes.txt"):
        (out / stale).write_text("from an earlier conversion")
    assert convert_main([str(trained["ckpt"] / TAG), str(out)]) == 0  # the tag directory itself, in-process
    # stale shards would be mistaken for part of this model; other files are not convert's to delete
    assert sorted(os.listdir(out)) == ["model.safetensors", "model.safetensors.index.json", "notes.txt"]
    with open(out / "model.safetensors.index.json") as f:
        assert set(json.load(f)["weight_map"].values()) == {"model.safetensors"}
    _assert_state_equal(load_file(str(out / "model.safetensors")), _expected(trained, torch.float32))


def test_get_fp32_state_dict(trained):
    state = get_fp32_state_dict(str(trained["ckpt"]))
    _assert_state_equal(state, _expected(trained, torch.float32))
    assert state["head.weight"] is state["emb.weight"]  # tied: one tensor under both names
    _loads_strictly(state)
    _assert_state_equal(get_fp32_state_dict(str(trained["ckpt"]), tag=TAG), state)
    with pytest.raises(CheckpointError, match="not found"):
        get_fp32_state_dict(str(trained["ckpt"]), tag="global_step99")


def test_load_state_dict_from_checkpoint(trained):
    torch.manual_seed(123)
    model = load_state_dict_from_checkpoint(Net(), str(trained["ckpt"]))
    assert model.head.weight is model.emb.weight and not model.frozen.weight.requires_grad
    _assert_state_equal(model.state_dict(), _expected(trained, torch.float32))
    # a bf16 model gets the values cast
    model16 = load_state_dict_from_checkpoint(Net().to(torch.bfloat16), str(trained["ckpt"]))
    assert torch.equal(model16.fc.weight, trained["fp32"]["fc.weight"].to(torch.bfloat16))

    class Bigger(Net):
        def __init__(self) -> None:
            super().__init__()
            self.extra = nn.Linear(2, 2)

    with pytest.raises(CheckpointError, match=r"missing \['extra.bias', 'extra.weight'\]"):
        load_state_dict_from_checkpoint(Bigger(), str(trained["ckpt"]))
    bigger = Bigger()
    extra = bigger.extra.weight.detach().clone()
    load_state_dict_from_checkpoint(bigger, str(trained["ckpt"]), strict=False)
    assert torch.equal(bigger.extra.weight, extra) and torch.equal(bigger.fc.bias, trained["fp32"]["fc.bias"])


@pytest.mark.parametrize("filename", ["model.safetensors", "pytorch_model.bin"])
def test_save_16bit_model(trained, filename):
    path = trained["weights"] / filename
    state = load_file(str(path)) if filename.endswith(".safetensors") else torch.load(path, weights_only=True)
    compute = trained["compute"]
    _assert_state_equal(state, compute)
    dtype = torch.bfloat16 if trained["bf16"] else torch.float32
    assert all(state[k].dtype == dtype for k in trained["fp32"])
    _loads_strictly(state)
    assert not [f for f in os.listdir(trained["weights"]) if f.endswith(".partial")]


def test_convert_errors(tmp_path, trained, capsys):
    (tmp_path / "empty").mkdir()
    proc = _convert(tmp_path / "empty", tmp_path / "o", check=False)
    assert proc.returncode == 2
    assert "zerospeed convert: error:" in proc.stderr and "holds no checkpoint" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "o").exists()

    def run(*argv: str) -> tuple[int, str]:
        try:
            code = convert_main([str(a) for a in argv])
        except SystemExit as exc:  # argparse
            code = exc.code
        return code, capsys.readouterr().err

    ckpt = trained["ckpt"]
    assert run(tmp_path / "missing", tmp_path / "o")[0] == 2
    code, err = run(ckpt, tmp_path / "o", "--dtype", "int8")
    assert code == 2 and "invalid choice: 'int8'" in err
    code, err = run(ckpt, tmp_path / "o", "--max_shard_size", "5XB")
    assert code == 2 and "'5XB' is not understood" in err
    code, err = run(ckpt, tmp_path / "o", "--max_shard_size", "0")
    assert code == 2 and "must be positive" in err
    code, err = run(ckpt, tmp_path / "o", "--tag", "nope")
    assert code == 2 and "checkpoint tag 'nope' not found" in err and TAG in err
    code, err = run(ckpt, tmp_path / "one.safetensors", "--max_shard_size", "100B")
    assert code == 2 and "give a directory as OUTPUT" in err
    assert not (tmp_path / "o").exists() and not (tmp_path / "one.safetensors").exists()
    # a damaged checkpoint (a rank file cut short) is refused, not converted into wrong weights
    damaged = tmp_path / "damaged"
    subprocess.run(["cp", "-r", str(ckpt), str(damaged)], check=True)
    rank_file = damaged / TAG / "rank00000.safetensors"
    os.truncate(rank_file, os.path.getsize(rank_file) - 4)
    code, err = run(damaged, tmp_path / "o")
    assert code == 2 and "rank00000.safetensors" in err and "damaged" in err
    assert not (tmp_path / "o").exists()


# -- peak memory on a 1 GB checkpoint --------------------------------------------------------------
BIG_LAYERS, BIG_WIDTH = 15, 4096  # 15 x 4096 x 4096 fp32 = 252M parameters, 1.007 GB


class Big(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(BIG_WIDTH, BIG_WIDTH, bias=False) for _ in range(BIG_LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _crc(tensor: torch.Tensor) -> int:
    """A fingerprint of the exact bytes (crc32 runs at memory speed; sha256 would take seconds per GB)."""
    return zlib.crc32(memoryview(tensor.detach().contiguous().view(torch.uint8).numpy()))


def _save_big(ckpt_dir: str) -> dict[str, int]:
    """One SGD step (no optimizer state) at stage 0, save; the crc32 of every gathered fp32 parameter."""
    with torch.device("meta"):
        model = Big()
    model = model.to_empty(device="cpu")  # no kaiming init of 252M values: a scaled random base is enough
    base = torch.randn(BIG_WIDTH, BIG_WIDTH, generator=torch.Generator().manual_seed(0)) * BIG_WIDTH ** -0.5
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            torch.mul(base, 1.0 + i / 16, out=p)
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
              "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "zero_allow_untested_optimizer": True}
    engine, *_ = zerospeed.initialize(model=model, config=config)
    engine.backward(engine(torch.full((1, BIG_WIDTH), 1e-3)).sum())
    engine.step()
    engine.save_checkpoint(ckpt_dir)
    return {name: _crc(safe_get_full_fp32_param(p)) for name, p in engine.module.named_parameters()}


_PEAK_RSS = """
import resource, subprocess, sys
code = subprocess.call(sys.argv[1:])
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)  # KiB on Linux: the largest child's peak
sys.exit(code)
"""


@pytest.mark.slow
def test_convert_of_a_1gb_checkpoint_stays_under_400mb_rss(tmp_path):
    try:
        _convert_1gb(tmp_path)
    finally:  # 2 GB: do not leave it for pytest's rotation of temporary directories
        shutil.rmtree(tmp_path / "ckpt", ignore_errors=True)
        shutil.rmtree(tmp_path / "out", ignore_errors=True)


def _convert_1gb(tmp_path: Path) -> None:
    crcs = run_distributed(_save_big, 1, str(tmp_path / "ckpt"), timeout=300)[0]
    rank_file = tmp_path / "ckpt" / "global_step1" / "rank00000.safetensors"
    assert os.path.getsize(rank_file) > 10**9  # the checkpoint really is ~1 GB
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", _PEAK_RSS, sys.executable, "-m", "zerospeed", "convert",
                           str(tmp_path / "ckpt"), str(out), "--max_shard_size", "400MB"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    peak_mb = int(proc.stdout.split()[-1]) / 1024
    print(f"zerospeed convert of a {os.path.getsize(rank_file) / 1e9:.2f} GB checkpoint: peak RSS {peak_mb:.0f} MB")
    assert peak_mb < 400, f"peak RSS {peak_mb:.0f} MB"
    with open(out / "model.safetensors.index.json") as f:
        weight_map = json.load(f)["weight_map"]
    assert set(weight_map) == set(crcs) and len(set(weight_map.values())) == 3
    assert len(set(crcs.values())) == len(crcs)  # distinct parameters: a mix-up of names would show
    for name, crc in crcs.items():  # every value equal: the same bytes as the gathered fp32 parameter
        with safe_open(str(out / weight_map[name]), framework="pt") as f:
            tensor = f.get_tensor(name)
        assert tensor.dtype == torch.float32 and tensor.shape == (BIG_WIDTH, BIG_WIDTH)
        assert _crc(tensor) == crc, name
        del tensor
