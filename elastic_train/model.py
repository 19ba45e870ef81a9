"""A small decoder-only GPT over bytes, the model registry and the token loss.

`build_model(model_cfg, max_seq_len)` looks `model_cfg.name` up in `MODELS`. Initialisation draws
from the global torch RNG, so callers fix it with `torch.manual_seed` before building: every rank
then builds the same weights without a broadcast.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from elastic_train.config import ModelConfig

IGNORE_INDEX = -100


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention; the mask also hides right padding from real tokens."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + learned position embeddings, pre-LN blocks, final LN, head tied to the embedding."""

    def __init__(self, cfg: ModelConfig, max_seq_len: int) -> None:
        super().__init__()
        self.max_seq_len = max_seq_len
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(max_seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self._init_weights(cfg.n_layer)

    def _init_weights(self, n_layer: int) -> None:
        # GPT-2: N(0, 0.02), and the projections that write into the residual stream scaled down
        # by sqrt(2 * n_layer) so the stream's variance does not grow with depth.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: LongTensor[B, T] -> logits [B, T, vocab]."""
        t = tokens.shape[1]
        if t > self.max_seq_len:
            raise ValueError(
                f"sequence of {t} tokens is longer than max_seq_len={self.max_seq_len}"
            )
        pos = torch.arange(t, device=tokens.device)
        x = self.drop(self.wte(tokens) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_gpt(model_cfg: ModelConfig, max_seq_len: int) -> nn.Module:
    """The byte-level GPT of `model_cfg`, with positions up to `max_seq_len`."""
    return GPT(model_cfg, max_seq_len)


MODELS: dict[str, Callable[[ModelConfig, int], nn.Module]] = {"gpt": build_gpt}


def build_model(model_cfg: ModelConfig, max_seq_len: int) -> nn.Module:
    """Build the model registered under `model_cfg.name`; ValueError naming it when unknown."""
    builder = MODELS.get(model_cfg.name)
    if builder is None:
        raise ValueError(
            f"model.name: unknown model {model_cfg.name!r} (known: {', '.join(sorted(MODELS))})"
        )
    return builder(model_cfg, max_seq_len)


def token_loss_sum(
    model: nn.Module, tokens: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy of right-padded rows, and the number of real targets.

    Row i holds `lengths[i]` real tokens, then padding. Target j (token j + 1) is real when
    j < lengths[i] - 1. Summing (not averaging) lets the caller divide by the global target count,
    so every real token weighs the same whatever the micro-batch or world size.
    """
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    positions = torch.arange(targets.shape[1], device=tokens.device)
    targets[positions[None, :] >= (lengths.to(tokens.device)[:, None] - 1)] = IGNORE_INDEX
    logits = model(inputs).float()
    loss_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    n_targets = int((lengths - 1).clamp(min=0).sum())
    return loss_sum, n_targets


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (the tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())


def model_flops_per_token(model_cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token, PaLM appendix B: 6 N + 12 L d T.

    N counts the weights used in matmuls: 12 d^2 per layer plus the (tied) vocab x d head; the
    position table, layer norms and biases do no matmul and are left out. 12 L d T is the attention
    score and value matmuls over a context of `seq_len`, forward and backward.
    """
    n_layer, d = model_cfg.n_layer, model_cfg.d_model
    n_matmul = 12 * n_layer * d * d + model_cfg.vocab_size * d
    return 6.0 * n_matmul + 12.0 * n_layer * d * seq_len
