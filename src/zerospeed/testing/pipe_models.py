"""A GPT-like model as pipeline layers, its plain single-process twin, and token data, for pipeline tests
and benchmarks.

Layers: a token embedding (tied with the output head through ``TiedLayerSpec("embed", ...)``), ``blocks``
pre-norm MLP blocks, a final LayerNorm and the head (``x @ embedding.T``). With a tensor-parallel group the
blocks' two linears are column / row parallel (the embedding stays replicated). Built with
``seed_layers=True``, layer ``i`` draws its weights after seeding ``base_seed + i``; :func:`plain_twin`
builds the same weights in one process with plain torch modules, under the same parameter names, so a
pipeline run can be compared name by name with a plain gradient-accumulation run.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from zerospeed.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

BASE_SEED = 1234


class Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, hidden) * 0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


def lm_head(embedding: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The output head tied to the embedding: logits over the vocabulary."""
    assert isinstance(embedding, Embedding)
    return x @ embedding.weight.t()


class MLPBlock(nn.Module):
    """``x + fc2(gelu(fc1(ln(x))))``; with ``tp_group`` the linears are column / row parallel."""

    def __init__(self, hidden: int, tp_group: Any = None) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        if tp_group is None:
            self.fc1: nn.Module = nn.Linear(hidden, 4 * hidden)
            self.fc2: nn.Module = nn.Linear(4 * hidden, hidden)
        else:
            from zerospeed.tensor_parallel import ColumnParallelLinear, RowParallelLinear

            self.fc1 = ColumnParallelLinear(hidden, 4 * hidden, tp_group=tp_group)
            self.fc2 = RowParallelLinear(4 * hidden, hidden, tp_group=tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class FinalNorm(nn.LayerNorm):
    pass


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def gpt_specs(vocab: int = 32, hidden: int = 16, blocks: int = 6, tp_group: Any = None) -> list[Any]:
    """The model's layers: embedding, ``blocks`` MLP blocks, final norm, tied head."""
    return ([TiedLayerSpec("embed", Embedding, vocab, hidden)]
            + [LayerSpec(MLPBlock, hidden, tp_group) for _ in range(blocks)]
            + [LayerSpec(FinalNorm, hidden),
               TiedLayerSpec("embed", Embedding, vocab, hidden, forward_fn=lm_head)])


def gpt_pipeline(num_stages: int, *, vocab: int = 32, hidden: int = 16, blocks: int = 6, tp_group: Any = None,
                 **kwargs: Any) -> PipelineModule:
    kwargs.setdefault("partition_method", "uniform")
    return PipelineModule(gpt_specs(vocab, hidden, blocks, tp_group), num_stages=num_stages, loss_fn=lm_loss,
                          seed_layers=True, base_seed=BASE_SEED, **kwargs)


class PlainGPT(nn.Module):
    """The pipeline model in one process, under the pipeline's parameter names (``<layer>.<name>``,
    ``tied_modules.embed.<name>``)."""

    def __init__(self, vocab: int = 32, hidden: int = 16, blocks: int = 6) -> None:
        super().__init__()
        torch.manual_seed(BASE_SEED)
        self.tied_modules = nn.ModuleDict({"embed": Embedding(vocab, hidden)})
        self.blocks = blocks
        for i in range(1, blocks + 1):
            torch.manual_seed(BASE_SEED + i)
            self.add_module(str(i), MLPBlock(hidden))
        torch.manual_seed(BASE_SEED + blocks + 1)
        self.add_module(str(blocks + 1), FinalNorm(hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        embed = self.tied_modules["embed"]
        x = embed(ids)
        for i in range(1, self.blocks + 2):
            x = getattr(self, str(i))(x)
        return lm_head(embed, x)


def token_batches(steps: int, micro_batches: int, micro_size: int, *, vocab: int = 32, seq: int = 8,
                  dp: int = 1, seed: int = 0) -> list[list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """``[step][micro][dp rank] -> (ids, labels)``: deterministic tokens, labels the next token."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(micro_batches):
            tokens = torch.randint(0, vocab, (dp, micro_size, seq + 1), generator=gen)
            step.append([(tokens[r, :, :-1].clone(), tokens[r, :, 1:].clone()) for r in range(dp)])
        out.append(step)
    return out


def rank_iterator(batches: list[list[list[tuple[torch.Tensor, torch.Tensor]]]], dp_rank: int
                  ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One data-parallel rank's micro-batches, step after step."""
    for step in batches:
        for micro in step:
            yield micro[dp_rank]


def plain_reference(batches: list[list[list[tuple[torch.Tensor, torch.Tensor]]]], *, lr: float, clip: float,
                    weight_decay: float = 0.01, vocab: int = 32, hidden: int = 16, blocks: int = 6
                    ) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Plain torch gradient accumulation over the same data (every data-parallel rank's micro-batch
    concatenated): per-step mean losses, pre-clip gradient norms, and the final parameters."""
    model = PlainGPT(vocab, hidden, blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    losses, norms = [], []
    for step in batches:
        total = 0.0
        for micro in step:
            ids = torch.cat([ids for ids, _ in micro])
            labels = torch.cat([labels for _, labels in micro])
            loss = lm_loss(model(ids), labels)
            (loss / len(step)).backward()
            total += float(loss.detach())
        losses.append(total / len(step))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))))
        opt.step()
        opt.zero_grad()
    return losses, norms, {name: p.detach().clone() for name, p in model.named_parameters()}


__all__ = ["Embedding", "MLPBlock", "FinalNorm", "lm_head", "lm_loss", "gpt_specs", "gpt_pipeline", "PlainGPT",
           "token_batches", "rank_iterator", "plain_reference", "BASE_SEED"]
