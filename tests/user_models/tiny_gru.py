"""A user's own language model, outside the package: named as `model.name: tiny_gru:build`."""

from __future__ import annotations

import torch
from torch import nn


class TinyGRU(nn.Module):
    """Embedding -> GRU -> vocabulary head: tokens [B, T] -> logits [B, T, V]."""

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.gru = nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(self.embed(tokens))
        return self.head(out)


def build(vocab_size: int, max_seq_len: int, hidden: int = 32) -> nn.Module:
    return TinyGRU(vocab_size, hidden)


def broken(vocab_size: int, max_seq_len: int) -> nn.Module:
    raise RuntimeError("this factory is broken on purpose")


def not_a_module(vocab_size: int, max_seq_len: int):
    return {"vocab_size": vocab_size}


class FailsInForward(TinyGRU):
    """Builds fine (the driver's checks pass) and raises on the workers' first step."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        raise ValueError("this model fails in forward on purpose")


def fails_in_forward(vocab_size: int, max_seq_len: int) -> nn.Module:
    return FailsInForward(vocab_size, 8)
