"""LoRA fine-tuning (`model.lora.r > 0`): the model's weights frozen, low-rank adapters (peft)
trained, and only the adapters in the checkpoint.

Why a wrapper whose `state_dict` holds the adapters alone: everything that saves, restores,
reduces and optimizes already goes through `state_dict()` and the parameters that require a
gradient (`ExactGradSum`, the optimizer's groups, the checkpoint's shards and signature). With
the frozen base left out of the state dict, a LoRA checkpoint holds the adapters (and their
optimizer state) only, and every guarantee of a full fine-tune holds for them unchanged: the
exact reduction sums only their gradients, so a step is the same to the bit at any world size.

The base is rebuilt from its own source on every start (the hf folder, the seed), so the
checkpoint must know which base its adapters belong to: the state dict carries `BASE_KEY`, the
SHA-256 of the base's tensors (names, dtypes, shapes, bytes) as they were loaded, before any cast,
and loading adapters onto a base of another hash is refused, naming both. `model.base_dtype=bf16`
casts the frozen base to bf16 after hashing; peft keeps the adapters in fp32 (its
`autocast_adapter_dtype`), so their gradients and AdamW state are fp32.

QLoRA (`model.lora.load_in_4bit`) needs bitsandbytes' CUDA kernels: refused on CPU by name here
and in the config's validation.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from elastic_train.config import ConfigError, ModelConfig

BASE_KEY = "lora_base_sha256"  # the base's hash, a uint8 tensor of 32 bytes in the state dict
LORA_EXTRA_HINT = "pip install 'elastic_train[lora]'"


def require_peft() -> Any:
    """The peft module; ValueError naming the extra when it is missing."""
    try:
        import peft
    except ImportError as exc:
        raise ValueError(f"model.lora needs peft, which is not installed ({exc}): "
                         f"{LORA_EXTRA_HINT}") from None
    return peft


def base_hash(model: nn.Module) -> bytes:
    """SHA-256 of a model's state dict: every tensor's name, dtype, shape and bytes, in order."""
    digest = hashlib.sha256()
    state = model.state_dict()
    if any(t.is_meta for t in state.values()):  # the driver's shape-only model: no values
        return bytes(32)
    for name, tensor in state.items():
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.digest()


class LoraModel(nn.Module):
    """A peft LoRA model whose state dict is its trainable adapters and the base's hash.

    `forward(tokens)` returns the peft model's output (logits in `.logits`); `peft` is the
    `PeftModel` itself (export saves or merges it)."""

    def __init__(self, peft_model: nn.Module, digest: bytes) -> None:
        super().__init__()
        self.peft = peft_model
        self.register_buffer(BASE_KEY, torch.tensor(list(digest), dtype=torch.uint8))

    def forward(self, tokens: torch.Tensor, **kwargs: Any) -> Any:
        return self.peft(input_ids=tokens, use_cache=False, **kwargs)

    def _kept(self) -> set[str]:
        return {name for name, p in self.named_parameters() if p.requires_grad} | {BASE_KEY}

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The adapters and the base's hash only (the frozen base is rebuilt, never saved)."""
        kept = self._kept()
        full = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        return type(full)((k, v) for k, v in full.items() if k[len(prefix):] in kept)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load adapters saved by `state_dict`, refusing those of another base (ConfigError)."""
        saved = state_dict.get(BASE_KEY)
        ours = getattr(self, BASE_KEY)
        if saved is not None and not torch.equal(saved.to(ours.device, ours.dtype), ours):
            # ConfigError: a restart would fail the same way, so the run stops with this reason
            raise ConfigError(
                "the checkpoint's LoRA adapters were trained on another base model (base sha256 "
                f"{bytes(saved.tolist()).hex()[:16]}..., this one's {bytes(ours.tolist()).hex()[:16]}"
                "...): resume on the base model.path it was trained on")
        missing, unexpected = super().load_state_dict(state_dict, strict=False, assign=assign)
        missing = [name for name in missing if name in self._kept()]
        if strict and (missing or unexpected):
            raise RuntimeError(f"LoRA state dict: missing {missing[:5]}, unexpected "
                               f"{list(unexpected)[:5]}")
        return missing, unexpected


def apply_lora(model: nn.Module, model_cfg: ModelConfig) -> LoraModel:
    """`model` frozen (hashed, then cast to `model.base_dtype`) with LoRA adapters of
    `model.lora` on it. ValueError naming the key for a missing peft, no module matching
    `target_modules`, or QLoRA without a GPU."""
    peft = require_peft()
    lora = model_cfg.lora
    if lora.load_in_4bit and not torch.cuda.is_available():
        raise ValueError("model.lora.load_in_4bit (QLoRA) needs a CUDA GPU: bitsandbytes' 4-bit "
                         "kernels do not run on CPU")
    if lora.load_in_4bit:
        raise ValueError("model.lora.load_in_4bit (QLoRA) is not built yet: use "
                         "model.base_dtype=bf16 for a half-size frozen base")
    digest = base_hash(model)
    if model_cfg.base_dtype == "bf16":
        model.to(torch.bfloat16)
    settings = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                               target_modules=list(lora.target_modules) or None)
    try:
        wrapped = peft.get_peft_model(model, settings, autocast_adapter_dtype=True)
    except ValueError as exc:
        raise ValueError(f"model.lora.target_modules: {' '.join(str(exc).split())[:300]}") from None
    for _, p in wrapped.named_parameters():  # adapters in fp32 whatever the base's dtype
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    return LoraModel(wrapped, digest)
