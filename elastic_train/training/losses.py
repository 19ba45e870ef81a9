"""What the loop minimises: a loss written as a sum over real targets, with their count.

A loss function is `loss_fn(model, batch) -> (loss_sum, num_targets)`. `batch` is a dict of tensors
on the model's device (see `data.MicroBatch.to_batch`): `tokens` [B, T] int64 right-padded with the
tokenizer's pad id, `attention_mask` [B, T] (1 on real tokens), `position_ids` [B, T], `labels`
[B, T] (the tokens, IGNORE_INDEX on padding, not shifted), `lengths` [B], plus any extra Parquet
column of the data set (e.g. `label` [B]). Fine-tuning data adds `loss_mask` [B, T] (1 on the answer
tokens), and `labels` then hold IGNORE_INDEX on every other token: the default loss counts and sums
only the answers' targets, and so does the loop's global target count (`MicroBatch.targets`).
The loop divides the gradient by the count of targets
over all ranks and micro-batches, so every target weighs the same whatever the world size: that
is why a loss returns a sum, never a mean. (Hugging Face's `model(labels=...)` returns a
per-micro-batch mean, its known gradient-accumulation bug: never used here.)

The default, `causal_lm_loss`, is next-token cross entropy summed over real targets. For a Hugging
Face causal LM whose logits are just its output head applied to the last hidden state, the loss is
computed in chunks along the sequence, each chunk's fp32 logits recomputed in backward, so the
logits of a large vocabulary never exist whole (128k x 16k tokens would be ~8 GB in fp32).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from elastic_train.data.batches import IGNORE_INDEX, LOSS_MASK

LOSS_CHUNK_TOKENS = 4096  # rows x positions of logits materialised at once
LossFn = Callable[[nn.Module, dict[str, torch.Tensor]], tuple[torch.Tensor, Any]]

# Hugging Face model types whose logits are `lm_head(last_hidden_state)` and nothing more (no soft
# capping, no logit scale): the chunked loss is exact for them. Others take the plain path.
PLAIN_HEAD_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gpt2", "gpt_neox",
    "phi3", "olmo", "olmo2", "smollm3", "starcoder2", "stablelm",
})


def is_hf_model(model: nn.Module) -> bool:
    """A transformers PreTrainedModel (checked by class name: transformers stays optional)."""
    return any(cls.__name__ == "PreTrainedModel" for cls in type(model).__mro__)


def logits_of(output: Any) -> torch.Tensor:
    """A model's logits: the output itself, or its `.logits` (Hugging Face style)."""
    logits = getattr(output, "logits", output)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"the model returned {type(output).__name__}: expected logits [B, T, V] "
                        "or an object with .logits")
    return logits


def hf_model_of(model: nn.Module) -> nn.Module | None:
    """The transformers model that computes `model`'s logits: the model itself, or a LoRA
    model's base with its adapters in place (`lora.LoraModel`: peft replaces the base's layers,
    so calling the base runs them); None for any other model."""
    if is_hf_model(model):
        return model
    peft = getattr(model, "peft", None)
    if peft is not None and getattr(model, "transformers_call", False):
        base = peft.get_base_model()
        return base if is_hf_model(base) else None
    return None


def forward(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's logits for a batch: Hugging Face models (LoRA on one too) get the mask and
    positions too."""
    if is_hf_model(model):
        return logits_of(model(input_ids=batch["tokens"], attention_mask=batch["attention_mask"],
                               position_ids=batch["position_ids"], use_cache=False))
    if hf_model_of(model) is not None:  # lora.LoraModel: the tokens, then what peft passes on
        return logits_of(model(batch["tokens"], attention_mask=batch["attention_mask"],
                               position_ids=batch["position_ids"]))
    return logits_of(model(batch["tokens"]))


def _chunk_loss_sum(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def _chunk_width(rows: int, chunk_tokens: int) -> int:
    return max(1, chunk_tokens // max(rows, 1))


def _chunked_hf_loss_sum(model: nn.Module, batch: dict[str, torch.Tensor], targets: torch.Tensor,
                         chunk_tokens: int) -> torch.Tensor:
    """Cross entropy over the output head applied chunk by chunk to the last hidden state."""
    hidden = model.base_model(input_ids=batch["tokens"], attention_mask=batch["attention_mask"],
                              position_ids=batch["position_ids"], use_cache=False)[0][:, :-1]
    head = model.get_output_embeddings()
    width = _chunk_width(hidden.shape[0], chunk_tokens)
    total = hidden.new_zeros((), dtype=torch.float32)
    for i in range(0, hidden.shape[1], width):
        h, t = hidden[:, i:i + width], targets[:, i:i + width]
        if torch.is_grad_enabled():  # recompute the chunk's logits in backward, never keep them
            total = total + checkpoint(_chunk_loss_sum, head, h, t, use_reentrant=False)
        else:
            total = total + _chunk_loss_sum(head, h, t)
    return total


def _logits_loss_sum(logits: torch.Tensor, targets: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """Cross entropy from whole logits, upcast to fp32 a chunk at a time."""
    width = _chunk_width(logits.shape[0], chunk_tokens)
    total = logits.new_zeros((), dtype=torch.float32)
    for i in range(0, targets.shape[1], width):
        chunk = logits[:, i:i + width].float()
        total = total + F.cross_entropy(chunk.reshape(-1, chunk.shape[-1]),
                                        targets[:, i:i + width].reshape(-1),
                                        ignore_index=IGNORE_INDEX, reduction="sum")
    return total


def chunked_head_applies(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return (is_hf_model(model) and getattr(config, "model_type", None) in PLAIN_HEAD_MODEL_TYPES
            and model.get_output_embeddings() is not None)


def causal_lm_loss(model: nn.Module, batch: dict[str, torch.Tensor],
                   chunk_tokens: int = LOSS_CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross entropy summed over real targets, and the number of real targets (an
    int64 tensor on the batch's device).

    Row i holds `lengths[i]` real tokens, then padding; target j (token j + 1) is real when
    j < lengths[i] - 1, which `labels` marks (IGNORE_INDEX on padding), and, with a `loss_mask`
    (fine-tuning data), when token j + 1 is an answer token (IGNORE_INDEX on the prompt too).
    """
    targets = batch["labels"][:, 1:]
    # the count stays a tensor on the batch's device: int() here would make the host wait for the
    # GPU before every micro-batch's forward (the loop needs it only once a step, if at all)
    if LOSS_MASK in batch:
        num_targets = (targets != IGNORE_INDEX).sum()
    else:
        num_targets = (batch["lengths"] - 1).clamp(min=0).sum()
    hf = hf_model_of(model)  # LoRA's base too: its head never makes a large vocabulary's logits
    if hf is not None and chunked_head_applies(hf):
        return _chunked_hf_loss_sum(hf, batch, targets, chunk_tokens), num_targets
    logits = forward(model, batch)[:, :-1]
    return _logits_loss_sum(logits, targets, chunk_tokens), num_targets


class LossModule(nn.Module):
    """The model and its loss as one module, so that DDP sees the whole loss in `forward` (its
    reducer is prepared there) and a loss may call any part of the model, e.g. `base_model`."""

    def __init__(self, model: nn.Module, loss_fn: LossFn | None = None) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn or causal_lm_loss

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
        result = self.loss_fn(self.model, batch)
        if self.loss_fn is not causal_lm_loss:
            check_loss_result(result, self.loss_fn)
        return result


def check_loss_result(result: Any, loss_fn: LossFn) -> None:
    """ConfigError naming `loss_fn` unless it returned (loss_sum, num_targets): a 0-dim tensor
    and a count. A loss that returns otherwise does so at every step, so the run ends with this
    reason instead of restarting into it (ConfigError is fatal on a worker)."""
    from elastic_train.config import ConfigError

    loss, count = (result if isinstance(result, tuple | list) and len(result) == 2
                   else (None, None))
    if (isinstance(loss, torch.Tensor) and loss.ndim == 0
            and (isinstance(count, int | float) or isinstance(count, torch.Tensor)
                 and count.numel() == 1)):
        return
    got = (f"a tensor of shape {tuple(result.shape)}" if isinstance(result, torch.Tensor)
           else f"{type(result).__name__} {result!r}"[:200])
    name = getattr(loss_fn, "__qualname__", repr(loss_fn))
    raise ConfigError(f"loss_fn {name} returned {got}: it must return (loss_sum, num_targets), "
                      "a 0-dim tensor summed over the targets it counted and their number")
