"""train.sharding=fsdp over real gloo processes: exact mode is the same to the bit at W = 1, 2, 3
as one process, and its checkpoints load at any world size and across sharding=none <-> fsdp.

One module fixture runs the three worlds (W=2 first: it writes the checkpoint the others resume);
each test asserts one property of what they saved."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from ranks import run_ranks
from test_dist import DROPOUT_MODEL, exact_grads, global_batch

from elastic_train.config import OptimConfig
from elastic_train.training.checkpoint import (
    load_checkpoint,
    read_shards,
    snapshot,
    write_checkpoint,
)
from elastic_train.training.losses import LossModule
from elastic_train.training.model import build_model
from elastic_train.training.optim import build_optimizer
from elastic_train.training.sharding import load_sharded_checkpoint, shard_model, sharded_snapshot
from elastic_train.training.step import StepSetup, TrainState, forward_backward, train_step

pytestmark = pytest.mark.dist

PARTITIONS = 5  # uneven at W = 2 and 3: some ranks run dry micro-batches to join each reduce-scatter
STEPS, SAVE_AT = 4, 2
CPU = torch.device("cpu")


def batches(step: int):
    return global_batch(PARTITIONS, seed=step)


def build_sharded(world_size: int):
    torch.manual_seed(0)
    model = build_model(DROPOUT_MODEL, 64)
    root = LossModule(model)
    sharded = shard_model(root, model, exact=True, precision="fp32", reshard_after_forward=True,
                          shard_modules=[], device=CPU)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2, warmup_steps=0), use_gpu=False)
    # a small clip: every step is clipped, so the W-independent norm is what the update uses
    setup = StepSetup(device=CPU, world_size=world_size, grad_clip=0.05, seed=3, sharded=sharded)
    return model, root, optimizer, setup


def full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a collective: every rank calls it)."""
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def train(rank, world_size, model, root, optimizer, setup, start: int, save_to: Path | None = None):
    for step in range(start, STEPS):
        mbs = batches(step)
        mine = [mb for mb in mbs if mb.partition % world_size == rank]
        train_step(root, model, optimizer, mine, setup=setup, data_targets=sum(mb.targets for mb in mbs),
                   step=step, lr=1e-2)
        if save_to is not None and step + 1 == SAVE_AT:
            snap = sharded_snapshot(model, optimizer, asdict(TrainState(step=SAVE_AT)), {},
                                    shard=rank, shards=world_size)
            write_checkpoint(snap, save_to)


def _worker(rank: int, world_size: int, out: str, fsdp_ckpt: str, none_ckpt: str) -> None:
    results = {}
    model, root, optimizer, setup = build_sharded(world_size)
    mbs = batches(0)
    forward_backward(root, [mb for mb in mbs if mb.partition % world_size == rank], setup=setup,
                     global_targets=sum(mb.targets for mb in mbs), step=17)
    results["grads"] = {n: p.grad.full_tensor().float() for n, p in model.named_parameters()}
    optimizer.zero_grad(set_to_none=True)
    writer = world_size == 2
    train(rank, world_size, model, root, optimizer, setup, 0, Path(fsdp_ckpt) if writer else None)
    results["final"] = full(model)
    if not writer:  # resume the W=2 checkpoint at this world size
        model, root, optimizer, setup = build_sharded(world_size)
        assert load_sharded_checkpoint(fsdp_ckpt, model, optimizer)["step"] == SAVE_AT
        train(rank, world_size, model, root, optimizer, setup, SAVE_AT)
        results["resumed"] = full(model)
        model, _, optimizer, _ = build_sharded(world_size)  # an unsharded run's checkpoint
        load_sharded_checkpoint(none_ckpt, model, optimizer)
        results["from_none"] = full(model)
        results["from_none_moments"] = {
            n: optimizer.state[p]["exp_avg"].full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(results, f"{out}.{world_size}")


def none_checkpoint(folder: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An unsharded model after one AdamW step, checkpointed by the unsharded path."""
    torch.manual_seed(1)
    model = build_model(DROPOUT_MODEL, 64)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2, warmup_steps=0), use_gpu=False)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    write_checkpoint(snapshot(model, optimizer, None, asdict(TrainState(step=1)), {}, 1), folder)
    return model, optimizer


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    out, fsdp_ckpt, none_ckpt = str(tmp / "out"), tmp / "fsdp_ckpt", tmp / "none_ckpt"
    none_model, none_optimizer = none_checkpoint(none_ckpt)
    for world_size in (2, 3, 1):
        run_ranks(_worker, world_size, tmp, out, str(fsdp_ckpt), str(none_ckpt))
    return {w: torch.load(f"{out}.{w}") for w in (1, 2, 3)}, fsdp_ckpt, none_model, none_optimizer


def test_exact_fsdp_gradient_is_one_processs_to_the_bit(worlds):
    """Step one's gradient, sharded at W = 1, 2, 3, equals the unsharded exact reduction's."""
    results = worlds[0]
    torch.set_num_threads(1)
    mbs = batches(0)
    ref = exact_grads(mbs, sum(mb.targets for mb in mbs))
    for world_size, saved in results.items():
        for name, g in ref.items():
            assert torch.equal(saved["grads"][name], g), (world_size, name)


def test_exact_fsdp_training_is_the_same_to_the_bit_at_any_world_size(worlds):
    results = worlds[0]
    for world_size in (2, 3):
        for name, p in results[1]["final"].items():
            assert p.dtype == torch.float64
            assert torch.equal(results[world_size]["final"][name], p), (world_size, name)
    assert any(not torch.equal(results[1]["final"][n], p) for n, p in full_initial().items())


def full_initial() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {n: p.detach().double() for n, p in build_model(DROPOUT_MODEL, 64).named_parameters()}


def test_a_checkpoint_written_at_2_resumes_at_1_and_3_to_the_bit(worlds):
    results = worlds[0]
    for world_size in (1, 3):
        for name, p in results[2]["final"].items():
            assert torch.equal(results[world_size]["resumed"][name], p), (world_size, name)


def test_checkpoints_load_across_sharding_none_and_fsdp(worlds):
    results, fsdp_ckpt, none_model, none_optimizer = worlds
    # none -> fsdp: the float32 weights and moments, upcast exactly into the float64 master
    for world_size in (1, 3):
        for name, p in none_model.named_parameters():
            assert torch.equal(results[world_size]["from_none"][name], p.double())
            assert torch.equal(results[world_size]["from_none_moments"][name],
                               none_optimizer.state[p]["exp_avg"].double())
    # fsdp -> none: the master weights rounded to float32, the moments too, with their step
    torch.manual_seed(5)
    model = build_model(DROPOUT_MODEL, 64)
    optimizer = build_optimizer(model, OptimConfig(), use_gpu=False)
    assert load_checkpoint(fsdp_ckpt, model, optimizer)["step"] == SAVE_AT
    saved = read_shards(fsdp_ckpt, "model")
    for name, p in model.named_parameters():
        assert saved[name].dtype == torch.float64 and torch.equal(p, saved[name].float())
        state = optimizer.state[p]
        assert state["exp_avg"].dtype == torch.float32 and float(state["step"]) == SAVE_AT
