"""DDP communication hooks (train.grad_compression) over 2 real gloo processes: each hook's gradient
against one process on the same global batch, and a PowerSGD resume from saved per-rank state
against an uninterrupted run."""

from __future__ import annotations

import pytest
import torch
from ranks import run_ranks
from test_dist import build, global_batch, reference_grads

from elastic_train.config import load_config
from elastic_train.training.commhooks import (
    ddp_kwargs,
    load_powersgd_state,
    powersgd_state_dict,
    register_comm_hook,
)
from elastic_train.training.losses import LossModule
from elastic_train.training.step import StepSetup, forward_backward, train_step

pytestmark = pytest.mark.dist

CPU = torch.device("cpu")


def ddp_model(compression: str, **train):
    """The test model in DDP with `compression`'s hook, as build_training prepares it."""
    t = load_config(None, [f"train.grad_compression={compression}", "train.grad_reduce=ddp",
                           *(f"train.{k}={v}" for k, v in train.items())]).train
    model = torch.nn.parallel.DistributedDataParallel(LossModule(build()), **ddp_kwargs(t))
    return model, register_comm_hook(model, t)


def _grad_worker(rank: int, world_size: int, out: str, compression: str, train: dict) -> None:
    model, _ = ddp_model(compression, **train)
    mbs = global_batch(4)
    forward_backward(model, [mb for mb in mbs if mb.partition % 2 == rank],
                     setup=StepSetup(device=CPU, world_size=2),
                     global_targets=sum(mb.targets for mb in mbs))
    torch.save({n: p.grad.clone() for n, p in model.module.model.named_parameters()}, f"{out}.{rank}")


@pytest.mark.parametrize("compression, train, tolerance", [
    ("fp16", {}, 2e-3),  # 11 significant bits
    ("bf16", {}, 1.5e-2),  # 8 significant bits
    ("none", {"gradient_as_bucket_view": "true", "ddp_bucket_mb": 0.01}, 1e-5),
])
def test_each_hook_reduces_close_to_one_process(tmp_path, compression, train, tolerance):
    """The whole model's gradient, relative to the one-process reference (the DDP knobs on the
    plain reduction: many tiny buckets, gradients as views into them)."""
    out = str(tmp_path / "grads")
    run_ranks(_grad_worker, 2, tmp_path, out, compression, train, start_method="forkserver")
    ref = reference_grads()
    flat_ref = torch.cat([g.flatten() for g in ref.values()])
    for rank in range(2):
        grads = torch.load(f"{out}.{rank}")
        flat = torch.cat([grads[n].flatten() for n in ref])
        assert float((flat - flat_ref).norm() / flat_ref.norm()) < tolerance, rank


def powersgd_run(rank: int, steps: range, weights: dict | None, hook_state: dict | None):
    """Train `steps` with PowerSGD (rank 2, 2 warm-up steps) from `weights` and this rank's
    `hook_state` (None: a fresh state); the weights and hook state after, and each step's loss."""
    model, state = ddp_model("powersgd", powersgd_rank=2, powersgd_warmup_steps=2)
    raw = model.module.model
    if weights is not None:
        raw.load_state_dict(weights)
    if hook_state is not None:
        load_powersgd_state(state, hook_state, CPU)
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.5)  # stateless: the hook state is the test
    losses = []
    for step in steps:
        mbs = global_batch(4)  # the same batch each step: the loss must fall
        result = train_step(model, raw, optimizer, [mb for mb in mbs if mb.partition % 2 == rank],
                            setup=StepSetup(device=CPU, world_size=2, grad_clip=0.0),
                            data_targets=sum(mb.targets for mb in mbs), step=step, lr=0.5)
        losses.append(result.loss)
    return {k: v.clone() for k, v in raw.state_dict().items()}, powersgd_state_dict(state), losses


def _powersgd_worker(rank: int, world_size: int, out: str) -> None:
    full, _, full_losses = powersgd_run(rank, range(8), None, None)
    first, saved, _ = powersgd_run(rank, range(4), None, None)  # a checkpoint at step 4 ...
    resumed, _, resumed_losses = powersgd_run(rank, range(4, 8), first, saved)  # ... resumed
    reset, _, _ = powersgd_run(rank, range(4, 8), first, None)  # resumed without its hook state
    torch.save({"full": full, "resumed": resumed, "reset": reset, "full_losses": full_losses,
                "resumed_losses": resumed_losses, "error_norm": float(
                    sum(e.norm() for e in saved["error_dict"].values()))}, f"{out}.{rank}")


def test_powersgd_resumes_exactly_from_each_ranks_saved_state(tmp_path):
    out = str(tmp_path / "run")
    run_ranks(_powersgd_worker, 2, tmp_path, out, start_method="forkserver")
    for rank in range(2):
        r = torch.load(f"{out}.{rank}")
        assert r["error_norm"] > 0  # compression ran before the checkpoint: there is feedback
        assert r["resumed_losses"] == r["full_losses"][4:]
        for name, w in r["full"].items():
            assert torch.equal(r["resumed"][name], w), (rank, name)
        # the state matters: without it the same resume takes another path
        assert any(not torch.equal(r["reset"][n], w) for n, w in r["full"].items())
        assert r["full_losses"][-1] < r["full_losses"][0]  # and it trains
