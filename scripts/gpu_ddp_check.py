"""NCCL DDP + accumulation on GPUs against one process on the same global batch (gpu_smoke.sh)."""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic_train.config import ModelConfig, load_config
from elastic_train.data.batches import pad_rows
from elastic_train.training.commhooks import ddp_kwargs, register_comm_hook
from elastic_train.training.losses import LossModule
from elastic_train.training.model import build_model, token_loss_sum
from elastic_train.training.reduce import ExactGradSum
from elastic_train.training.step import StepSetup, forward_backward


def batch():
    import numpy as np

    rng = np.random.default_rng(0)
    return [pad_rows([(p * 10 + i, rng.integers(0, 256, rng.integers(2, 200))) for i in range(4)], p)
            for p in range(4)]


def worker(rank, world, path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("nccl", rank=rank, world_size=world)
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    torch.manual_seed(0)
    model = build_model(ModelConfig(), 256).to(dev)
    model = torch.nn.parallel.DistributedDataParallel(LossModule(model), device_ids=[rank])
    mbs = batch()
    mine = [m for m in mbs if m.partition % world == rank]
    forward_backward(model, mine, setup=StepSetup(device=dev, world_size=world),
                     global_targets=sum(m.targets for m in mbs))
    grads = {"ddp": {n: p.grad.cpu() for n, p in model.module.model.named_parameters()}}
    # train.grad_reduce=exact: no DDP, float64 sums all-reduced over NCCL
    torch.manual_seed(0)
    plain = build_model(ModelConfig(), 256).to(dev)
    ExactGradSum.broadcast_parameters(plain)
    setup = StepSetup(device=dev, world_size=world, exact=ExactGradSum(plain, dev), seed=0)
    forward_backward(LossModule(plain), mine, setup=setup, global_targets=sum(m.targets for m in mbs))
    grads["exact"] = {n: p.grad.cpu() for n, p in plain.named_parameters()}
    for compression in ("fp16", "bf16", "powersgd"):  # the hooks over NCCL (powersgd: warm-up step)
        grads[compression] = hook_grads(compression, dev, rank, world, mine, mbs)
    if rank == 0:
        torch.save(grads, path)
    dist.destroy_process_group()


def hook_grads(compression, dev, rank, world, mine, mbs):
    """One step's gradient through DDP with train.grad_compression's hook, as a worker builds it."""
    t = load_config(None, ["train.grad_reduce=ddp", f"train.grad_compression={compression}"]).train
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(LossModule(build_model(ModelConfig(), 256).to(dev)),
                                                      device_ids=[rank], **ddp_kwargs(t))
    register_comm_hook(model, t)
    forward_backward(model, mine, setup=StepSetup(device=dev, world_size=world),
                     global_targets=sum(m.targets for m in mbs))
    return {n: p.grad.cpu() for n, p in model.module.model.named_parameters()}


# worst relative difference per parameter; half-precision hooks: of the whole gradient
TOLERANCE = {"ddp": 1e-4, "exact": 1e-4, "powersgd": 1e-4, "fp16": 2e-3, "bf16": 1.5e-2}


if __name__ == "__main__":
    world = int(sys.argv[1])
    path = os.path.join(tempfile.mkdtemp(), "g.pt")
    mp.start_processes(worker, args=(world, path), nprocs=world, start_method="spawn")
    torch.manual_seed(0)
    ref = build_model(ModelConfig(), 256).cuda()
    mbs = batch()
    total = sum(token_loss_sum(ref, torch.from_numpy(m.tokens).cuda(), torch.from_numpy(m.lengths).cuda())[0]
                for m in mbs)
    (total / sum(m.targets for m in mbs)).backward()
    for mode, got in torch.load(path).items():
        if mode in ("fp16", "bf16"):
            flat = torch.cat([(got[n] - p.grad.cpu()).flatten() for n, p in ref.named_parameters()])
            norm = torch.cat([p.grad.cpu().flatten() for p in ref.parameters()]).norm()
            worst = float(flat.norm() / norm)
        else:
            worst = max(float((got[n] - p.grad.cpu()).norm() / p.grad.norm().clamp_min(1e-12))
                        for n, p in ref.named_parameters())
        print(f"nccl {mode} x{world} vs one process: relative gradient difference {worst:.2e}")
        assert worst < TOLERANCE[mode], (mode, worst)
