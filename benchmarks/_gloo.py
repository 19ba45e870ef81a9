"""Helpers of the benchmarks that run on real gloo processes (sharding_*.py): the process's peak
resident bytes, and the ranks' figures gathered into one JSON file by rank 0."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist


def vm_hwm_bytes() -> int:
    """This process's peak resident bytes (Linux VmHWM), -1 where /proc has none."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return -1


def gather_and_finish(figures: dict, out: str | Path) -> None:
    """Every rank's `figures`, as a JSON list in rank order, written to `out` by rank 0; then the
    process group torn down once every rank is past the write."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, figures)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()
