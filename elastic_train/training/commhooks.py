"""DDP's knobs and communication hooks on the ddp reduction (`train.grad_compression`), and the
per-rank state of PowerSGD.

fp16 and bf16 cast each gradient bucket to half precision for its all-reduce (half the bytes, about
3 and 2 significant digits kept) and back; they keep no state. PowerSGD (Vogels et al., 2019)
all-reduces a rank-r approximation P Q^T of each gradient matrix instead of the matrix, and keeps
per rank what the approximation left out (error feedback, added to the next step's gradient) and
the last Q (warm start): that state differs from rank to rank, so each rank writes its own into its
shard of the checkpoint (`comm_hook.shardNNN.pt`), and a resume at the same world size gives each
rank its own back. At another world size the saved states do not fit the new ranks' data: PowerSGD
starts again with `train.powersgd_warmup_steps` of plain all-reduce.

PowerSGD keys its state by DDP bucket index. DDP rebuilds its buckets once, after the first
step, in the order gradients became ready; a resumed process would then compress its first step
with the constructor's layout and state saved under the rebuilt one. With
`find_unused_parameters=True` DDP never rebuilds (torch 2.x `Reducer::should_rebuild_buckets`),
so every process of a run has the constructor's layout, a function of the model alone. Its cost is
one walk of the autograd graph per step.
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations as objects.
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
from torch.nn.parallel import DistributedDataParallel

from elastic_train.config import TrainConfig

# What a PowerSGDState holds beyond its hyperparameters (which the config gives again).
_POWERSGD_TENSOR_DICTS = ("error_dict", "p_memory_dict", "q_memory_dict")
_POWERSGD_COUNTERS = ("iter", "start_powerSGD_iter", "total_numel_before_compression",
                      "total_numel_after_compression", "next_stats_report")


def bf16_hook(process_group: dist.ProcessGroup | None,
              bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's `bf16_compress_hook` (cast the bucket to bfloat16, all-reduce the mean, cast back
    in place), under another name: DDP refuses a hook of that name in a torch built without CUDA
    (2.13 `_check_comm_hook`), although gloo all-reduces bfloat16 on the CPU."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        return buffer.copy_(fut.value()[0])

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


HALF_HOOKS = {"fp16": default_hooks.fp16_compress_hook, "bf16": bf16_hook}


def ddp_kwargs(t: TrainConfig) -> dict[str, Any]:
    """DistributedDataParallel's keyword arguments for this config."""
    kwargs: dict[str, Any] = {"bucket_cap_mb": t.ddp_bucket_mb,
                              "gradient_as_bucket_view": t.gradient_as_bucket_view}
    if t.grad_compression == "powersgd":
        kwargs["find_unused_parameters"] = True  # one bucket layout for good (module docstring)
    return kwargs


def register_comm_hook(model: torch.nn.Module, t: TrainConfig) -> PowerSGDState | None:
    """Register `train.grad_compression`'s hook on a DDP model; the PowerSGD state, if any.

    A model that is not in DDP (one worker: Ray does not wrap it) has nothing to compress."""
    if t.grad_compression == "none" or not isinstance(model, DistributedDataParallel):
        return None
    if t.grad_compression in HALF_HOOKS:
        model.register_comm_hook(None, HALF_HOOKS[t.grad_compression])
        return None
    state = new_powersgd_state(t)
    hook = powerSGD_hook.powerSGD_hook
    if dist.get_backend() == "gloo":
        hook = synchronous(hook)
    model.register_comm_hook(state, hook)
    return state


def synchronous(hook: Callable) -> Callable:
    """`hook`, returning only once all of its collectives are done (gloo).

    PowerSGD issues a bucket's second and third all-reduces from the callbacks of its first. NCCL
    completes a future as its work is queued, so those run at once, in order, on the backward
    thread. Gloo completes it when the work is done, on one of its own threads: there they can
    come before or after the all-reduce that DDP issues on the backward thread (the map of used
    parameters, with find_unused_parameters), in another order on each rank, and gloo pairs
    collectives by order ("Received data size doesn't match expected size", seen here within a
    few steps). Waiting here orders them; on the CPU it costs the overlap of the hook's
    communication with the rest of the backward."""

    def hook_now(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        future = hook(state, bucket)
        future.wait()
        return future

    return hook_now


def new_powersgd_state(t: TrainConfig) -> PowerSGDState:
    """A fresh state: plain all-reduce for the warm-up steps, then rank-r compression with error
    feedback and warm start (torch's recommended settings); the same seed on every rank, so
    that every rank draws the same random Q."""
    return PowerSGDState(
        process_group=None, matrix_approximation_rank=t.powersgd_rank,
        start_powerSGD_iter=t.powersgd_warmup_steps, use_error_feedback=True, warm_start=True,
        random_seed=0)


def powersgd_state_dict(state: PowerSGDState) -> dict[str, Any]:
    """This rank's state as CPU tensors and numbers (loadable with torch.load(weights_only=True))."""
    kind, keys, pos, has_gauss, cached = state.rng.get_state()
    out: dict[str, Any] = {name: {int(k): v.detach().to("cpu", copy=True)
                                  for k, v in getattr(state, name).items()}
                           for name in _POWERSGD_TENSOR_DICTS}
    out.update({name: int(getattr(state, name)) for name in _POWERSGD_COUNTERS})
    out["rng"] = [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                  float(cached)]
    return out


def load_powersgd_state(state: PowerSGDState, saved: dict[str, Any],
                        device: torch.device) -> None:
    """Put a rank's saved state (`powersgd_state_dict`) back into `state`, on `device`."""
    for name in _POWERSGD_TENSOR_DICTS:
        getattr(state, name).clear()
        getattr(state, name).update({int(k): v.to(device) for k, v in saved[name].items()})
    for name in _POWERSGD_COUNTERS:
        setattr(state, name, saved[name])
    kind, keys, pos, has_gauss, cached = saved["rng"]
    state.rng.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def forget_powersgd_memory(state: PowerSGDState | None) -> None:
    """After a skipped step (a non-finite gradient; an fp16 overflow is one): the error feedback
    and warm-start Q hold that step's inf or nan, and would pass them on to every later step.
    Drop them; the next step starts them again from zeros and from the (shared) RNG, alike on
    every rank, since every rank skips the same steps."""
    if state is None:
        return
    for name in _POWERSGD_TENSOR_DICTS:
        getattr(state, name).clear()
