"""The baseline for benchmarks/overhead.py: a plain PyTorch DDP script, launched by torchrun.

Same model, same data, same batches as elastic-train (it uses the same batch plan and the same
forward/backward and optimizer step functions), but no Ray, no logging actor, no prefetch thread,
no checkpoints. Without torchrun (no WORLD_SIZE) it runs as one process.

    torchrun --nproc_per_node 2 benchmarks/_ddp_baseline.py --steps 30 [key=value ...]
    python benchmarks/_ddp_baseline.py --threads 2 --steps 30
Prints one JSON line (rank 0): per-step end times and real tokens, and the gloo all-reduce bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from elastic_train.config import load_config, num_partitions
from elastic_train.data.blocks import local_rank_steps
from elastic_train.data.plan import StreamSpec, owned_partitions
from elastic_train.preflight.inputs import fill_from_dataset, resolve_dataset
from elastic_train.training.collectives import all_reduce_sum
from elastic_train.training.losses import LossModule
from elastic_train.training.model import build_model
from elastic_train.training.optim import build_optimizer, lr_at
from elastic_train.training.step import StepSetup, train_step


def allreduce_bandwidth_gbps(numel: int, repeats: int = 5) -> float | None:
    if not dist.is_initialized():
        return None
    t = torch.zeros(numel)
    dist.all_reduce(t)
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(t)
    elapsed = (time.perf_counter() - start) / repeats
    # ring all-reduce moves 2 (W-1)/W of the buffer per rank
    w = dist.get_world_size()
    return 2 * (w - 1) / w * numel * 4 / elapsed / 1e9


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    t_start = time.time()
    torch.set_num_threads(args.threads)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    cfg = load_config(None, args.overrides)
    info = resolve_dataset(cfg)
    fill_from_dataset(cfg, info)  # data.max_seq_len, vocab, pad: as elastic-train resolves them
    files = info.files
    torch.manual_seed(cfg.train.seed)
    raw = build_model(cfg.model, cfg.data.max_seq_len)
    optimizer = build_optimizer(raw, cfg.optim, False)
    model = LossModule(raw)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    k = num_partitions(cfg)
    spec = StreamSpec(k, cfg.data.micro_batch_tokens, cfg.data.shuffle_window, cfg.data.seed,
                      cfg.data.bucketing)
    steps = local_rank_steps(files, spec, partitions=owned_partitions(rank, world, k))
    device = torch.device("cpu")
    setup = StepSetup(device=device, world_size=world, grad_clip=cfg.train.grad_clip)
    times, tokens = [], []
    for step in range(args.steps):
        mbs = next(steps, [])  # [] once this rank is dry: it still joins the all-reduce
        n, targets, real, _ = all_reduce_sum(
            [len(mbs), sum(m.targets for m in mbs), sum(m.real_tokens for m in mbs),
             sum(m.padded_tokens for m in mbs)], device)
        if n == 0:
            break
        train_step(model, raw, optimizer, mbs, setup=setup, data_targets=targets, step=step,
                   lr=lr_at(step, cfg.optim, cfg.train.max_steps))
        times.append(time.time())
        tokens.append(int(real))
    numel = sum(p.numel() for p in raw.parameters())
    bandwidth = allreduce_bandwidth_gbps(numel)
    if rank == 0:
        print(json.dumps({"start_time": t_start, "times": times, "real_tokens": tokens,
                          "world_size": world, "threads": args.threads, "params": numel,
                          "allreduce_gbps": bandwidth}))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
