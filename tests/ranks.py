"""The dist tier's harness: a function run on N real gloo processes, torn down cleanly.

A process group must die while the interpreter is alive. `destroy_process_group` alone does not
destroy it while a DDP model, its reducer or a communication hook's state still holds a reference:
the group then dies in interpreter finalisation, where gloo's worker threads can abort the process
("terminate called without an active exception", SIGABRT; seen once in CI on the bf16 hook test;
pytorch/pytorch#179291 describes the same crash). So the body runs in its own frame, returns
(dropping its models), all ranks meet at a barrier, garbage is collected, and only then is the group
destroyed.

Starting a process costs more here than most tests' work: `spawn` imports torch and FSDP afresh
in each rank (4-5 cpu-s each on a loaded 2-core machine, 22 s of wall time for three ranks).
`start_method="forkserver"` forks each rank from one server process that imported them once per
pytest session (0.3-1 s for 2-3 ranks). A forked rank sees the environment of the moment the
server started, not the test's: a test that sets environment variables for its ranks spawns.
"""

from __future__ import annotations

import gc
import itertools
import multiprocessing
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_calls = itertools.count()
# what the fork server imports once (nothing that runs a parallel op: a fork keeps no threads);
# FSDP2 imports torch._dynamo at its first fully_shard (2 cpu-s)
FORKSERVER_PRELOAD = ["numpy.random", "torch", "torch._dynamo", "torch.distributed.fsdp",
                      "elastic_train.training.sharding", "elastic_train.training.step"]


def run_ranks(body: Callable[..., None], world_size: int, tmp_path: Path, *args,
              start_method: str = "spawn") -> None:
    """`body(rank, world_size, *args)` on `world_size` gloo processes, started by `start_method`
    (spawn, or forkserver: module docstring); raises if any fails."""
    if start_method == "forkserver":
        multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)  # until the server starts
    init_file = str(tmp_path / f"gloo-init-{next(_calls)}-{world_size}")
    mp.start_processes(_rank_main, args=(body, world_size, init_file, args), nprocs=world_size,
                       start_method=start_method)


def _rank_main(rank: int, body: Callable[..., None], world_size: int, init_file: str,
               args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    body(rank, world_size, *args)
    dist.barrier()  # no rank tears down while a peer may still talk to it
    gc.collect()  # a DDP model or hook state in a reference cycle would keep the group alive
    dist.destroy_process_group()
