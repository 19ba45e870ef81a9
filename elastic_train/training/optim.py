"""Optimizer builder and the learning-rate schedule.

There is no LR scheduler object: `lr_at(step, ...)` is a pure function of the optimizer step, and
the loop calls `set_lr(optimizer, lr_at(step, ...))` before each step. The schedule's whole state is
therefore the step counter, which the checkpoint keeps anyway.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from types import ModuleType

import torch
from torch import nn

from elastic_train.config import OptimConfig


def import_bitsandbytes() -> ModuleType | None:
    """bitsandbytes (None if not installed), imported with the Hugging Face Hub off. On a CPU with
    AVX512-BF16 (the hosts of most GPU nodes) its import asks the Hub for a kernel
    (`kernels.get_kernel("kernels-community/quantization-bitsandbytes")`): code downloaded at run
    time into every process, or a wait on a cluster without internet. peft imports it to wrap
    any model (every LoRA run's driver and workers), transformers for QLoRA, adamw8bit itself;
    call this first. The Hub is off for this import alone (a user's HF_HUB_OFFLINE stays)."""
    if "bitsandbytes" in sys.modules:
        return sys.modules["bitsandbytes"]
    if importlib.util.find_spec("bitsandbytes") is None:
        return None
    hub = sys.modules.get("huggingface_hub.constants")
    if hub is None and importlib.util.find_spec("huggingface_hub") is not None:
        from huggingface_hub import constants as hub  # read by `kernels` at call time
    online = hub is not None and not hub.HF_HUB_OFFLINE
    if online:
        hub.HF_HUB_OFFLINE = True
    try:
        import bitsandbytes
    finally:
        if online:
            hub.HF_HUB_OFFLINE = False
    return bitsandbytes


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings (>= 2-D); leave norms and biases undecayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def build_optimizer(
    model: nn.Module, optim_cfg: OptimConfig, use_gpu: bool
) -> torch.optim.Optimizer:
    """AdamW ("adamw", fused on CUDA) or bitsandbytes AdamW8bit ("adamw8bit", CPU or GPU).

    Build it after moving the model to its device: fused AdamW checks its parameters' device.
    """
    groups = _param_groups(model, optim_cfg.weight_decay)
    betas = (optim_cfg.beta1, optim_cfg.beta2)
    if optim_cfg.name == "adamw":
        fused = True if use_gpu and torch.cuda.is_available() else None
        return torch.optim.AdamW(groups, lr=optim_cfg.lr, betas=betas, fused=fused)
    if optim_cfg.name == "adamw8bit":
        bnb = import_bitsandbytes()  # imported lazily: slow to import, only needed here
        if bnb is None:
            raise ValueError("optim.name=adamw8bit needs bitsandbytes, which is not installed: "
                             "pip install bitsandbytes")
        # Tensors under bnb's min_8bit_size (4096 elements) keep 32-bit state.
        return bnb.optim.AdamW8bit(groups, lr=optim_cfg.lr, betas=betas)
    raise ValueError(f"optim.name: unknown optimizer {optim_cfg.name!r} (known: adamw, adamw8bit)")


def lr_at(step: int, optim_cfg: OptimConfig, max_steps: int) -> float:
    """LR of optimizer step `step` (0-based): linear warmup, cosine decay, then flat.

    Steps 0 .. warmup_steps - 1 ramp lr * (step + 1) / warmup_steps; from warmup_steps the LR
    follows a cosine from lr down to min_lr_ratio * lr, reached at optim.schedule_steps (the
    run's last step, which check_inputs resolves it to; `max_steps` where it is unset) and kept
    after it.
    """
    peak = optim_cfg.lr
    if step < optim_cfg.warmup_steps:
        return peak * (step + 1) / optim_cfg.warmup_steps
    floor = optim_cfg.min_lr_ratio * peak
    decay_steps = (optim_cfg.schedule_steps or max_steps) - optim_cfg.warmup_steps
    progress = 1.0 if decay_steps <= 0 else min(1.0, (step - optim_cfg.warmup_steps) / decay_steps)
    return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak - floor)


def set_hyperparameters(optimizer: torch.optim.Optimizer, optim_cfg: OptimConfig) -> None:
    """The config's betas and weight decay in the groups `build_optimizer` made (the first
    decayed, the second not), after a checkpoint's `load_state_dict` put its own back: a resume
    with other optim.beta1, beta2 or weight_decay trains with them, as config.yaml says (the
    learning rate is set every step: `set_lr`)."""
    for i, group in enumerate(optimizer.param_groups):
        group["betas"] = (optim_cfg.beta1, optim_cfg.beta2)
        group["weight_decay"] = optim_cfg.weight_decay if i == 0 else 0.0


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by the tensors in `optimizer.state` (moments, 8-bit states, absmax, qmaps)."""
    seen: set[int] = set()
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.data_ptr() not in seen:
                seen.add(value.data_ptr())  # a tensor shared by several parameters counts once
                total += value.numel() * value.element_size()
    return total


# Bytes per parameter a data-parallel rank holds besides activations: fp32 weights (4) and
# gradients (4), the optimizer's state, the reduction's buffers (exact: a float64 sum, 8; ddp:
# DDP's fp32 buckets, 4) and a communication hook's state (PowerSGD's error feedback, 4; its P and
# Q are small). docs/performance.md's table says the same.
OPTIMIZER_STATE_BYTES = {"adamw": 8.0, "adamw8bit": 2.0}
REDUCTION_BUFFER_BYTES = {"exact": 8.0, "ddp": 4.0}
COMM_HOOK_STATE_BYTES = {"powersgd": 4.0}


def training_bytes_per_param(optim_name: str, grad_reduce: str, compression: str = "none") -> float:
    """Memory per parameter of plain data parallelism, activations left out; `grad_reduce` is
    the resolved reduction (exact or ddp)."""
    return (4.0 + 4.0 + OPTIMIZER_STATE_BYTES[optim_name] + REDUCTION_BUFFER_BYTES[grad_reduce]
            + COMM_HOOK_STATE_BYTES.get(compression, 0.0))
