"""Bytes per parameter per rank, `train.sharding` none against fsdp (issue 29).

Each case runs on W real gloo processes (spawned) that build the embedded GPT (n_layer 4,
d_model 256 by default), take two optimizer steps through `train_step` on the same global batch,
and count what each rank holds, by tensor: parameters, gradients, optimizer state and the
reduction's buffer (ExactGradSum's float64 sum; FSDP's own gather and reduce-scatter buffers are
transient and show only in the peak), each a rank's local bytes over the model's parameter
count; and the peak: the process's VmHWM rise from just before the model was built, per
parameter (allocator slack and activations included). Projections to 8 and 64 ranks divide the
sharded terms by W. Cases: none and fsdp, exact and ddp, adamw (and adamw8bit for none: fsdp
refuses it), at W = 1, 2. Prints a table, then one JSON line (the last line of stdout).

Run: .venv/bin/python benchmarks/sharding_memory.py [--layers 4 --d-model 256]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _gloo import gather_and_finish, vm_hwm_bytes

CPU = torch.device("cpu")


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


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
    base = vm_hwm_bytes()
    torch.manual_seed(0)
    model = build_model(ModelConfig(n_layer=case["layers"], d_model=case["d_model"], n_head=4), 128)
    count = sum(p.numel() for p in model.parameters())
    root, exact, reducer, sharded = LossModule(model), case["reduce"] == "exact", None, None
    if case["sharding"] == "fsdp":
        sharded = shard_model(root, model, exact=exact, precision="fp32", reshard_after_forward=True,
                              shard_modules=[], device=CPU)
    elif exact:
        reducer = ExactGradSum(model, CPU)
    else:
        root = torch.nn.parallel.DistributedDataParallel(root)
    optimizer = build_optimizer(model, OptimConfig(name=case["optim"]), use_gpu=False)
    setup = StepSetup(device=CPU, world_size=world_size, exact=reducer, sharded=sharded)
    rng = np.random.default_rng(0)
    mbs = [pad_rows([(p * 10 + i, rng.integers(0, 256, 128)) for i in range(4)], p) for p in range(4)]
    for step in range(2):
        mine = [mb for mb in mbs if mb.partition % world_size == rank]
        train_step(root, model, optimizer, mine, setup=setup,
                   data_targets=sum(mb.targets for mb in mbs), step=step, lr=1e-3)
    state = sum(local_bytes(v) for s in optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor))
    figures = {
        "params": sum(local_bytes(p) for p in model.parameters()) / count,
        "grads": sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None) / count,
        "optimizer": state / count,
        "reduction": (reducer.buffer.numel() * 8 if reducer is not None else 0) / count,
        "peak": (vm_hwm_bytes() - base) / count,
        "parameters": count,
    }
    gather_and_finish(figures, out)


def measure(case: dict, world_size: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="sharding-memory-") as tmp:
        out = os.path.join(tmp, "out.json")
        mp.start_processes(_rank, args=(world_size, os.path.join(tmp, "init"), case, out),
                           nprocs=world_size, start_method="spawn")
        ranks = json.loads(Path(out).read_text())
    return {k: max(r[k] for r in ranks) for k in ranks[0]}  # the fullest rank


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    args = parser.parse_args()
    cases = [dict(sharding=s, reduce=r, optim=o) for s in ("none", "fsdp") for r in ("exact", "ddp")
             for o in ("adamw", "adamw8bit") if not (s == "fsdp" and o == "adamw8bit")]
    rows = []
    print(f"{'sharding':8} {'reduce':6} {'optim':9} W  params grads optim reduce  total  peak"
          "   @8 ranks  @64 ranks")
    for case in cases:
        for world_size in (1, 2):
            f = measure({**case, "layers": args.layers, "d_model": args.d_model}, world_size)
            total = f["params"] + f["grads"] + f["optimizer"] + f["reduction"]
            fsdp = case["sharding"] == "fsdp"
            whole = total * world_size if fsdp else total  # a sharded rank holds 1/W of it
            at8, at64 = (whole / 8, whole / 64) if fsdp else (total, total)
            row = {**case, "world_size": world_size, **f, "total": total, "projected_8": at8,
                   "projected_64": at64, "largest_model_80GB_at_8_B": 80e9 / at8 / 1e9}
            rows.append(row)
            print(f"{case['sharding']:8} {case['reduce']:6} {case['optim']:9} {world_size}  "
                  f"{f['params']:6.1f} {f['grads']:5.1f} {f['optimizer']:5.1f} {f['reduction']:6.1f} "
                  f"{total:6.1f} {f['peak']:5.1f}   {at8:8.1f}  {at64:9.2f}")
    print(json.dumps({"benchmark": "sharding_memory", "parameters": rows[0]["parameters"],
                      "rows": rows}))


if __name__ == "__main__":
    main()
