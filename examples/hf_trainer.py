"""Fine-tune a causal LM with the Hugging Face ``Trainer`` and a DeepSpeed config, on zerospeed.

An ordinary Trainer script plus one line (``zerospeed.install_as_deepspeed()``, before transformers is
imported) that makes ``import deepspeed`` zerospeed; ``ZEROSPEED_AS_DEEPSPEED=1`` in the environment
does the same without that line. Offline: a tiny Llama built from its config, generated token data.

    zerospeed --num_procs 2 examples/hf_trainer.py --zero-stage 3
    torchrun --nproc_per_node 2 examples/hf_trainer.py --zero-stage 2 --resume
"""

import argparse

import zerospeed

zerospeed.install_as_deepspeed()  # the one line: `import deepspeed` (transformers', accelerate's) is zerospeed

from transformers import AutoModelForCausalLM, Trainer, TrainingArguments  # noqa: E402

from zerospeed.testing.hf_models import TokenDataset, tiny_llama_config  # noqa: E402

# The Hugging Face docs' ZeRO config: the Trainer fills every "auto" from its TrainingArguments.
DS_CONFIG = {
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                          "reduce_bucket_size": "auto", "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zero-stage", type=int, default=2, choices=(0, 1, 2, 3))
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--output-dir", default="hf_trainer_out")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output-dir")
    args = parser.parse_args()

    ds_config = {**DS_CONFIG, "zero_optimization": {**DS_CONFIG["zero_optimization"], "stage": args.zero_stage}}
    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=8,
        gradient_accumulation_steps=2, learning_rate=3e-3, warmup_steps=4, logging_steps=5, save_steps=20,
        report_to=[], seed=0, deepspeed=ds_config, disable_tqdm=True)
    # Made after TrainingArguments registered a ZeRO-3 config, the model is built partitioned (deepspeed.zero.Init).
    model = AutoModelForCausalLM.from_config(tiny_llama_config())
    trainer = Trainer(model=model, args=training_args, train_dataset=TokenDataset(2048, seed=1))
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    trainer.save_model()  # the whole model (ZeRO-3 shards gathered), loadable with from_pretrained


if __name__ == "__main__":
    main()
