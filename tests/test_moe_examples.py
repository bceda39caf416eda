"""Mixture-of-experts models training through ``zerospeed.initialize`` (issue 19, item 6).

The example GPT with MoE blocks (``examples/gpt.py``, ``GPTConfig(moe_experts=4, ep_size=2)``: each
of 2 ranks holds 2 of the 4 experts, tokens exchanged by all-to-all) trains on the demo's corpus and
gives, micro-batch by micro-batch, the losses and weights of one plain process holding all 4 experts
(``ep_size=1``) that runs both ranks' micro-batches separately (MoE routing is per forward) and
averages their gradients; and its loss falls. A tiny Hugging Face Mixtral (built from a config, its
router's aux loss in the loss; to zerospeed an ordinary module, its experts replicated) trains at
ZeRO stages 0, 2 and 3 as the same plain PyTorch loop does. The
demo's ``--moe_experts`` flag runs the MoE variant through the launcher.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from zerospeed.testing import assert_close_tree, run_distributed
from zerospeed.testing.data import micro_batch_rows
from zerospeed.testing.reference import train_reference

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))  # the example's modules, as demo.py imports them

from corpus import TokenWindows, build_corpus, split  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

WORLD, EP, EXPERTS = 2, 2, 4
SEQ, MICRO, ACCUM, STEPS, LR, CLIP, SEED = 32, 4, 2, 24, 3e-3, 1.0, 0
PARITY_ATOL = 1e-5


# ---------------------------------------------------------------------------------------------------
# The example GPT with MoE blocks


def _gpt(ep_size: int) -> GPT:
    """Block 0 dense, block 1 an MoE over 4 experts (top-2, dropless), seeded alike on every rank."""
    torch.manual_seed(SEED)
    return GPT(GPTConfig(seq_len=SEQ, d_model=32, n_layers=2, n_heads=4, moe_experts=EXPERTS, moe_every=2,
                         moe_k=2, ep_size=ep_size))


def _windows() -> TokenWindows:
    """The demo's data: the standard library's docstrings as bytes, cut into windows."""
    train, _ = split(build_corpus(2 * WORLD * ACCUM * MICRO * SEQ * STEPS))
    return TokenWindows(train, SEQ)


def _batch(data: TokenWindows, step: int, rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = micro_batch_rows(step, rank, micro, world=WORLD, accum=ACCUM, micro=MICRO)
    x, y = zip(*(data[i] for i in range(rows.start, rows.stop)))
    return torch.stack(x), torch.stack(y)


def _gpt_config() -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM, "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 0}}


def _by_global_expert(model: GPT) -> dict[str, list]:
    """Every parameter this rank holds, experts renamed from their local to their global index."""
    out = {}
    for name, p in model.named_parameters():
        if ".deepspeed_experts." in name:
            prefix, rest = name.split(".deepspeed_experts.")
            local, tail = rest.split(".", 1)
            moe = model.get_submodule(prefix.removesuffix(".deepspeed_moe.experts"))
            name = f"{prefix}.deepspeed_experts.{moe.deepspeed_moe.ep_rank * moe.num_local_experts + int(local)}.{tail}"
        out[name] = p.detach().tolist()
    return out


def _train_gpt_rank() -> dict[str, Any]:
    import zerospeed

    rank = torch.distributed.get_rank()
    model, data = _gpt(EP), _windows()
    engine, *_ = zerospeed.initialize(model=model, config=_gpt_config())
    losses = []
    for step in range(STEPS):
        for micro in range(ACCUM):
            loss = engine(*_batch(data, step, rank, micro))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return {"losses": losses, "params": _by_global_expert(model), "has_moe": engine.has_moe_layers,
            "local_experts": sorted({n for n, _ in model.named_parameters() if ".deepspeed_experts." in n})}


class _LossModule(nn.Module):
    """``model(x, y)`` (the example's loss, aux terms included) as the reference loop's one-argument model."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.model(*batch)


def _gpt_reference() -> dict[str, Any]:
    model, data = _gpt(1), _windows()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    run = train_reference(_LossModule(model), optimizer, steps=STEPS, world=WORLD, accum=ACCUM, clip=CLIP,
                          batch=lambda step, rank, micro: (_batch(data, step, rank, micro), None),
                          loss_fn=lambda loss, _: loss)
    return {"losses": run.losses, "params": {n: p.detach().tolist() for n, p in model.named_parameters()}}


@pytest.mark.spawns
def test_moe_gpt_ep2_trains_as_one_process_and_learns() -> None:
    ranks = run_distributed(_train_gpt_rank, WORLD, timeout=240)
    ref = _gpt_reference()
    for rank, got in enumerate(ranks):
        assert got["has_moe"] is True
        assert len(got["local_experts"]) == 2 * 4  # 2 of the 4 experts here, 2 linears x (weight, bias) each
        assert_close_tree(got["losses"], ref["losses"][rank], atol=PARITY_ATOL, path=f"rank {rank} losses")
        assert_close_tree(got["params"], {n: ref["params"][n] for n in got["params"]}, atol=PARITY_ATOL,
                          path=f"rank {rank} params")
    experts = [{n for n in got["params"] if ".deepspeed_experts." in n} for got in ranks]
    assert experts[0].isdisjoint(experts[1]) and len(experts[0] | experts[1]) == 4 * 4  # all 4, each once
    # every expert starts as a copy of the block's MLP; the tokens each one was sent made them differ
    held = {**ranks[0]["params"], **ranks[1]["params"]}
    first_weights = [held[f"blocks.1.mlp.deepspeed_moe.experts.deepspeed_experts.{e}.0.weight"] for e in range(4)]
    assert all(first_weights[a] != first_weights[b] for a in range(4) for b in range(a + 1, 4))
    dense = [n for n in ranks[0]["params"] if ".deepspeed_experts." not in n]
    assert all(ranks[0]["params"][n] == ranks[1]["params"][n] for n in dense)  # identical, bit for bit
    for rank, got in enumerate(ranks):
        first, last = sum(got["losses"][:4]) / 4, sum(got["losses"][-4:]) / 4
        assert last < first - 1.0, f"rank {rank}: the loss did not fall: {first:.3f} -> {last:.3f}"


# ---------------------------------------------------------------------------------------------------
# A tiny Hugging Face Mixtral

HF_STEPS, HF_MICRO, HF_LR, AUX_COEF = 4, 2, 0.01, 0.05


def _mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    from zerospeed.testing.hf_models import SEQ as HF_SEQ
    from zerospeed.testing.hf_models import VOCAB

    config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=2 * HF_SEQ, output_router_logits=True,
                           router_aux_loss_coef=AUX_COEF, router_jitter_noise=0.0, attention_dropout=0.0,
                           tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(SEED)
    return MixtralForCausalLM(config)


def _hf_rows() -> torch.Tensor:
    from zerospeed.testing.hf_models import token_rows

    return token_rows(HF_STEPS * WORLD * HF_MICRO, seed=1)


def _hf_ids(rows: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    return rows[micro_batch_rows(step, rank, 0, world=WORLD, accum=1, micro=HF_MICRO)]


def _train_mixtral_rank(stage: int) -> dict[str, Any]:
    import logging

    import zerospeed
    from zerospeed.testing.hf_models import lm_batch
    from zerospeed.zero import GatheredParameters

    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("zerospeed").setLevel(logging.WARNING)  # no config dump
    rank, rows, model = torch.distributed.get_rank(), _hf_rows(), _mixtral()
    config = {"train_micro_batch_size_per_gpu": HF_MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
              "optimizer": {"type": "AdamW", "params": {"lr": HF_LR, "weight_decay": 0.01}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 4096,
                                    "stage3_param_persistence_threshold": 0}}  # ZeRO-3 splits every parameter
    engine, *_ = zerospeed.initialize(model=model, config=config)
    losses, aux = [], []
    for step in range(HF_STEPS):
        out = engine(**lm_batch(_hf_ids(rows, step, rank)))
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
        aux.append(out.aux_loss.item())
    with GatheredParameters(list(engine.module.parameters())):  # whole at stage 3, a no-op below
        params = {n: p.detach().tolist() for n, p in engine.module.named_parameters()}
    return {"losses": losses, "aux": aux, "params": params}


def _mixtral_reference() -> dict[str, Any]:
    from zerospeed.testing.hf_models import LossOf

    rows, model = _hf_rows(), _mixtral()
    optimizer = torch.optim.AdamW(model.parameters(), lr=HF_LR, weight_decay=0.01)
    run = train_reference(LossOf(model), optimizer, steps=HF_STEPS, world=WORLD, clip=CLIP,
                          batch=lambda step, rank, _: (_hf_ids(rows, step, rank), None), loss_fn=lambda loss, _: loss)
    return {"losses": run.losses, "params": {n: p.detach().tolist() for n, p in model.named_parameters()}}


def test_mixtral_loss_carries_the_router_aux_loss() -> None:
    """The setup the parity test relies on: the loss is cross-entropy plus coef x the balancing loss."""
    pytest.importorskip("transformers")
    from zerospeed.testing.hf_models import lm_batch

    model = _mixtral()
    batch = lm_batch(_hf_ids(_hf_rows(), 0, 0))
    out = model(**batch)
    logits = out.logits[:, :-1].reshape(-1, out.logits.size(-1))
    ce = torch.nn.functional.cross_entropy(logits, batch["labels"][:, 1:].reshape(-1))
    assert out.aux_loss.item() > 1.0  # ~ num_experts_per_tok when balanced
    torch.testing.assert_close(out.loss, ce + AUX_COEF * out.aux_loss)


@pytest.mark.spawns
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_tiny_mixtral_trains_through_initialize_as_plain_pytorch(stage: int) -> None:
    pytest.importorskip("transformers")
    ranks = run_distributed(_train_mixtral_rank, WORLD, stage, timeout=240)
    ref = _mixtral_reference()
    for rank, got in enumerate(ranks):
        assert_close_tree(got["losses"], ref["losses"][rank], atol=PARITY_ATOL, path=f"rank {rank} losses")
        assert_close_tree(got["params"], ref["params"], atol=PARITY_ATOL, path=f"rank {rank} params")
        assert all(a > 1.0 for a in got["aux"])  # the router's balancing loss was computed every step
    assert ref["losses"][0][-1] < ref["losses"][0][0]  # the reference itself learns on these rows


# ---------------------------------------------------------------------------------------------------
# The demo's MoE flag, through the launcher


@pytest.mark.spawns
def test_demo_moe_flag_trains_through_the_launcher() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-m", "zerospeed", "--num_procs", "2", "--master_port", "0", str(EXAMPLES / "demo.py"),
         "--steps", "8", "--corpus_bytes", "100000", "--val_windows", "16", "--sample_tokens", "8",
         "--moe_experts", "4", "--ep_size", "2"],
        capture_output=True, text=True, env=env, timeout=240,
    )
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "MoE in blocks [1, 3]: 4 experts, top-2, ep_size 2, dropless" in out
    assert "OK: the loss fell" in out and "sample " in out
    first, last = map(float, re.search(r"train loss\s+([\d.]+) -> ([\d.]+)", out).groups())
    before, after = map(float, re.search(r"validation loss\s+([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first - 0.2 and after < before - 0.5, (first, last, before, after)  # 8 steps, from ln 256
