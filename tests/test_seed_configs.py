"""DeepSpeed's own configs of 2020 train unchanged on 2 ranks (issue 13): the Megatron-LM GPT-2 config
(``"zero_optimization": true``, Adam with ``max_grad_norm``, fp16 with ``loss_scale_window``/
``hysteresis``/``min_loss_scale``) and the Bing BERT config (Lamb with ``max_grad_norm``,
``bias_correction: false``, ``max_coeff``/``min_coeff``, fp16 ``loss_scale: 0``, a 16384 global batch of
micro-batches of 16, ``prescale_gradients``, ``wall_clock_breakdown``). Each is read from its file as
published, builds the optimizer, clipping and loss scaler it asks for, and trains a small model of its
kind (a causal LM, a masked LM) to a lower loss, the ranks agreeing on every parameter."""

from __future__ import annotations

import itertools
import math
import pathlib
import warnings
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import zerospeed
from zerospeed.testing import log_messages, run_distributed

DATA = pathlib.Path(__file__).parent / "data"
VOCAB, SEQ, DIM, MASK = 32, 16, 32, 0


class TinyLM(nn.Module):
    """Token mixing over positions (causal for GPT-2, bidirectional for BERT) and an MLP, pre-LN, with a
    token head: a language model of either kind that is cheap enough for BERT's 512 micro-batches a step."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.mix = nn.Parameter(torch.randn(SEQ, SEQ) * 0.1)
        self.register_buffer("allowed", torch.tril(torch.ones(SEQ, SEQ)) if causal
                             else 1 - torch.eye(SEQ), persistent=False)  # BERT: no peeking at the token itself
        self.norms = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(3))
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) + self.pos
        h = h + torch.einsum("ts,bsd->btd", self.mix * self.allowed, self.norms[0](h))
        h = h + self.mlp(self.norms[1](h))
        logits = self.head(self.norms[2](h)).float()
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)


def _sequences(n: int, seed: int) -> torch.Tensor:
    """Learnable token streams: each sequence counts up by a per-sequence stride (mod VOCAB, never 0)."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(1, VOCAB, (n, 1), generator=gen)
    stride = torch.randint(1, 4, (n, 1), generator=gen)
    return (start + stride * torch.arange(SEQ)) % (VOCAB - 1) + 1


def _batch(kind: str, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = _sequences(n, seed)
    if kind == "gpt2":  # next-token prediction
        return ids, torch.cat([ids[:, 1:], torch.full((n, 1), -100)], dim=1)
    masked = torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed + 1)) < 0.15
    return ids.masked_fill(masked, MASK), ids.masked_fill(~masked, -100)  # masked LM


def _train(kind: str, config: str, steps: int) -> dict[str, Any]:
    with log_messages() as records:
        return _train_logged(kind, config, steps, records)


def _train_logged(kind: str, config: str, steps: int, records: list[str]) -> dict[str, Any]:
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        engine, optimizer, _, _ = zerospeed.initialize(model=TinyLM(causal=kind == "gpt2"), config=config)
    micro, accumulation = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    out: dict[str, Any] = {
        "warnings": [str(w.message) for w in seen if issubclass(w.category, DeprecationWarning)],
        "batch": [engine.train_batch_size(), micro, accumulation], "clipping": float(engine.config.gradient_clipping),
        "stage": engine.state.stage, "optimizer": type(optimizer).__name__, "group": group,
        "scaler": [type(engine.scaler).__name__, getattr(engine.scaler, "scale_window", None),
                   getattr(engine.scaler, "delayed_shift", None), getattr(engine.scaler, "min_scale", None)],
    }
    losses = []
    for step in range(steps):
        total = 0.0
        for m in range(accumulation):
            # the same 4 global batches over and over, so the loss must fall; each rank its own rows
            ids, targets = _batch(kind, micro, seed=1000 * (step % 4) + 10 * m + rank)
            loss = engine(ids, targets)
            engine.backward(loss)
            engine.step()
            total += float(loss)
        losses.append(total / accumulation)
    out["losses"] = losses
    out["steps"] = [engine.global_steps, engine.skipped_steps]
    flat = torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(gathered, flat)
    out["ranks_agree"] = all(torch.equal(g, gathered[0]) for g in gathered)
    out["breakdown"] = [r for r in records if "time (ms)" in r]
    return out


def _check_training(out: dict[str, Any], steps: int) -> None:
    """``steps`` counted, few skipped for overflow, finite losses, the ranks' parameters identical."""
    assert out["steps"][0] == steps
    assert out["steps"][1] <= steps // 4, f"too many steps skipped: {out['steps']}"
    assert all(math.isfinite(x) for x in out["losses"]), out["losses"]
    assert out["ranks_agree"]


def test_megatron_gpt2_config_of_2020_trains_on_2_ranks() -> None:
    steps = 48
    out = run_distributed(_train, 2, "gpt2", str(DATA / "ds_2020_megatron_gpt2.json"), steps, timeout=240.0)
    for rank_out in out:
        assert any("max_grad_norm" in w for w in rank_out["warnings"]), rank_out["warnings"]
        assert any("zero_optimization" in w for w in rank_out["warnings"])
        assert rank_out["batch"] == [16, 8, 1] and rank_out["stage"] == 1 and rank_out["clipping"] == 1.0
        assert rank_out["optimizer"] == "AdamW" and rank_out["group"]["lr"] == 0.00015
        assert rank_out["scaler"] == ["DynamicScaler", 1000, 2, 1.0]
        _check_training(rank_out, steps)
        losses = rank_out["losses"]  # the first and the last pass over the 4 batches
        assert sum(losses[-4:]) < 0.97 * sum(losses[:4]), f"the loss did not fall: {losses}"


def test_bing_bert_lamb_config_of_2020_trains_on_2_ranks() -> None:
    steps = 4  # each step is 512 micro-batches of 16 sequences per rank
    out = run_distributed(_train, 2, "bert", str(DATA / "ds_2020_bing_bert_lamb.json"), steps, timeout=290.0)
    for rank_out in out:
        assert any("max_grad_norm" in w for w in rank_out["warnings"]), rank_out["warnings"]
        assert rank_out["batch"] == [16384, 16, 512] and rank_out["stage"] == 0 and rank_out["clipping"] == 1.0
        group = rank_out["group"]
        assert rank_out["optimizer"] == "Lamb"
        assert (group["lr"], group["bias_correction"], group["max_coeff"], group["min_coeff"],
                group["weight_decay"], group["max_grad_norm"]) == (4e-3, False, 0.5, 0.08, 0.01, 0.0)
        assert rank_out["scaler"][0] == "DynamicScaler"
        _check_training(rank_out, steps)
        losses = rank_out["losses"]  # 16384 fresh sequences a step: it falls at every step
        assert all(b < a for a, b in itertools.pairwise(losses)), f"the loss did not fall at every step: {losses}"
    # wall_clock_breakdown: steps_per_print is 1000, so no breakdown line in 8 steps (rank 0 logs them)
    assert out[0]["breakdown"] == []
