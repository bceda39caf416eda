"""A plain Accelerate training loop with DeepSpeed ZeRO, on zerospeed.

An ordinary Accelerate script plus one line (``zerospeed.install_as_deepspeed()``, before accelerate is
imported) that makes ``import deepspeed`` zerospeed; ``ZEROSPEED_AS_DEEPSPEED=1`` in the environment
does the same without that line. Offline: a tiny GPT-2 built from its config, generated token data.

    zerospeed --num_procs 2 examples/accelerate_loop.py --zero-stage 3
    torchrun --nproc_per_node 2 examples/accelerate_loop.py --zero-stage 2
"""

import argparse

import zerospeed

zerospeed.install_as_deepspeed()  # the one line: accelerate's `import deepspeed` is zerospeed

import torch  # noqa: E402
from accelerate import Accelerator, DeepSpeedPlugin  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from zerospeed.testing.hf_models import TokenDataset, tiny_gpt2_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zero-stage", type=int, default=2, choices=(0, 1, 2, 3))
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_gpt2_config())
    plugin = DeepSpeedPlugin(zero_stage=args.zero_stage, gradient_accumulation_steps=args.gradient_accumulation_steps,
                             gradient_clipping=1.0, zero3_save_16bit_model=True)
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=args.gradient_accumulation_steps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = torch.utils.data.DataLoader(TokenDataset(1024, seed=1), batch_size=8, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    model.train()
    for epoch in range(args.epochs):
        for step, batch in enumerate(loader):
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients and step % 8 == 7:
                accelerator.print(f"epoch {epoch} step {step + 1}: loss {accelerator.gather(loss.detach()).mean():.4f}")

    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)  # gathers ZeRO-3 shards on every rank's call
    accelerator.print(f"trained; {len(state_dict or {})} tensors in the consolidated state dict")
    accelerator.end_training()


if __name__ == "__main__":
    main()
