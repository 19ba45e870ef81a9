"""DDP + accumulation over 2 real gloo processes against one process on the same global batch."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from ranks import run_ranks

from elastic_train.config import ModelConfig
from elastic_train.data.batches import IGNORE_INDEX, pad_rows, stack_rows
from elastic_train.data.blocks import BlockReader
from elastic_train.data.rowgroups import build_block_table
from elastic_train.training.losses import LossModule
from elastic_train.training.model import build_model, token_loss_sum
from elastic_train.training.reduce import ExactGradSum
from elastic_train.training.step import StepSetup, dry_rank_batch, forward_backward, train_step

pytestmark = pytest.mark.dist

MODEL = ModelConfig(n_layer=1, d_model=32, n_head=2)


def global_batch(num_partitions: int, seed: int = 0):
    """One micro-batch per partition, rows of mixed lengths (and so padding)."""
    rng = np.random.default_rng(seed)
    mbs = []
    for p in range(num_partitions):
        rows = [(p * 100 + i, rng.integers(0, 256, rng.integers(2, 40))) for i in range(rng.integers(1, 6))]
        mbs.append(pad_rows(rows, p))
    return mbs


def build():
    torch.manual_seed(0)
    return build_model(MODEL, 64)


def _worker(rank: int, world_size: int, out: str, rank1_empty: bool) -> None:
    model = torch.nn.parallel.DistributedDataParallel(LossModule(build()))
    mbs = global_batch(4)
    if rank1_empty:  # the end of an epoch: rank 1's partitions are dry
        mine = mbs if rank == 0 else []
    else:
        mine = [mb for mb in mbs if mb.partition % world_size == rank]
    targets = sum(mb.targets for mb in mbs)
    forward_backward(model, mine, setup=StepSetup(device=torch.device("cpu"), world_size=world_size),
                     global_targets=targets)
    grads = {n: p.grad.clone() for n, p in model.module.model.named_parameters()}
    torch.save(grads, f"{out}.{rank}")


def reference_grads():
    model = build()
    mbs = global_batch(4)
    total = sum(token_loss_sum(model, torch.from_numpy(mb.tokens), torch.from_numpy(mb.lengths))[0]
                for mb in mbs)
    (total / sum(mb.targets for mb in mbs)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("rank1_empty", [False, True])
def test_ddp_accumulated_gradient_matches_single_process(tmp_path, rank1_empty):
    out = str(tmp_path / "grads")
    run_ranks(_worker, 2, tmp_path, out, rank1_empty, start_method="forkserver")
    ref = reference_grads()
    for rank in range(2):
        grads = torch.load(f"{out}.{rank}")
        for name, g in ref.items():
            rel = (grads[name] - g).norm() / g.norm().clamp_min(1e-12)
            assert rel < 1e-5, (rank, name, float(rel))
    # The reference is not trivially equal to a per-rank mean of per-rank means.
    assert os.path.getsize(f"{out}.0") > 0


DROPOUT_MODEL = ModelConfig(n_layer=1, d_model=32, n_head=2, dropout=0.1)


def exact_grads(micro_batches, targets: float) -> dict[str, torch.Tensor]:
    """train.grad_reduce=exact on this process's share (a process group, if any, is initialised)."""
    torch.manual_seed(0)
    model = build_model(DROPOUT_MODEL, 64)
    ExactGradSum.broadcast_parameters(model)
    reducer = ExactGradSum(model, torch.device("cpu"))
    setup = StepSetup(device=torch.device("cpu"), world_size=1, exact=reducer, seed=3)
    forward_backward(LossModule(model), micro_batches, setup=setup, global_targets=targets, step=17)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _exact_worker(rank: int, world_size: int, out: str) -> None:
    mbs = global_batch(6)
    mine = [mb for mb in mbs if mb.partition % world_size == rank]
    torch.save(exact_grads(mine, sum(mb.targets for mb in mbs)), f"{out}.{rank}")


@pytest.mark.parametrize("world_size", [2, 3])
def test_exact_reduce_is_the_same_to_the_bit_at_any_world_size(tmp_path, world_size):
    """float64 sums and per-partition dropout seeds: W ranks give one process's gradient exactly."""
    out = str(tmp_path / "grads")
    run_ranks(_exact_worker, world_size, tmp_path, out, start_method="forkserver")
    torch.set_num_threads(1)
    mbs = global_batch(6)
    ref = exact_grads(mbs, sum(mb.targets for mb in mbs))
    for rank in range(world_size):
        grads = torch.load(f"{out}.{rank}")
        for name, g in ref.items():
            assert torch.equal(grads[name], g), (rank, name, float((grads[name] - g).abs().max()))


def label_loss(model, batch):
    """A user's loss over an extra column: next-token loss on rows labelled 1 only."""
    logits = model(batch["tokens"])[:, :-1].float()
    targets = batch["labels"][:, 1:].masked_fill(batch["label"][:, None] == 0, -100)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             targets.reshape(-1), ignore_index=-100, reduction="sum")
    return loss, int((targets != -100).sum())


def labelled_batch(num_partitions: int):
    mbs = global_batch(num_partitions, seed=1)
    for mb in mbs:
        mb.extras["label"] = (mb.lengths % 2).astype(np.int64)
    return mbs


def user_loss_grads(model, micro_batches, world_size: int, data_targets: float):
    """`train_step` with a user's loss (it counts its own targets), no clipping: the gradient."""
    raw = model.module.model if world_size > 1 else model.model
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.0)
    setup = StepSetup(device=torch.device("cpu"), world_size=world_size, grad_clip=0.0,
                      count_targets=True, extra_columns=("label",))
    train_step(model, raw, optimizer, micro_batches, setup=setup, data_targets=data_targets,
               step=0, lr=0.0)
    return {n: p.grad.clone() for n, p in raw.named_parameters()}


def _user_loss_worker(rank: int, world_size: int, out: str) -> None:
    mbs = labelled_batch(4)
    mine = mbs if rank == 0 else []  # rank 1 is dry and has never seen a batch: zeros for `label`
    model = torch.nn.parallel.DistributedDataParallel(LossModule(build(), label_loss))
    grads = user_loss_grads(model, mine, world_size, sum(mb.targets for mb in mbs))
    torch.save(grads, f"{out}.{rank}")


def test_a_user_loss_on_an_extra_column_matches_one_process_with_a_dry_rank(tmp_path):
    """DDP (train.grad_reduce=ddp): the loss counts fewer targets than the data has, and the dry
    rank joins the step through that same loss; the gradient is the one-process gradient of
    (total loss / the loss's own target count)."""
    out = str(tmp_path / "grads")
    run_ranks(_user_loss_worker, 2, tmp_path, out, start_method="forkserver")
    mbs = labelled_batch(4)
    ref = user_loss_grads(LossModule(build(), label_loss), mbs, 1, sum(mb.targets for mb in mbs))
    model = build()
    total, count = 0, 0
    for mb in mbs:
        loss, n = label_loss(model, mb.to_batch(torch.device("cpu")))
        total, count = total + loss, count + n
    (total / count).backward()
    for name, p in model.named_parameters():  # train_step's rescale against a plain mean
        torch.testing.assert_close(ref[name], p.grad, rtol=1e-5, atol=1e-7)
    for rank in range(2):
        grads = torch.load(f"{out}.{rank}")
        for name, g in ref.items():
            rel = (grads[name] - g).norm() / g.norm().clamp_min(1e-12)
            assert rel < 1e-5, (rank, name, float(rel))


def label_per_row_loss(model, batch):
    """A user's loss with one target per row, whatever the row's length: its `label` predicted
    at its first token (a row of one token has no next-token target)."""
    logits = model(batch["tokens"])[:, 0].float()
    return F.cross_entropy(logits, batch["label"], reduction="sum"), batch["label"].numel()


def one_token_batch(num_partitions: int):
    """Rows of one token each, a label per row: the data holds no next-token target."""
    rng = np.random.default_rng(2)
    mbs = []
    for p in range(num_partitions):
        n = int(rng.integers(1, 4))
        mb = pad_rows([(p * 100 + i, rng.integers(0, 256, 1)) for i in range(n)], p)
        mb.extras["label"] = rng.integers(0, 256, n)
        mbs.append(mb)
    return mbs


def label_step(micro_batches, world_size: int):
    """One `train_step` (exact reduction, no clipping, SGD) with `label_per_row_loss` on this
    process's share: (gradients, weights after)."""
    torch.manual_seed(0)
    model = build_model(MODEL, 64)
    ExactGradSum.broadcast_parameters(model)
    cpu = torch.device("cpu")
    setup = StepSetup(device=cpu, world_size=world_size, grad_clip=0.0,
                      exact=ExactGradSum(model, cpu), count_targets=True, extra_columns=("label",))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step(LossModule(model, label_per_row_loss), model, optimizer, micro_batches, setup=setup,
               data_targets=0.0, step=0, lr=0.1)
    return ({n: p.grad.clone() for n, p in model.named_parameters()},
            {n: p.detach().clone() for n, p in model.named_parameters()})


def _label_step_worker(rank: int, world_size: int, out: str) -> None:
    mine = [mb for mb in one_token_batch(4) if mb.partition % world_size == rank]
    torch.save(label_step(mine, world_size), f"{out}.{rank}")


def test_a_loss_counting_its_own_targets_trains_rows_without_next_token_targets(tmp_path):
    """Rows of one token (no next-token target in the data), a loss with a label per row: the
    step's gradient is d(loss sum / the loss's count), not 0, and the same to the bit on 2 ranks
    as on one."""
    mbs = one_token_batch(4)
    assert sum(mb.targets for mb in mbs) == 0
    out = str(tmp_path / "step")
    run_ranks(_label_step_worker, 2, tmp_path, out, start_method="forkserver")
    torch.set_num_threads(1)
    grads, weights = label_step(mbs, 1)
    model = build()
    total, count = 0, 0
    for mb in mbs:
        loss, n = label_per_row_loss(model, mb.to_batch(torch.device("cpu")))
        total, count = total + loss, count + n
    (total / count).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7)
    assert any(not torch.equal(weights[name], p) for name, p in model.named_parameters())
    for rank in range(2):
        rank_grads, rank_weights = torch.load(f"{out}.{rank}")
        for name in grads:
            assert torch.equal(rank_grads[name], grads[name]), (rank, name)
            assert torch.equal(rank_weights[name], weights[name]), (rank, name)


def weighted_loss(model, batch):
    """A user's loss over a float list column (per-token weights) and a float scalar column."""
    logits = model(batch["tokens"])[:, :-1].float()
    per_token = F.cross_entropy(logits.transpose(1, 2), batch["labels"][:, 1:],
                                ignore_index=IGNORE_INDEX, reduction="none")
    weights = batch["weights"][:, 1:] * batch["scale"][:, None]
    return (per_token * weights).sum(), int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def test_a_dry_batch_has_the_extra_columns_of_the_data_sets_kinds(tmp_path):
    """A rank with no micro-batch to copy (an fsdp evaluation, a resume with its data used up)
    gives a user's loss extra columns shaped and typed as the data set's: a list column (1, 2)
    like the dry tokens, a scalar (1,), each in its Parquet dtype."""
    path = str(tmp_path / "part-0.parquet")
    pq.write_table(pa.table({
        "id": pa.array([0, 1], pa.int64()), "tokens": pa.array([[1, 2, 3], [4, 5]]),
        "length": pa.array([3, 2], pa.int32()),
        "weights": pa.array([[0.5, 1.0, 1.0], [1.0, 0.5]], pa.list_(pa.float32())),
        "scale": pa.array([2.0, 0.5], pa.float64())}), path)
    columns = ("weights", "scale")
    reader = BlockReader(build_block_table(pafs.LocalFileSystem(), [path], [path]), columns)
    dry = dry_rank_batch(None, 0, columns, reader.extra_kinds())
    assert (dry.extras["weights"].shape, dry.extras["weights"].dtype) == ((1, 2), np.float32)
    assert (dry.extras["scale"].shape, dry.extras["scale"].dtype) == ((1,), np.float64)
    real = stack_rows(reader.read(np.array([0])), np.arange(2), 0)
    for name in columns:
        assert (real.extras[name].ndim, real.extras[name].dtype) == (dry.extras[name].ndim,
                                                                     dry.extras[name].dtype)
    loss_module = LossModule(build(), weighted_loss)
    loss_sum, _ = loss_module(dry.to_batch(torch.device("cpu")))
    (loss_sum * 0.0).backward()  # as the dry rank's step does
    assert loss_module(real.to_batch(torch.device("cpu")))[1] == real.targets


def test_columns_rounded_up_to_the_pad_multiple_hold_the_pad_id():
    """data.pad_multiple: the columns added on the device are padding, tokens == pad_id (as the
    micro-batch's own padding), labels IGNORE_INDEX, attention_mask 0."""
    for pad_id in (0, 3):
        mb = pad_rows([(0, np.array([5, 6, 7])), (1, np.array([8, 9]))], 0, pad_id=pad_id)
        setup = StepSetup(device=torch.device("cpu"), world_size=1, pad_id=pad_id, pad_multiple=8)
        batch = setup.batch(mb)
        assert batch["tokens"].tolist() == [[5, 6, 7] + [pad_id] * 5, [8, 9] + [pad_id] * 6]
        assert batch["labels"].tolist() == [[5, 6, 7] + [IGNORE_INDEX] * 5,
                                            [8, 9] + [IGNORE_INDEX] * 6]
        assert batch["attention_mask"].tolist() == [[1] * 3 + [0] * 5, [1] * 2 + [0] * 6]
        assert mb.to_batch(torch.device("cpu"), 8, pad_id=pad_id)["tokens"].equal(batch["tokens"])


def sampling_loss(model, batch):
    """A user's loss that draws from Python's and NumPy's generators (a random token weighting,
    say): what it draws must be a function of the micro-batch, as dropout is."""
    import random

    logits = model(batch["tokens"])[:, :-1].float()
    targets = batch["labels"][:, 1:]
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                ignore_index=IGNORE_INDEX, reduction="none")
    weights = torch.from_numpy(np.random.rand(per_token.numel())).float() * random.random()
    return (per_token * weights).sum(), int((targets != IGNORE_INDEX).sum())


def sampling_grads(micro_batches, targets: float) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = build_model(MODEL, 64)
    ExactGradSum.broadcast_parameters(model)
    setup = StepSetup(device=torch.device("cpu"), world_size=1, seed=3,
                      exact=ExactGradSum(model, torch.device("cpu")))
    forward_backward(LossModule(model, sampling_loss), micro_batches, setup=setup,
                     global_targets=targets, step=5)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _sampling_worker(rank: int, world_size: int, out: str) -> None:
    np.random.seed(100 + rank)  # each process's generators elsewhere: the step must not care
    mbs = global_batch(4)
    mine = [mb for mb in mbs if mb.partition % world_size == rank]
    torch.save(sampling_grads(mine, sum(mb.targets for mb in mbs)), f"{out}.{rank}")


def test_a_loss_that_samples_from_python_and_numpy_is_the_same_to_the_bit_at_any_world_size(
        tmp_path):
    """Each micro-batch seeds torch's, Python's and NumPy's generators from (seed, step,
    partition): a loss drawing from numpy.random gives 2 ranks one process's gradient exactly
    (NumPy's generator was each process's own: its draws depended on the world size, and a
    resume put rank 0's state on every rank)."""
    out = str(tmp_path / "grads")
    run_ranks(_sampling_worker, 2, tmp_path, out, start_method="forkserver")
    torch.set_num_threads(1)
    mbs = global_batch(4)
    ref = sampling_grads(mbs, sum(mb.targets for mb in mbs))
    for rank in range(2):
        grads = torch.load(f"{out}.{rank}")
        for name, g in ref.items():
            assert torch.equal(grads[name], g), (rank, name)
