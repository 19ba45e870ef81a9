"""Defaults that depend on the device: what a user who set none gets on GPU workers.

Four keys default to None ("auto") and are settled from the config alone (no cluster, no torch),
three of them here as the config loads, the micro-batch with the data set (preflight/inputs.py),
so the checks, the workers and the saved config.yaml all see the value that ran. On CPU workers
they are what they always were; on GPU workers:
- `train.precision`: bf16 (autocast; fp32 weights, gradients and optimizer state). fp32 matmuls
  leave most of a GPU's tensor cores idle. A GPU without bf16 (before Ampere) wants fp16: set it.
- `data.micro_batch_tokens`: the largest divisor of the global batch up to 16384 tokens that
  leaves each of `scaling.max_workers` workers a micro-batch a step: few, large micro-batches
  keep the GPU's matmuls large and its kernel launches few (a CPU wants small ones: cache).
- `data.pad_multiple`: 64: a micro-batch's columns rounded up on the device, so its shapes repeat
  (the caching allocator and compiled graphs reuse them; tensor-core tiles stay whole).
- `scaling.cpus_per_worker`: 4, for the data path's thread and the loop's host work beside the
  GPU (Ray reserves 1 by default, and sets the worker's thread count to what it reserved).
"""

from __future__ import annotations

from typing import Any

CPU_MICRO_BATCH_TOKENS = 2048
GPU_MICRO_BATCH_TOKENS = 16384  # the most tokens of one micro-batch chosen on a GPU
GPU_CPUS_PER_WORKER = 4.0
GPU_PAD_MULTIPLE = 64


def gpu_micro_batch_tokens(global_batch_tokens: int, max_workers: int, max_seq_len: int | None) -> int:
    """The GPU default of `data.micro_batch_tokens` (see the module docstring); the CPU one when
    no divisor fits (the config's checks then say what is wrong)."""
    most = min(GPU_MICRO_BATCH_TOKENS, global_batch_tokens // max(max_workers, 1))
    for tokens in range(most, max(max_seq_len or 1, 1) - 1, -1):
        if tokens > 0 and global_batch_tokens % tokens == 0:
            return tokens
    return CPU_MICRO_BATCH_TOKENS


def resolve_device_defaults(cfg: Any) -> None:
    """Settle the "auto" keys of `cfg` (a Config) for its workers' device, in place."""
    gpu = bool(cfg.scaling.use_gpu)
    if cfg.train.precision == "auto":
        cfg.train.precision = "bf16" if gpu else "fp32"
    # data.micro_batch_tokens, unset, follows from the data set once it is known, after a
    # resume took its checkpoint's (preflight/inputs.py fill_batch_tokens: on CPU the longest row
    # and the data's size within the step; on GPU `gpu_micro_batch_tokens`). Not here: derived
    # from scaling.max_workers as the config loads, it looked set, and a resume on fewer workers
    # was refused for a micro-batch the user never set
    if cfg.data.pad_multiple is None:
        cfg.data.pad_multiple = GPU_PAD_MULTIPLE if gpu else 1
    if cfg.scaling.cpus_per_worker is None:
        cfg.scaling.cpus_per_worker = GPU_CPUS_PER_WORKER if gpu else 1.0
