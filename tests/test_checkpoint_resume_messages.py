"""What a resume says when it finds nothing to load, and when it loads at another data-parallel size.

A resume that finds no checkpoint returns ``(None, None)`` as DeepSpeed's does, but its warning says
what was there: a missing folder is called missing (absolute path), an empty one empty, a folder of
tags without ``latest`` lists them and how to pick one; ``must_exist=True`` or the config's
``checkpoint.load_must_exist`` raise instead. ``zerospeed convert`` says the same things (one
function, :func:`zerospeed.checkpoint.layout.why_no_checkpoint`). A resume at another data-parallel
size logs one line: the saved and current micro batch, accumulation and global batch, and whether
the global batch was kept.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.checkpoint import layout
from zerospeed.checkpoint.consolidate import convert_main
from zerospeed.checkpoint.engine_io import batch_change
from zerospeed.checkpoint.layout import CheckpointError, why_no_checkpoint
from zerospeed.testing import one_process_group, run_distributed
from zerospeed.testing.configs import adamw, train_config, zero_section
from zerospeed.testing.data import seeded_regression_batch
from zerospeed.testing.logs import log_messages
from zerospeed.testing.models import seeded_mlp


def _engine(accum: int = 1, **top: Any) -> zerospeed.Engine:
    config = train_config(micro=2, accum=accum, optimizer=adamw(1e-3),
                          zero=zero_section(1, reduce_bucket_size=200, persistence_threshold=10), **top)
    engine, *_ = zerospeed.initialize(model=seeded_mlp(6, 8, 3), config=config)
    return engine


def _train(engine: zerospeed.Engine, steps: int) -> None:
    for _ in range(steps * engine.gradient_accumulation_steps()):
        x, y = seeded_regression_batch(engine.global_steps, engine.comm.rank, rows=2, inputs=6, outputs=3)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()


def _fake_tags(folder: Path, *tags: str) -> None:
    """Tag directories as ``list_tags`` sees them (a manifest each), without a ``latest`` file."""
    for tag in tags:
        (folder / tag).mkdir(parents=True)
        (folder / tag / layout.MANIFEST).write_text("{}")


# -- the diagnosis, shared by load_checkpoint and convert ---------------------------------------

def test_why_no_checkpoint_says_missing_empty_file_tags_or_other_files(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    assert why_no_checkpoint("ckpt_typo") == (
        f"{tmp_path}/ckpt_typo is missing (no such directory): check the path for a typo or a missing mount")
    assert why_no_checkpoint(str(tmp_path / "a" / "b")) == (
        f"{tmp_path}/a/b is missing (no such directory, nor does its parent {tmp_path}/a): check the path for a "
        f"typo or a missing mount")
    (tmp_path / "file").write_text("x")
    assert why_no_checkpoint("file") == (
        f"{tmp_path}/file is a file, not a checkpoint directory: pass the directory given to save_checkpoint")
    (tmp_path / "empty").mkdir()
    assert why_no_checkpoint("empty") == f"{tmp_path}/empty is empty: it holds no checkpoint"
    _fake_tags(tmp_path / "tags", "global_step9", "global_step10", "global_step2")
    assert why_no_checkpoint("tags") == (
        f"{tmp_path}/tags holds checkpoint tag(s) global_step2, global_step9, global_step10 but no 'latest' file "
        f"naming the one to load: pick one with tag='global_step10', or write a tag into {tmp_path}/tags/latest")
    assert why_no_checkpoint("tags", pick="--tag {}").endswith(
        f"pick one with --tag global_step10, or write a tag into {tmp_path}/tags/latest")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / ".tmp-global_step1-ab-1").mkdir()  # a first save that crashed
    (tmp_path / "other" / "notes.txt").write_text("x")
    assert why_no_checkpoint("other") == (
        f"{tmp_path}/other holds no checkpoint: no 'latest' file and no tag directory with a manifest.json "
        f"(it holds: .tmp-global_step1-ab-1, notes.txt)")


def test_convert_says_what_it_found(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def convert(folder: Path, *extra: str) -> str:
        assert convert_main([str(folder), str(tmp_path / "out.safetensors"), *extra]) == 2
        return capsys.readouterr().err.strip()

    assert convert(tmp_path / "typo") == (f"zerospeed convert: error: nothing to convert: {tmp_path}/typo is missing "
                                          f"(no such directory): check the path for a typo or a missing mount")
    (tmp_path / "empty").mkdir()
    assert convert(tmp_path / "empty") == (f"zerospeed convert: error: nothing to convert: {tmp_path}/empty is "
                                           f"empty: it holds no checkpoint")
    _fake_tags(tmp_path / "tags", "global_step1", "global_step2")
    assert convert(tmp_path / "tags") == (
        f"zerospeed convert: error: nothing to convert: {tmp_path}/tags holds checkpoint tag(s) global_step1, "
        f"global_step2 but no 'latest' file naming the one to load: pick one with --tag global_step2, or write a "
        f"tag into {tmp_path}/tags/latest")
    assert convert(tmp_path / "typo", "--tag", "global_step1") == (
        f"zerospeed convert: error: checkpoint tag 'global_step1' not found: {tmp_path}/typo is missing (no such "
        f"directory): check the path for a typo or a missing mount")
    assert not (tmp_path / "out.safetensors").exists()


# -- load_checkpoint: a warning that says what was found, or an error in strict mode --------------

def _load(engine: zerospeed.Engine, folder: Path, **kwargs: Any) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = engine.load_checkpoint(str(folder), **kwargs)
    return result, [str(w.message) for w in caught if "load_checkpoint" in str(w.message)]


def test_load_checkpoint_says_what_it_found_and_raises_when_it_must_exist(tmp_path: Path) -> None:
    with one_process_group():
        engine = _engine()
        _train(engine, 1)
        for tag in ("global_step1", "global_step2"):
            engine.save_checkpoint(str(tmp_path / "tags"), tag=tag)
        os.unlink(tmp_path / "tags" / layout.LATEST)
        before = [p.detach().clone() for p in engine.module.parameters()]

        result, messages = _load(engine, tmp_path / "typo")
        assert result == (None, None)
        assert messages == [f"load_checkpoint: {tmp_path}/typo is missing (no such directory): check the path for a "
                            f"typo or a missing mount; nothing was loaded, so training starts from scratch (pass "
                            f"must_exist=True or set checkpoint.load_must_exist to raise instead)"]
        result, messages = _load(engine, tmp_path / "tags")
        assert result == (None, None)
        assert messages == [f"load_checkpoint: {tmp_path}/tags holds checkpoint tag(s) global_step1, global_step2 "
                            f"but no 'latest' file naming the one to load: pick one with tag='global_step2', or write "
                            f"a tag into {tmp_path}/tags/latest; nothing was loaded, so training starts from scratch "
                            f"(pass must_exist=True or set checkpoint.load_must_exist to raise instead)"]
        (tmp_path / "empty").mkdir()
        with pytest.raises(CheckpointError) as info:
            engine.load_checkpoint(str(tmp_path / "empty"), must_exist=True)
        assert str(info.value) == (f"load_checkpoint: {tmp_path}/empty is empty: it holds no checkpoint; nothing was "
                                   f"loaded and, as must_exist=True, the run stops here rather than training from "
                                   f"scratch")
        with pytest.raises(CheckpointError, match="checkpoint tag 'global_step1' not found: .*/typo is missing"):
            engine.load_checkpoint(str(tmp_path / "typo"), tag="global_step1")
        assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True))
        # the tag named as the message says loads
        assert engine.load_checkpoint(str(tmp_path / "tags"), tag="global_step2")[0] == str(tmp_path / "tags" /
                                                                                           "global_step2")

        strict = _engine(checkpoint={"load_must_exist": True})
        assert strict.config.checkpoint.load_must_exist is True
        with pytest.raises(CheckpointError) as info:
            strict.load_checkpoint(str(tmp_path / "tags"))
        assert str(info.value).startswith(f"load_checkpoint: {tmp_path}/tags holds checkpoint tag(s) global_step1, "
                                          f"global_step2 but no 'latest' file")
        assert str(info.value).endswith("nothing was loaded and, as checkpoint.load_must_exist is true, the run "
                                        "stops here rather than training from scratch")
        result, messages = _load(strict, tmp_path / "empty", must_exist=False)  # the keyword overrides the key
        assert result == (None, None) and len(messages) == 1 and "is empty" in messages[0]


# -- a resume at another data-parallel size: one line about the global batch ----------------------

def test_batch_change_says_whether_the_global_batch_was_kept() -> None:
    manifest = {"world_size": 4, "micro_batch_size": 2, "counters": {"gradient_accumulation_steps": 1},
                "config": {}}
    assert batch_change(manifest, 4, 2, 1) is None
    assert batch_change(manifest, 2, 2, 2) == (True, (
        "saved at data-parallel size 4 (global batch 8 = micro batch 2 x accumulation 1 x 4 rank(s)), resumed at "
        "data-parallel size 2 (global batch 8 = micro batch 2 x accumulation 2 x 2 rank(s)): the global batch is "
        "kept (gradient accumulation 1 -> 2)"))
    assert batch_change(manifest, 2, 1, 4) == (True, (
        "saved at data-parallel size 4 (global batch 8 = micro batch 2 x accumulation 1 x 4 rank(s)), resumed at "
        "data-parallel size 2 (global batch 8 = micro batch 1 x accumulation 4 x 2 rank(s)): the global batch is "
        "kept (gradient accumulation 1 -> 4, micro batch 2 -> 1)"))
    assert batch_change(manifest, 2, 2, 1) == (False, (
        "saved at data-parallel size 4 (global batch 8 = micro batch 2 x accumulation 1 x 4 rank(s)), resumed at "
        "data-parallel size 2 (global batch 4 = micro batch 2 x accumulation 1 x 2 rank(s)): the global batch "
        "changed from 8 to 4 samples per optimizer step (the step count and learning-rate schedule go on from the "
        "checkpoint's); to keep it, set gradient_accumulation_steps to 2 (or train_batch_size to 8)"))
    assert batch_change(manifest, 3, 2, 1)[1].endswith(  # type: ignore[index]
        "it cannot be kept at micro batch 2 x 3 rank(s) (8 is not a multiple of 6); change "
        "train_micro_batch_size_per_gpu to keep it")


def _save_on_two_ranks(root: str) -> str:
    engine = _engine()
    _train(engine, 1)
    return engine.save_checkpoint(root)


def test_a_resume_at_another_data_parallel_size_logs_the_global_batch(tmp_path: Path) -> None:
    saved = run_distributed(_save_on_two_ranks, 2, str(tmp_path / "dp2"), timeout=90)[0]
    prefix = (f"load_checkpoint: {saved}: saved at data-parallel size 2 (global batch 4 = micro batch 2 x "
              f"accumulation 1 x 2 rank(s)), resumed at data-parallel size 1 ")
    with one_process_group():
        kept = _engine(accum=2)
        with log_messages(logging.INFO) as messages:
            kept.load_checkpoint(str(tmp_path / "dp2"))
        assert [m for m in messages if m.startswith("load_checkpoint")] == [
            prefix + "(global batch 4 = micro batch 2 x accumulation 2 x 1 rank(s)): the global batch is kept "
                     "(gradient accumulation 1 -> 2)"]
        changed = _engine(accum=1)
        with log_messages(logging.WARNING) as messages:
            changed.load_checkpoint(str(tmp_path / "dp2"))
        assert [m for m in messages if m.startswith("load_checkpoint")] == [
            prefix + "(global batch 2 = micro batch 2 x accumulation 1 x 1 rank(s)): the global batch changed from 4 "
                     "to 2 samples per optimizer step (the step count and learning-rate schedule go on from the "
                     "checkpoint's); to keep it, set gradient_accumulation_steps to 2 (or train_batch_size to 4)"]
        same = changed.save_checkpoint(str(tmp_path / "dp1"))
        with log_messages(logging.INFO) as messages:
            assert _engine().load_checkpoint(str(tmp_path / "dp1"))[0] == same
        assert not [m for m in messages if "data-parallel size" in m]  # the same size: nothing to say
