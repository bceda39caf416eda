"""A small GPT-style decoder: pre-LN blocks, causal attention through SDPA, tied LM head.

Kept deliberately plain (no fused kernels, no dropout) so it runs anywhere torch runs and the
demo exercises the engine, not the model. ``GPTConfig(moe_experts=E)`` makes it a mixture of experts:
the MLP of every ``moe_every``-th block becomes ``zerospeed.moe.layer.MoE`` (DeepSpeed's layer) over
``E`` experts, ``ep_size``-way expert parallel, and the returned loss gains ``moe_aux_coef`` times the
layers' load-balancing losses. With ``moe_experts=0`` (the default) only torch is imported.

Progressive layer dropping: ``forward`` takes the engine's ``progressive_layer_drop``/``pld_theta`` keywords
(config section ``progressive_layer_drop``); in training each block is then skipped with probability
``1 - p_l`` and a kept block's attention and MLP outputs are scaled by ``1 / p_l``
(``zerospeed.layer_drop``). The draws come from a generator of the model's own, seeded with
``GPTConfig.pld_seed``, so every rank skips the same blocks (ZeRO-3 gathers and expert all-to-alls stay
matched). Without the keywords, and in eval mode, every block runs as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    # Mixture of experts (0 experts: every block dense, the model unchanged)
    moe_experts: int = 0
    moe_every: int = 2  # blocks moe_every-1, 2*moe_every-1, ... get an MoE MLP (every other block by default)
    moe_k: int = 2  # experts per token
    ep_size: int = 1  # expert-parallel degree: must divide moe_experts and the data-parallel size
    moe_drop_tokens: bool = False  # False: dropless (no capacity); True: DeepSpeed's capacity and dropping
    moe_capacity_factor: float = 1.0
    moe_aux_coef: float = 0.01  # weight of the load-balancing loss in the returned loss
    # DeepSpeed samples top-2's second expert with Gumbel noise by default; off here, so routing is a
    # function of the weights alone and a run can be reproduced (and checked) exactly
    moe_second_expert_sampling: bool = False
    pld_seed: int = 0  # seed of the layer-drop draws (the same on every rank)

    def __post_init__(self) -> None:
        if self.moe_experts < 0 or self.moe_every < 1:
            raise ValueError(f"GPTConfig: moe_experts={self.moe_experts} must be >= 0 and moe_every="
                             f"{self.moe_every} >= 1")
        if self.moe_experts and not self.moe_blocks():
            raise ValueError(f"GPTConfig: moe_every={self.moe_every} exceeds n_layers={self.n_layers}, so no "
                             f"block would get experts; use moe_every <= n_layers")

    def moe_blocks(self) -> tuple[int, ...]:
        """Indices of the blocks whose MLP is a mixture of experts (none for a dense model)."""
        if not self.moe_experts:
            return ()
        return tuple(i for i in range(self.n_layers) if i % self.moe_every == self.moe_every - 1)


def _scaled(branch: torch.Tensor, scale: float) -> torch.Tensor:
    """A residual branch times ``scale`` (untouched at 1.0, so a run without layer drop is bit-identical)."""
    return branch if scale == 1.0 else branch * scale


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, c // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                 nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(self, x: torch.Tensor, branch_scale: float = 1.0) -> torch.Tensor:
        """``branch_scale``: the factor of both residual branches (1 / keep probability under layer drop)."""
        x = x + _scaled(self.attn(self.ln1(x)), branch_scale)
        return x + _scaled(self.mlp(self.ln2(x)), branch_scale)


class MoEBlock(nn.Module):
    """A block whose MLP is DeepSpeed's ``MoE`` layer; ``forward`` also returns its load-balancing loss.

    Built from an initialized dense block, so every expert starts as a copy of that block's MLP (what
    DeepSpeed's ``Experts`` does with the module it is given): the start does not depend on which rank
    holds which expert, and an ``ep_size=2`` run starts exactly where an ``ep_size=1`` run does.
    """

    def __init__(self, dense: Block, cfg: GPTConfig):
        super().__init__()
        from zerospeed.moe.layer import MoE  # only MoE models need zerospeed

        self.ln1, self.attn, self.ln2 = dense.ln1, dense.attn, dense.ln2
        self.mlp = MoE(cfg.d_model, dense.mlp, num_experts=cfg.moe_experts, ep_size=cfg.ep_size, k=cfg.moe_k,
                       capacity_factor=cfg.moe_capacity_factor, drop_tokens=cfg.moe_drop_tokens,
                       top2_2nd_expert_sampling=cfg.moe_second_expert_sampling)

    def forward(self, x: torch.Tensor, branch_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + _scaled(self.attn(self.ln1(x)), branch_scale)
        out, l_aux, _ = self.mlp(self.ln2(x))
        return x + _scaled(out, branch_scale), l_aux


class GPT(nn.Module):
    """Next-token model; ``forward(idx, targets)`` returns the mean cross-entropy when targets are given
    (plus ``moe_aux_coef`` times the load-balancing losses of the MoE blocks, if any)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied: fewer parameters, better small-model loss
        self.apply(self._init)
        for block in self.blocks:  # GPT-2's scaled init keeps the residual stream's variance steady
            for proj in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(proj.weight, std=0.02 / (2 * cfg.n_layers) ** 0.5)
        for i in cfg.moe_blocks():  # after the init: the experts copy the initialized MLP
            self.blocks[i] = MoEBlock(self.blocks[i], cfg)
        self._pld_rng: torch.Generator | None = None  # made by the first layer-drop forward

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                progressive_layer_drop: bool = False, pld_theta: float = 1.0) -> torch.Tensor:
        """``progressive_layer_drop``/``pld_theta``: the engine's layer-drop keywords (used in training only)."""
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        aux: list[torch.Tensor] = []
        scales = self._layer_drop_scales(progressive_layer_drop, pld_theta)
        for block, scale in zip(self.blocks, scales, strict=True):
            if scale is None:  # dropped in this forward: the block is the identity
                continue
            if isinstance(block, MoEBlock):
                x, l_aux = block(x, scale)
                aux.append(l_aux)
            else:
                x = block(x, scale)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
        if aux:
            loss = loss + self.cfg.moe_aux_coef * torch.stack(aux).float().sum()
        return loss

    def _layer_drop_scales(self, progressive_layer_drop: bool, pld_theta: float) -> tuple[float | None, ...]:
        """Per block: None (skipped) or its branch scale; all 1.0 unless training with layer drop on."""
        if not (progressive_layer_drop and self.training):
            return (1.0,) * len(self.blocks)
        from zerospeed.layer_drop import LayerDropPlan  # only layer-drop runs need zerospeed

        if self._pld_rng is None:
            self._pld_rng = torch.Generator().manual_seed(self.cfg.pld_seed)
        return LayerDropPlan.draw(len(self.blocks), pld_theta, generator=self._pld_rng).scales

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 0.7,
                 top_k: int = 20, generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample a continuation of ``idx`` (1 x T), token by token, over the last ``seq_len`` tokens."""
        for _ in range(new_tokens):
            logits = self(idx[:, -self.cfg.seq_len:])[:, -1].float() / temperature
            kth = torch.topk(logits, top_k).values[:, -1:]
            probs = torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx
