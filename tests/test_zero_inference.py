"""ZeRO-Inference: generation with the weights streamed from CPU memory or NVMe (stage 3, no optimizer).

Against plain Hugging Face ``generate()`` on the same seeded model: the greedy tokens are exactly equal
(fp32 and bf16, KV cache on, CPU and NVMe parameter tiers, through ``zero_inference`` and through
``zerospeed.initialize`` as DeepSpeed users call it). Also: no master, gradient or optimizer state
exists; after the first two forwards every unit is fetched ahead in the recorded order (the next
forward's first units during the current one's last), never more than a few units are gathered, each
unit is read from NVMe exactly once per forward, nothing stays gathered after ``generate``, and the
swap files are gone after ``close()``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from zerospeed.testing import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "zero_inference"))

from seeded_llama import Shape, build  # noqa: E402

SHAPE = Shape(hidden=64, layers=4, intermediate=128, heads=4, vocab=128, context=64)
NEW_TOKENS = 8
PROMPT = [[5, 17, 99, 3, 42, 64]]


def _reference(dtype: torch.dtype) -> list[list[int]]:
    model = build(SHAPE, dtype, seed=7)
    with torch.no_grad():
        return model.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, do_sample=False).tolist()


def _zero(device: str, root: str) -> dict[str, Any]:
    offload: dict[str, Any] = {"device": device}
    if device == "nvme":
        offload |= {"nvme_path": root, "max_in_cpu": 0, "buffer_count": 3}
    # a look-ahead of about one layer (the default, 5e7 elements, would hold this tiny model whole)
    return {"stage": 3, "offload_param": offload, "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 50_000}


def _cases(root: str) -> dict[str, Any]:
    """Every sub-case in one rank process (each returns plain values for the asserts)."""
    from zerospeed.inference.zero_inference import zero_inference

    out: dict[str, Any] = {}
    for device in ("cpu", "nvme"):
        for dtype in (torch.float32, torch.bfloat16):
            name = f"{device}-{str(dtype).split('.')[-1]}"
            per_forward: list[float] = []
            z = zero_inference(build(SHAPE, dtype, seed=7), _zero(device, f"{root}/{name}"))
            z.module.register_forward_hook(lambda *a: per_forward.append(z.io_stats()["bytes_read"]))
            state = z.engine.state
            tokens = z.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
            with torch.inference_mode():
                again = z.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
            stats = z.prefetch_stats
            swapped = state.param_swap
            memory = z.memory_breakdown()
            out[name] = {
                "tokens": tokens, "again": again, "forwards": stats.forwards, "on_demand": stats.on_demand,
                "wasted": stats.prefetch_wasted, "last_forward": stats.last_forward,
                "first_forward_units": len(z.engine.state.specs),
                "peak_live": stats.peak_live_elems, "largest_unit": max(u.numel for u in state.units),
                "gathered_after": sum(u.gathered for u in state.units if not u.persistent),
                "masters_are_shards": all(m is u.shard for m, u in zip(state.zero_optimizer.masters, state.units)),
                "grad_shard_elems": sum(g.shard.numel() for g in state.grads.units),
                "memory": memory, "model_bytes": sum(u.numel * u.full.element_size() for u in state.units),
                "per_forward_read": [b - a for a, b in zip(per_forward, per_forward[1:])],
                "swapped_bytes": sum(swapped.nbytes) if swapped is not None else 0,
            }
            run_dir = Path(f"{root}/{name}")
            z.close()
            out[name]["files_left"] = sorted(str(p) for p in run_dir.rglob("*")) if run_dir.exists() else []
    return out


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("zero_inference")
    for name in ("cpu-float32", "cpu-bfloat16", "nvme-float32", "nvme-bfloat16"):
        (root / name).mkdir()
    return run_distributed(_cases, 1, str(root), timeout=240)[0]


@pytest.mark.spawns
@pytest.mark.parametrize("name", ["cpu-float32", "cpu-bfloat16", "nvme-float32", "nvme-bfloat16"])
def test_greedy_tokens_equal_plain_hugging_face(cases: dict[str, Any], name: str) -> None:
    want = _reference(torch.float32 if name.endswith("float32") else torch.bfloat16)
    assert cases[name]["tokens"] == want
    assert cases[name]["again"] == want  # a second generate, under torch.inference_mode()


@pytest.mark.spawns
@pytest.mark.parametrize("name", ["cpu-float32", "nvme-bfloat16"])
def test_prefetch_follows_the_decode_order(cases: dict[str, Any], name: str) -> None:
    case = cases[name]
    assert case["forwards"] == 2 * NEW_TOKENS  # prefill + decode steps, twice
    # the first forward records (every unit on demand, the norm's reuse of the embedding unit too),
    # the second needs its first unit before any prefetch exists, and so does the second generate's
    # first forward (the first generate released what it had fetched ahead); nothing else is waited
    # for that was not already on its way
    assert case["on_demand"] == case["first_forward_units"] + 1 + 1 + 1
    units = [u for u, _ in case["last_forward"]]
    assert units == [0, 1, 2, 3, 4, 0, 5]  # embedding, 4 layers, the final norm (embedding's unit), head
    assert [ahead for u, ahead in case["last_forward"]] == [True] * 5 + [False, True]  # 0 was still held
    # what was fetched ahead for a next forward that never came (the end of each generate) is all
    # that was wasted: at most the two units that fit the cycle's look-ahead per generate
    assert 0 < case["wasted"] <= 2 * 2


@pytest.mark.spawns
@pytest.mark.parametrize("name", ["cpu-float32", "nvme-float32", "nvme-bfloat16"])
def test_memory_is_a_few_units_and_no_training_state(cases: dict[str, Any], name: str) -> None:
    case = cases[name]
    assert case["peak_live"] <= 3 * case["largest_unit"]  # the unit in use and those in flight
    assert case["peak_live"] < case["model_bytes"]
    assert case["gathered_after"] == 0  # generate() returns with nothing gathered
    assert case["masters_are_shards"] and case["grad_shard_elems"] == 0
    memory = case["memory"]
    assert memory["grads"] == 0 and memory["optimizer_states"] == 0
    if name.startswith("nvme"):
        assert memory["params"] == 0  # every shard is in its file (max_in_cpu 0, nothing persistent)
        assert memory["on_nvme"] == case["swapped_bytes"] == case["model_bytes"]
    else:
        assert memory["params"] == case["model_bytes"] == memory["offloaded"]
    assert case["files_left"] == []


@pytest.mark.spawns
def test_each_unit_is_read_once_per_forward(cases: dict[str, Any]) -> None:
    case = cases["nvme-float32"]
    # steady state (third forward on, within one generate): one forward's reads are the whole model
    steady = case["per_forward_read"][2: NEW_TOKENS - 1]
    assert steady and all(b == case["swapped_bytes"] for b in steady), (steady, case["swapped_bytes"])


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


def _plain(seed: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), *[_Block(32) for _ in range(5)], nn.Linear(32, 4))


def _plain_module_and_initialize(root: str) -> dict[str, Any]:
    """A plain module through zero_inference (repeated forwards), and a Hugging Face model through
    zerospeed.initialize with DeepSpeed's ZeRO-Inference config (as DeepSpeed users write it)."""
    import zerospeed
    from zerospeed.inference.zero_inference import zero_inference

    xs = [torch.randn(3, 16, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    reference = _plain().eval()
    with torch.no_grad():
        want = [reference(x) for x in xs]
    z = zero_inference(_plain(), _zero("nvme", f"{root}/plain"))
    got, on_demand = [], []
    with torch.inference_mode():
        for x in xs:
            got.append(z(x))
            on_demand.append(z.prefetch_stats.on_demand)
    plain = {"equal": all(torch.equal(a, b) for a, b in zip(got, want, strict=True)),
             # the first forward records, the second waits for its first unit, then nothing is waited for
             "on_demand_after_two": on_demand[-1] - on_demand[0] - 1,
             "wasted": z.prefetch_stats.prefetch_wasted}
    z.close()

    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": f"{root}/ds", "max_in_cpu": 0}}}
    engine, optimizer, *_ = zerospeed.initialize(model=build(SHAPE, torch.float32, seed=7), config=config)
    engine.module.eval()
    tokens = engine.module.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
    memory = engine.memory_breakdown()
    # a backward still works without an optimizer (its gradient shards are made on demand)
    engine.module.train()
    loss = engine(torch.tensor(PROMPT), labels=torch.tensor(PROMPT)).loss
    engine.backward(loss)
    grads_after_backward = engine.memory_breakdown()["grads"]
    with pytest.raises(RuntimeError, match="needs an optimizer"):
        engine.step()
    engine.destroy()
    return {"plain": plain, "tokens": tokens, "optimizer": optimizer, "memory": memory,
            "grads_after_backward": grads_after_backward}


@pytest.mark.spawns
def test_plain_module_and_deepspeed_style_initialize(tmp_path: Path) -> None:
    for name in ("plain", "ds"):
        (tmp_path / name).mkdir()
    out = run_distributed(_plain_module_and_initialize, 1, str(tmp_path), timeout=180)[0]
    assert out["plain"]["equal"]
    assert out["plain"]["on_demand_after_two"] == 0 and out["plain"]["wasted"] == 0
    assert out["tokens"] == _reference(torch.float32)
    assert out["optimizer"] is None
    assert out["memory"]["grads"] == 0 and out["memory"]["optimizer_states"] == 0
    assert out["grads_after_backward"] > 0
    assert not any(tmp_path.rglob("*.bin"))


def test_zero_inference_refuses_what_it_cannot_do() -> None:
    from zerospeed.config import ConfigError
    from zerospeed.inference.zero_inference import zero_inference

    with pytest.raises(ConfigError, match=r"zero.stage=2: ZeRO-Inference streams parameters, which is ZeRO stage 3"):
        zero_inference(_plain(), {"stage": 2})
    with pytest.raises(TypeError, match=r"zero_inference\(zero=.*expected DeepSpeed's zero_optimization section"):
        zero_inference(_plain(), "nvme")  # type: ignore[arg-type]
    mixed = _plain()
    mixed[0].to(torch.bfloat16)
    with pytest.raises(ValueError, match="mix dtypes"):
        zero_inference(mixed, {"stage": 3})


def _two_ranks(root: str) -> dict[str, Any]:
    """Each rank holds half of every unit (on NVMe, a directory per rank) and generates the same prompt."""
    from zerospeed.inference.zero_inference import zero_inference

    with zero_inference(build(SHAPE, torch.float32, seed=7), _zero("nvme", root)) as z:
        tokens = z.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
        shard_bytes = z.memory_breakdown()["on_nvme"]
        model_bytes = sum(u.numel * u.full.element_size() for u in z.engine.state.units)
    return {"tokens": tokens, "shard_bytes": shard_bytes, "model_bytes": model_bytes}


@pytest.mark.spawns
def test_two_ranks_each_keep_half_and_generate_the_same_tokens(tmp_path: Path) -> None:
    ranks = run_distributed(_two_ranks, 2, str(tmp_path), timeout=240)
    want = _reference(torch.float32)
    for out in ranks:
        assert out["tokens"] == want
        assert out["shard_bytes"] * 2 == out["model_bytes"]  # units padded to an even split: exactly half
    assert not any(tmp_path.rglob("*.bin"))


def _built_on_nvme_with_little_room(root: str) -> dict[str, Any]:
    """The example's path at a tiny size: materialised module by module, partitioned onto NVMe by
    zero.Init, then moved into the engine's files on a disk that cannot hold both copies at once."""
    import shutil
    from collections import namedtuple

    import zerospeed
    from zerospeed.inference.zero_inference import zero_inference
    from zerospeed.zero.owner import init_partition

    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": _zero("nvme", root)}
    init = zerospeed.zero.Init(config=config)
    model = build(SHAPE, torch.float32, seed=7, partition=init.partition)
    on_disk = sum(init_partition(p).file_bytes() for p in model.parameters())
    unit = SHAPE.layer_params() * 4  # a layer's unit, the largest
    usage = namedtuple("usage", "total used free")
    real = shutil.disk_usage
    # beyond what the swap files hold, the disk has room for two units: not for a second copy of the model
    shutil.disk_usage = lambda path: usage(10 * on_disk, 9 * on_disk, 2 * unit)  # type: ignore[assignment]
    try:
        with zero_inference(model, config["zero_optimization"]) as z:
            tokens = z.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
    finally:
        shutil.disk_usage = real  # type: ignore[assignment]
    return {"on_disk": on_disk, "model_bytes": SHAPE.num_params() * 4, "tokens": tokens}


@pytest.mark.spawns
def test_a_model_partitioned_onto_nvme_moves_into_the_engine_with_room_for_one_copy(tmp_path: Path) -> None:
    out = run_distributed(_built_on_nvme_with_little_room, 1, str(tmp_path), timeout=180)[0]
    assert out["on_disk"] == out["model_bytes"]  # zero.Init put every parameter in a swap file
    assert out["tokens"] == _reference(torch.float32)
    assert not any(tmp_path.rglob("*.bin"))
