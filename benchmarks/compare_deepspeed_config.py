"""Parse every config under tests/data with DeepSpeed's own DeepSpeedConfig and with zerospeed, and
compare the values both derive (batch triple, ZeRO stage, precision, clipping, offload devices).

Needs DeepSpeed importable, so run it from a separate venv that has it (see BENCHMARKS.md):

    PYTHONPATH=src /path/to/deepspeed-venv/bin/python benchmarks/compare_deepspeed_config.py

DeepSpeed 0.19.8 rejects some keys it removed (sparse_attention, progressive_layer_drop,
sparse_gradients) and "auto" values (which the HF Trainer fills in first); those rows say so.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import hjson
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]


def _deepspeed_view(data: dict) -> dict:
    from deepspeed.runtime.config import DeepSpeedConfig

    ds = DeepSpeedConfig(json.loads(json.dumps(data)))
    return {
        "batch": (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps),
        "stage": int(ds.zero_optimization_stage),
        "fp16": bool(ds.float16_config.enabled),
        "bf16": bool(ds.bfloat16_config.enabled),
        "clip": float(ds.gradient_clipping),
        "offload_optimizer": _device(ds.zero_config.offload_optimizer),
        "offload_param": _device(ds.zero_config.offload_param),
    }


def _device(section: object) -> str:
    """DeepSpeed keeps an absent offload section as None and the device as an enum."""
    device = getattr(section, "device", None)
    return str(getattr(device, "value", device) or "none")


def _zerospeed_view(path: Path) -> dict:
    from zerospeed import load_config

    cfg = load_config(path, world_size=1)
    zero = cfg.zero_optimization
    return {
        "batch": (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps),
        "stage": int(zero.stage),
        "fp16": cfg.fp16.enabled is True,
        "bf16": cfg.bf16.enabled is True,
        "clip": float(cfg.gradient_clipping),
        "offload_optimizer": str(zero.offload_optimizer.device.value),
        "offload_param": str(zero.offload_param.device.value),
    }


def main() -> int:
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29688"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    import deepspeed

    print(f"DeepSpeed {deepspeed.__version__} vs zerospeed, world size 1")
    agree = differ = 0
    for path in sorted((ROOT / "tests" / "data").iterdir()):
        data = hjson.loads(path.read_text()) if path.suffix == ".hjson" else json.loads(path.read_text())
        try:
            theirs = _deepspeed_view(data)
        except Exception as exc:  # noqa: BLE001 - report DeepSpeed's refusal and go on
            print(f"  {path.name:<36} DeepSpeed refuses: {str(exc).splitlines()[0][:90]}")
            continue
        try:
            ours = _zerospeed_view(path)
        except Exception as exc:  # noqa: BLE001
            print(f"  {path.name:<36} zerospeed refuses: {str(exc).splitlines()[0][:90]}")
            differ += 1
            continue
        diffs = {k: (ours[k], theirs[k]) for k in ours if ours[k] != theirs[k]}
        agree += not diffs
        differ += bool(diffs)
        print(f"  {path.name:<36} {'same values' if not diffs else f'DIFFERENT (ours, theirs): {diffs}'}")
    print(f"{agree} configs agree on every compared value, {differ} differ")
    dist.destroy_process_group()
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
