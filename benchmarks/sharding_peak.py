"""The whole-run peak of a rank, fsdp against unsharded at W=2 (issue 37's 28M case).

The embedded GPT of 4 layers, d_model 768 (28M parameters), exact reduction, on 2 real gloo
processes (spawned), each as a worker builds it (`build._shard` on the meta build for fsdp,
after `memory.return_large_frees_to_os` as build.py calls it; `build_model` and `ExactGradSum`
unsharded), then 6 `train_step`s of 4 micro-batches of 4 x 128 tokens (2 a rank). Figures per
rank: the process's VmHWM at the end (the issue's measure, process included), the sharded state
(parameters, gradients, optimizer) in bytes, and the ratio of the fullest fsdp rank's peak to the
fullest unsharded rank's. Prints a table, then one JSON line.

Run: .venv/bin/python benchmarks/sharding_peak.py [--layers 4 --d-model 768 --steps 6]
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

GiB = 1 << 30


def local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _rank(rank: int, world_size: int, init: str, case: dict, out: str) -> None:
    from elastic_train.config import load_config
    from elastic_train.data.batches import pad_rows
    from elastic_train.training.build import _shard
    from elastic_train.training.losses import LossModule
    from elastic_train.training.memory import return_large_frees_to_os
    from elastic_train.training.model import build_meta_model, build_model
    from elastic_train.training.optim import build_optimizer
    from elastic_train.training.reduce import ExactGradSum
    from elastic_train.training.step import StepSetup, train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world_size)
    cfg = load_config(None, [f"model.n_layer={case['layers']}", f"model.d_model={case['d_model']}",
                             "model.n_head=12", f"train.sharding={case['sharding']}",
                             "train.grad_reduce=exact", "data.max_seq_len=128"])
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    if case["sharding"] == "fsdp":
        return_large_frees_to_os()
        model = build_meta_model(cfg.model, 128)
        root = LossModule(model)
        sharded, reducer = _shard(root, model, cfg, cpu, exact=True), None
    else:
        model = build_model(cfg.model, 128)
        root, sharded = LossModule(model), None
        reducer = ExactGradSum(model, cpu)
    optimizer = build_optimizer(model, cfg.optim, use_gpu=False)
    setup = StepSetup(device=cpu, world_size=world_size, exact=reducer, sharded=sharded)
    rng = np.random.default_rng(0)
    losses = []
    for step in range(case["steps"]):
        mbs = [pad_rows([(p * 10 + i, rng.integers(0, 256, 128)) for i in range(4)], p) for p in range(4)]
        mine = [mb for mb in mbs if mb.partition % world_size == rank]
        result = train_step(root, model, optimizer, mine, setup=setup,
                            data_targets=sum(mb.targets for mb in mbs), step=step, lr=1e-3)
        losses.append(result.loss)
    state = sum(local_bytes(v) for s in optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor))
    figures = {"peak": vm_hwm_bytes(), "losses": losses,
               "params": sum(local_bytes(p) for p in model.parameters()),
               "grads": sum(local_bytes(p.grad) for p in model.parameters()), "optimizer": state,
               "reduction": reducer.buffer.numel() * 8 if reducer is not None else 0}
    gather_and_finish(figures, out)


def measure(case: dict) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="sharding-peak-") as tmp:
        out = os.path.join(tmp, "out.json")
        mp.start_processes(_rank, args=(2, os.path.join(tmp, "init"), case, out), nprocs=2,
                           start_method="spawn")
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    results = {}
    for sharding in ("none", "fsdp"):
        ranks = measure({"sharding": sharding, "layers": args.layers, "d_model": args.d_model,
                         "steps": args.steps})
        results[sharding] = ranks
        for rank, r in enumerate(ranks):
            state = (r["params"] + r["grads"] + r["optimizer"] + r["reduction"]) / GiB
            print(f"{sharding:5} rank {rank}: peak {r['peak'] / GiB:.2f} GiB, state {state:.2f} GiB, "
                  f"last loss {r['losses'][-1]!r}")
    ratio = max(r["peak"] for r in results["fsdp"]) / max(r["peak"] for r in results["none"])
    same = results["fsdp"][0]["losses"] == results["none"][0]["losses"]
    print(f"fsdp / none peak: {ratio:.2f}; losses equal to the bit: {same}")
    print(json.dumps({"benchmark": "sharding_peak", "layers": args.layers, "d_model": args.d_model,
                      "steps": args.steps, "fsdp_over_none_peak": ratio, "losses_equal": same,
                      "ranks": results}))


if __name__ == "__main__":
    main()
