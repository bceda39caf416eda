"""Loading a checkpoint runs no code from it (issue 13): the engine's own pickled state loads with
``torch.load(weights_only=True)``; a file carrying anything else (here a payload that would create a
file when unpickled) is refused by name, before anything of the engine changes, unless the caller opts
in with ``allow_unsafe_pickle=True``; a ``client_state`` of plain types loads without the opt-in."""

from __future__ import annotations

import json
import logging
import os
import random
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.checkpoint import layout
from zerospeed.checkpoint.layout import CheckpointError
from zerospeed.checkpoint.small_state import load_small_state, set_rng_state
from zerospeed.testing import log_messages, run_distributed

PLAIN = {"epoch": 3, "name": "run-a", "ratio": 0.25, "flags": [True, None], "pair": (1, 2),
         "nested": {"ids": [1, 2, 3]}, "tensor": torch.arange(4.0)}


class FileCreator:
    """Unpickles by calling ``open(path, "w")``: what a malicious checkpoint could do, made visible."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return open, (self.path, "w")


class Custom:
    """A user object in client_state: not a plain type, so loading it needs the opt-in."""

    def __init__(self, value: int) -> None:
        self.value = value


def _cfg() -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
            "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}}


def _engine(seed: int) -> Any:
    torch.manual_seed(seed)
    engine, *_ = zerospeed.initialize(model=nn.Linear(4, 3), config=_cfg())
    return engine


def _train(engine: Any, steps: int) -> None:
    for i in range(steps):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(i))
        engine.backward(engine(x).pow(2).mean())
        engine.step()


def _params(engine: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def _poisoned(root: str, which: str) -> dict[str, Any]:
    """Save, replace one pickled file with a payload, and try to load it into a fresh engine."""
    saver = _engine(0)
    _train(saver, 2)
    path = saver.save_checkpoint(root, client_state=PLAIN)
    marker = os.path.join(root, "payload-ran")
    target = os.path.join(path, layout.ENGINE_STATE if which == "engine" else layout.rank_state(0))
    original = torch.load(target, weights_only=True)
    key = "client_state" if which == "engine" else "loader"
    torch.save({**original, key: FileCreator(marker)}, target)
    manifest_path = os.path.join(path, layout.MANIFEST)  # a forged checkpoint is consistent
    with open(manifest_path) as f:
        manifest = json.load(f)
    with open(target, "rb") as f:
        data = f.read()
    manifest["files"][os.path.basename(target)].update(bytes=len(data), crc32=zlib.crc32(data))
    with open(manifest_path, "wb") as f:  # checksums and all, as a forger would
        f.write(layout.encode_manifest(manifest))
    loader = _engine(1)
    before = _params(loader)
    counters = [loader.global_steps, loader.micro_steps, loader.get_lr()]
    out: dict[str, Any] = {}
    try:
        loader.load_checkpoint(root)
    except CheckpointError as err:
        out["error"] = str(err)
    out["payload_ran"] = os.path.exists(marker)
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, _params(loader), strict=True))
    out["counters_unchanged"] = counters == [loader.global_steps, loader.micro_steps, loader.get_lr()]
    return out


@pytest.mark.parametrize("which", ["engine", "rank"])
def test_a_payload_in_a_pickled_file_is_refused_and_never_runs(tmp_path: Path, which: str) -> None:
    out = run_distributed(_poisoned, 1, str(tmp_path), which)[0]
    assert "error" in out, "the poisoned checkpoint loaded"
    name = layout.ENGINE_STATE if which == "engine" else layout.rank_state(0)
    assert name in out["error"] and "allow_unsafe_pickle=True" in out["error"]
    assert "open" in out["error"]  # what the file wanted to call
    assert not out["payload_ran"]
    assert out["unchanged"] and out["counters_unchanged"]  # refused before anything was loaded


def _round_trips(root: str) -> dict[str, Any]:
    logging.getLogger("zerospeed").setLevel(logging.WARNING)
    saver = _engine(0)
    _train(saver, 3)
    plain_path = saver.save_checkpoint(os.path.join(root, "plain"), client_state=PLAIN)
    with log_messages(logging.WARNING) as records:
        saver.save_checkpoint(os.path.join(root, "custom"), client_state={"obj": Custom(7)})
    out: dict[str, Any] = {"save_warnings": records}
    # what the engine writes loads with torch's safe loader alone
    out["safe_files"] = sorted(f for f in os.listdir(plain_path) if f.endswith(".pt")
                               and torch.load(os.path.join(plain_path, f), weights_only=True) is not None)
    loader = _engine(1)
    _, client = loader.load_checkpoint(os.path.join(root, "plain"))
    out["plain_equal"] = (set(client) == set(PLAIN) and torch.equal(client["tensor"], PLAIN["tensor"])
                          and {k: v for k, v in client.items() if k != "tensor"}
                          == {k: v for k, v in PLAIN.items() if k != "tensor"})
    out["resumed"] = [loader.global_steps, loader.micro_steps, loader.get_lr() == saver.get_lr()]
    try:
        _engine(2).load_checkpoint(os.path.join(root, "custom"))
    except CheckpointError as err:
        out["custom_error"] = str(err)
    _, client = _engine(3).load_checkpoint(os.path.join(root, "custom"), allow_unsafe_pickle=True)
    out["custom_value"] = client["obj"].value
    return out


def test_plain_client_state_loads_safely_and_other_objects_need_the_opt_in(tmp_path: Path) -> None:
    out = run_distributed(_round_trips, 1, str(tmp_path))[0]
    assert out["safe_files"] == [layout.ENGINE_STATE, layout.rank_state(0)]
    assert out["plain_equal"]
    assert out["resumed"] == [3, 3, True]
    assert "Custom" in out["custom_error"] and "allow_unsafe_pickle=True" in out["custom_error"]
    assert out["custom_value"] == 7
    # the saver is told at save time that its client_state will need the opt-in
    assert any("allow_unsafe_pickle=True" in m and "Custom" in m for m in out["save_warnings"]), out["save_warnings"]


def test_rng_files_of_the_earlier_format_still_load(tmp_path: Path) -> None:
    """Before this change numpy's RNG state was pickled as an ndarray: plain arrays are allowed."""
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    old = {"rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
           "loader": None}
    expected = (random.random(), np.random.rand(), torch.rand(()).item())
    path = tmp_path / "rank00000.state.pt"
    torch.save(old, path)
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng_state(load_small_state(str(path))["rng"])
    assert (random.random(), np.random.rand(), torch.rand(()).item()) == expected
