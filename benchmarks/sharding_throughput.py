"""CPU throughput of `train.sharding=fsdp` against `none` on a model that fits both (issue 29).

2 real gloo processes (spawned, one thread each) train the embedded GPT through the loop's own
`train_step` on the same global batches (4 micro-batches of 4 rows x 128 tokens a step, 2 per
rank), for each case: sharding none and fsdp, with the exact reduction (what `auto` picks on
CPU) and the ddp one. Figures: the median step time after warm-up steps, tokens/s, and the ratio
fsdp / none for each reduction. Gloo's reduce-scatter is an all-reduce underneath and every
forward all-gathers each block, so on CPU fsdp pays for its memory in communication; the speed
figures that matter for FSDP belong to NCCL (scripts/gpu_smoke.sh). Prints a table, then one
JSON line (the last line of stdout).

Run: .venv/bin/python benchmarks/sharding_throughput.py [--layers 4 --d-model 256 --steps 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CPU = torch.device("cpu")
WORLD_SIZE = 2


def _rank(rank: int, world_size: int, init: str, case: dict, out: str) -> None:
    from elastic_train.config import ModelConfig, OptimConfig
    from elastic_train.data.batches import pad_rows
    from elastic_train.training.losses import LossModule
    from elastic_train.training.model import build_model
    from elastic_train.training.optim import build_optimizer
    from elastic_train.training.reduce import ExactGradSum
    from elastic_train.training.sharding import shard_model
    from elastic_train.training.step import StepSetup, train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = build_model(ModelConfig(n_layer=case["layers"], d_model=case["d_model"], n_head=4), 128)
    root, exact, reducer, sharded = LossModule(model), case["reduce"] == "exact", None, None
    if case["sharding"] == "fsdp":
        sharded = shard_model(root, model, exact=exact, precision="fp32", reshard_after_forward=True,
                              shard_modules=[], device=CPU)
    elif exact:
        ExactGradSum.broadcast_parameters(model)
        reducer = ExactGradSum(model, CPU)
    else:
        root = torch.nn.parallel.DistributedDataParallel(root)
    optimizer = build_optimizer(model, OptimConfig(), use_gpu=False)
    setup = StepSetup(device=CPU, world_size=world_size, exact=reducer, sharded=sharded)
    rng = np.random.default_rng(0)
    times = []
    for step in range(case["warmup"] + case["steps"]):
        mbs = [pad_rows([(p * 10 + i, rng.integers(0, 256, 128)) for i in range(4)], p)
               for p in range(4)]
        mine = [mb for mb in mbs if mb.partition % world_size == rank]
        dist.barrier()
        t0 = time.perf_counter()
        train_step(root, model, optimizer, mine, setup=setup,
                   data_targets=sum(mb.targets for mb in mbs), step=step, lr=1e-3)
        times.append(time.perf_counter() - t0)
    tokens = sum(int(mb.real_tokens) for mb in mbs)
    if rank == 0:
        Path(out).write_text(json.dumps({"step_s": statistics.median(times[case["warmup"]:]),
                                         "tokens_per_step": tokens,
                                         "parameters": sum(p.numel() for p in model.parameters())}))
    dist.barrier()
    dist.destroy_process_group()


def measure(case: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="sharding-throughput-") as tmp:
        out = os.path.join(tmp, "out.json")
        mp.start_processes(_rank, args=(WORLD_SIZE, os.path.join(tmp, "init"), case, out),
                           nprocs=WORLD_SIZE, start_method="spawn")
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    rows = []
    print(f"{'sharding':8} {'reduce':6}  step_s  tokens/s")
    for reduce in ("exact", "ddp"):
        for sharding in ("none", "fsdp"):
            case = dict(sharding=sharding, reduce=reduce, layers=args.layers, d_model=args.d_model,
                        steps=args.steps, warmup=args.warmup)
            f = measure(case)
            row = {**case, **f, "tokens_per_s": f["tokens_per_step"] / f["step_s"]}
            rows.append(row)
            print(f"{sharding:8} {reduce:6}  {f['step_s']:6.3f}  {row['tokens_per_s']:8.0f}")
    ratios = {}
    for reduce in ("exact", "ddp"):
        by = {r["sharding"]: r for r in rows if r["reduce"] == reduce}
        ratios[reduce] = by["fsdp"]["tokens_per_s"] / by["none"]["tokens_per_s"]
        print(f"fsdp / none ({reduce}): {ratios[reduce]:.2f}")
    print(json.dumps({"benchmark": "sharding_throughput", "world_size": WORLD_SIZE,
                      "parameters": rows[0]["parameters"], "ratio_fsdp_over_none": ratios,
                      "rows": rows}))


if __name__ == "__main__":
    main()
