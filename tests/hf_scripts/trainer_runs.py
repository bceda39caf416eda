"""An ordinary HF Trainer script run under ``ZEROSPEED_AS_DEEPSPEED=1`` on 2 ranks: for each model it trains
30 steps plain (DDP), with ZeRO-2 and ZeRO-3 configs from the HF docs ("auto" values), ZeRO-3 with CPU
offload, ZeRO-2 with the Trainer's own optimizer, and ZeRO-2/3 runs stopped at step 15 then resumed; rank 0
writes every loss curve to ``<out>/curves.json``.

    python -m zerospeed --num_procs 2 trainer_runs.py OUT gpt2,llama ddp,z2,z3,gpt2/z3off,z2-resume"""

import json
import os
import sys

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from zerospeed.testing.hf_models import TokenDataset, tiny_causal_lm

OUT = sys.argv[1]
KINDS = sys.argv[2].split(",")
CONFIGS = sys.argv[3].split(",")
STEPS = 30

# The HF docs' examples (https://huggingface.co/docs/transformers/deepspeed), all "auto" values kept, minus their
# "scheduler" section: DeepSpeed's WarmupLR warms up over max(2, warmup_num_steps) steps, which a plain Trainer
# cannot reproduce; without the section the Trainer hands DeepSpeed its own scheduler (the docs' other road).
ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 2e8,
                          "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
                          "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
                          "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


# The docs' ZeRO-3 offload variant: optimizer states and parameters in CPU memory (DeepSpeedCPUAdam).
ZERO3_OFFLOAD = {**ZERO3, "zero_optimization": {**ZERO3["zero_optimization"],
                                                "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                                "offload_param": {"device": "cpu", "pin_memory": True}}}
# No "optimizer" section: the Trainer builds its own torch AdamW and hands it to DeepSpeed.
ZERO2_TRAINER_OPTIM = {k: v for k, v in ZERO2.items() if k != "optimizer"}


class Losses(TrainerCallback):
    """Keeps each logged training loss (logging_steps=1: one per optimizer step)."""

    def __init__(self):
        self.losses = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]


def train(kind, ds, run_dir, max_steps, resume=None, model_after_args=False):
    # Built before TrainingArguments(deepspeed=...) registers its config, the model is whole and the engine
    # partitions it; built after (model_after_args, the usual order in HF scripts), a ZeRO-3 config makes
    # from_config construct it under deepspeed.zero.Init, partitioned as it is made. The previous run's
    # registration is dropped first.
    unset_hf_deepspeed_config()
    model = None if model_after_args else tiny_causal_lm(kind, seed=0)
    # warmup_steps=0 keeps the plain scheduler (linear decay) and DeepSpeed's WarmupLR comparable: both
    # are constant here because lr_scheduler_type="constant".
    args = TrainingArguments(output_dir=run_dir, max_steps=max_steps, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, learning_rate=3e-3, weight_decay=0.0,
                             lr_scheduler_type="constant", logging_steps=1, save_steps=15,
                             save_strategy="steps", report_to=[], seed=0, data_seed=0, deepspeed=ds,
                             dataloader_num_workers=0, disable_tqdm=True, max_grad_norm=1.0,
                             save_only_model=False, use_cpu=ds is None)  # plain run: DDP over gloo
    if model is None:
        model = tiny_causal_lm(kind, seed=0)
        assert hasattr(next(model.parameters()), "ds_numel"), "from_config did not build under zero.Init"
    cb = Losses()
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(512, seed=1), callbacks=[cb])
    trainer.train(resume_from_checkpoint=resume)
    return cb.losses


def main():
    rank = int(os.environ.get("RANK", "0"))
    curves = {}
    for kind in KINDS:
        # A configuration written "kind/name" runs for that model only.
        for name in [c.split("/")[-1] for c in CONFIGS if "/" not in c or c.startswith(kind + "/")]:
            ds = {"ddp": None, "z2": ZERO2, "z3": ZERO3, "z3init": ZERO3, "z3off": ZERO3_OFFLOAD,
                  "z2torch": ZERO2_TRAINER_OPTIM}[name.split("-")[0]]
            after = name.startswith("z3init")
            run_dir = os.path.join(OUT, f"{kind}-{name}")
            if name.endswith("-resume"):
                first = train(kind, ds, run_dir, 15, model_after_args=after)
                second = train(kind, ds, run_dir, STEPS, resume=os.path.join(run_dir, "checkpoint-15"),
                               model_after_args=after)
                curves[f"{kind}-{name}"] = {**first, **second}
            else:
                curves[f"{kind}-{name}"] = train(kind, ds, run_dir, STEPS, model_after_args=after)
            if rank == 0:
                print(name, kind, curves[f"{kind}-{name}"], flush=True)
    if rank == 0:
        with open(os.path.join(OUT, "curves.json"), "w") as f:
            json.dump(curves, f)


if __name__ == "__main__":
    main()
