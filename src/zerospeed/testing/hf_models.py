"""The small Hugging Face models every framework test shares (built from configs: nothing is downloaded).

A tiny GPT-2 (tied input/output embeddings) and a tiny Llama (untied, RoPE, RMSNorm, SwiGLU), with
dropout off so runs are deterministic, and a token dataset whose next token is predictable (so losses
fall within a few dozen steps). ``transformers`` is imported only when a builder is called (it is an
optional dependency: the ``integrations`` extra).
"""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 97
SEQ = 16


def tiny_gpt2_config(**overrides: Any) -> Any:
    from transformers import GPT2Config

    fields: dict[str, Any] = dict(vocab_size=VOCAB, n_positions=SEQ * 2, n_embd=32, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
                                  bos_token_id=0, eos_token_id=1, pad_token_id=1)
    fields.update(overrides)
    return GPT2Config(**fields)


def tiny_llama_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    fields: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ * 2,
                                  tie_word_embeddings=False, attention_dropout=0.0, bos_token_id=0,
                                  eos_token_id=1, pad_token_id=1)
    fields.update(overrides)
    return LlamaConfig(**fields)


def tiny_causal_lm(kind: str, *, seed: int = 0, **overrides: Any) -> Any:
    """A freshly initialized ``AutoModelForCausalLM`` of ``kind`` ("gpt2" or "llama"), seeded."""
    from transformers import AutoModelForCausalLM

    configs = {"gpt2": tiny_gpt2_config, "llama": tiny_llama_config}
    if kind not in configs:
        raise ValueError(f"kind={kind!r}: expected one of {sorted(configs)}")
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(configs[kind](**overrides))


def token_rows(n: int, *, seed: int = 0, seq: int = SEQ) -> torch.Tensor:
    """``n`` rows of ``seq`` token ids following ``t[i+1] = (3 * t[i] + 1) % VOCAB`` from a random start
    (ids 2..VOCAB-1 start a row), so a small model learns the next token quickly."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.empty(n, seq, dtype=torch.long)
    rows[:, 0] = torch.randint(2, VOCAB, (n,), generator=gen)
    for i in range(1, seq):
        rows[:, i] = (3 * rows[:, i - 1] + 1) % VOCAB
    return rows


def lm_batch(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The keyword arguments of a causal-LM training forward on token rows ``ids`` (labels = inputs:
    the model shifts them itself)."""
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


class LossOf(torch.nn.Module):
    """``model(**lm_batch(ids)).loss`` as a one-argument module, so a plain single-process reference
    loop (``zerospeed.testing.reference.train_reference``, which calls ``model(inputs)``) trains an HF
    model exactly as an engine does through ``engine(**lm_batch(ids))``."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(**lm_batch(ids)).loss


class TokenDataset(torch.utils.data.Dataset):
    """Rows of :func:`token_rows` as HF causal-LM examples: ``input_ids``, ``attention_mask``, ``labels``."""

    def __init__(self, n: int, *, seed: int = 0, seq: int = SEQ):
        self.rows = token_rows(n, seed=seed, seq=seq)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.rows[i]
        return {"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row.clone()}


__all__ = ["SEQ", "VOCAB", "LossOf", "TokenDataset", "lm_batch", "tiny_causal_lm", "tiny_gpt2_config", "tiny_llama_config", "token_rows"]
