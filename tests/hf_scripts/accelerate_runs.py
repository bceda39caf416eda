"""A plain Accelerate training loop run under ``ZEROSPEED_AS_DEEPSPEED=1`` on 2 ranks: for each model it
trains plain (DDP over gloo, ``cpu=True``), then with ``DeepSpeedPlugin(zero_stage=2)`` and with
``DeepSpeedPlugin(hf_ds_config=...)`` at ZeRO-3, gradient accumulation 2 (``<name>-resume``: stopped half
way with ``accelerator.save_state``, resumed with ``load_state``); rank 0 writes every loss curve to
``<out>/curves.json``."""

import json
import os
import sys

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import set_seed

from zerospeed.testing.hf_models import TokenDataset, tiny_causal_lm

OUT = sys.argv[1]
KINDS = sys.argv[2].split(",")
CONFIGS = sys.argv[3].split(",")
STEPS = 12
GAS = 2

ZERO3 = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
         "gradient_accumulation_steps": GAS, "gradient_clipping": 1.0,
         "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto"}


def plugin(name):
    if name == "ddp":
        return None
    if name == "z2":
        return DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=GAS, gradient_clipping=1.0)
    return DeepSpeedPlugin(hf_ds_config=dict(ZERO3))


def train(kind, name, save_at=None, resume_from=None):
    """The loss of each optimizer step; ``save_at`` windows: ``accelerator.save_state`` there and stop;
    ``resume_from``: ``accelerator.load_state`` it and go on from the next batch."""
    # One process runs several configurations: start each from a fresh Accelerate state.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    # The model is built before the plugin: a ZeRO-3 plugin would otherwise build it under deepspeed.zero.Init.
    model = tiny_causal_lm(kind, seed=0)
    ds = plugin(name)
    accelerator = Accelerator(cpu=ds is None, deepspeed_plugin=ds, gradient_accumulation_steps=GAS)
    set_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    loader = torch.utils.data.DataLoader(TokenDataset(STEPS * GAS * 4 * 2, seed=1), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    done = 0
    if resume_from is not None:
        accelerator.load_state(resume_from)
        done = int(open(os.path.join(resume_from, "windows.txt")).read())
        loader = accelerator.skip_first_batches(loader, done * GAS)
    losses, window = [], []
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if ds is None and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)  # DeepSpeed clips in its step
            optimizer.step()
            optimizer.zero_grad()
        window.append(accelerator.gather(loss.detach()).mean().item())
        if accelerator.sync_gradients:
            losses.append(sum(window) / len(window))
            window = []
            if save_at is not None and done + len(losses) == save_at:
                where = os.path.join(OUT, f"{kind}-{name}-state")
                accelerator.save_state(where)
                if accelerator.is_main_process:
                    with open(os.path.join(where, "windows.txt"), "w") as f:
                        f.write(str(save_at))
                break
    accelerator.wait_for_everyone()
    return losses


def run(kind, name):
    if not name.endswith("-resume"):
        return train(kind, name)
    base = name.removesuffix("-resume")
    first = train(kind, base, save_at=STEPS // 2)
    torch.distributed.barrier()  # the state is written by every rank before any reads it
    return first + train(kind, base, resume_from=os.path.join(OUT, f"{kind}-{base}-state"))


def main():
    curves = {f"{kind}-{name}": run(kind, name) for kind in KINDS for name in CONFIGS}
    if int(os.environ.get("RANK", "0")) == 0:
        for key, curve in curves.items():
            print(key, curve, flush=True)
        with open(os.path.join(OUT, "curves.json"), "w") as f:
            json.dump(curves, f)


if __name__ == "__main__":
    main()
