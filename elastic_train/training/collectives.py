"""The loop's few collectives over torch.distributed, each an identity without a process group.

All-reduces are timed (`collective_seconds`): a rank's step time less its time in collectives is
its own work, which tells a straggler from the ranks that wait for it.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gather_from_all(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order (just [value] without a process group)."""
    if is_distributed():
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, value)
        return out
    return [value]


_collective_s = 0.0  # this process's running time inside the loop's all-reduces (one loop a process)


def timed_all_reduce(t: torch.Tensor) -> None:
    """dist.all_reduce, timed: a rank's step time less its time in collectives is its own work
    (busy time). Every rank of a synchronous step takes as long as the slowest; only the busy
    time tells the straggler from the ranks that wait for it."""
    global _collective_s
    t0 = time.perf_counter()
    dist.all_reduce(t)
    _collective_s += time.perf_counter() - t0


def collective_seconds() -> float:
    """Seconds this process has spent in the loop's all-reduces so far."""
    return _collective_s


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum a few numbers over all ranks in one collective (identity without a process group:
    then the numbers never go to the device and back, which on a GPU would wait for its queue)."""
    if not is_distributed():
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=device)
    timed_all_reduce(t)
    return t.tolist()


def rank_slots(world_size: int, rank: int, *values: float) -> list[float]:
    """One vector of `world_size` slots per value, zero but for this rank's slot: summed over
    ranks (in the step's one all-reduce), every rank's values, in rank order."""
    out = [0.0] * (world_size * len(values))
    for i, value in enumerate(values):
        out[i * world_size + rank] = value
    return out
