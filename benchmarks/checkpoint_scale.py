"""Checkpoint at scale: write, restore and blocked seconds against model size and world size, with
the state written by rank 0 alone (one shard: how checkpoints were written before) and spread over
every rank (W shards, `checkpoint.snapshot(shard=rank, shards=W)`).

W processes (no process group needed: the state is replicated, so every rank builds the same model
and AdamW state from the same seed) each snapshot their share (the blocked part), write it into one
folder on local disk, then every rank restores the whole checkpoint (as a restart does). Reported
per (size, W, mode): blocked_s (slowest rank's snapshot), write_s (from the start to the last
rank's manifest: what a checkpoint costs before it can be committed), restore_s (slowest rank's
load_checkpoint) and the checkpoint's bytes. Memory: every process holds the model, its AdamW state
and its snapshot, so W x 20 bytes per parameter must fit the machine.

Run: .venv/bin/python benchmarks/checkpoint_scale.py [--sizes 25,100] [--world-sizes 1,2]
Prints a table, then one JSON line of figures (the last line of stdout).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import tempfile
import time
from pathlib import Path

import torch

from elastic_train.config import ModelConfig, OptimConfig
from elastic_train.training.checkpoint import load_checkpoint, snapshot, write_checkpoint
from elastic_train.training.model import build_model, count_parameters
from elastic_train.training.optim import build_optimizer

# GPT shapes of about 25M, 100M, 300M and 1B parameters (byte vocabulary, 512 positions)
SIZES = {25: ModelConfig(d_model=512, n_layer=8, n_head=8),
         100: ModelConfig(d_model=1024, n_layer=8, n_head=16),
         300: ModelConfig(d_model=1536, n_layer=10, n_head=16),
         1000: ModelConfig(d_model=2048, n_layer=20, n_head=16)}


def build(size: int):
    torch.manual_seed(0)
    model = build_model(SIZES[size], 512)
    optimizer = build_optimizer(model, OptimConfig(), use_gpu=False)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # AdamW's moments exist, as after any step
    return model, optimizer


def _rank(rank: int, world: int, shards: int, size: int, folder: str, start, out) -> None:
    torch.set_num_threads(1)
    model, optimizer = build(size)
    start.wait()  # every rank built: the clock starts together
    t0 = time.perf_counter()
    blocked = write = 0.0
    if rank < shards:
        snap = snapshot(model, optimizer, None, {"step": 1}, {}, world, shard=rank, shards=shards)
        blocked = time.perf_counter() - t0
        write_checkpoint(snap, folder)
        write = time.perf_counter() - t0
        del snap
    out.put(("write", rank, blocked, write))
    start.wait()  # every share written: now restore, as every rank of a restart does
    t1 = time.perf_counter()
    load_checkpoint(folder, model, optimizer, restore_rng=False)
    out.put(("restore", rank, time.perf_counter() - t1, 0.0))


def measure(size: int, world: int, shards: int) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="et_ckpt_scale_")) / "ckpt"
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(world), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, shards, size, str(folder), start, out))
             for r in range(world)]
    for p in procs:
        p.start()
    results = [out.get() for _ in range(2 * world)]
    for p in procs:
        p.join()
    nbytes = sum(f.stat().st_size for f in folder.iterdir())
    shutil.rmtree(folder.parent, ignore_errors=True)
    writes = [r for r in results if r[0] == "write"]
    return {"blocked_s": max(r[2] for r in writes), "write_s": max(r[3] for r in writes),
            "restore_s": max(r[2] for r in results if r[0] == "restore"), "bytes": nbytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="25,100", help="millions of parameters: 25,100,300,1000")
    parser.add_argument("--world-sizes", default="1,2")
    args = parser.parse_args()
    rows = []
    for size in map(int, args.sizes.split(",")):
        params = count_parameters(build_model(SIZES[size], 512))
        for world in map(int, args.world_sizes.split(",")):
            for mode, shards in (("rank0", 1), ("spread", world)):
                if mode == "spread" and world == 1:
                    continue
                r = measure(size, world, shards)
                rows.append({"params": params, "world_size": world, "mode": mode, **r})
                print(f"{params / 1e6:7.1f}M W={world} {mode:6s} blocked {r['blocked_s']:6.2f} s  "
                      f"write {r['write_s']:6.2f} s  restore {r['restore_s']:6.2f} s  "
                      f"{r['bytes'] / 2**30:5.2f} GiB", flush=True)
    print(json.dumps({"benchmark": "checkpoint_scale", "rows": rows}))


if __name__ == "__main__":
    main()
