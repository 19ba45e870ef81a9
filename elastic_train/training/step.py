"""One training step: forward/backward over a rank's micro-batches, the reduction, the optimizer.

`train_step` -> `accumulate` -> `forward_backward`, each on a screen; tests and benchmarks call
`train_step` rather than retyping it. `TrainState` is the trainer's own counters, a state like any
other in the checkpoint. Plain torch and torch.distributed: a 2-process gloo test runs it as is.
"""

from __future__ import annotations

import math
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from elastic_train.data.batches import ColumnKind, MicroBatch
from elastic_train.training.collectives import all_reduce_sum
from elastic_train.training.optim import (
    set_lr,
)
from elastic_train.training.reduce import ExactGradSum, rescale_grads

if TYPE_CHECKING:
    from elastic_train.training.sharding import ShardedReduce


@dataclass
class TrainState:
    """The trainer's own counters; saved in every checkpoint. (epoch, step_in_epoch) is the
    data position: the next step to train is `step_in_epoch` of `epoch`."""

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    skipped_steps: int = 0
    consecutive_skips: int = 0
    rows: int = 0  # rows trained (all ranks), for read_amplification
    eval_step: int = 0  # the step after which the last evaluation ran (0: none yet)
    best_eval_loss: float | None = None  # the lowest eval loss so far, and its step
    best_step: int = 0
    grad_reduce: str = ""  # the reduction the run chose at its first start (config.choose_grad_reduce)
    # where each partition is in `epoch`: {partition: [window, micro-batches taken]} (blocks.py)
    cursors: dict[str, list[int]] = field(default_factory=dict)

    def count_step(self, skipped: bool, real: float, padded: float, rows: float,
                   max_skips: int, overflow: bool = False) -> bool:
        """Count one trained step (`skipped`: its gradient was non-finite, nothing applied); True
        when `max_skips` steps in a row were skipped (the non-finite policy acts then). An fp16
        loss scale's `overflow` (`StepResult.overflow`) is a skipped step that neither counts
        toward them nor breaks their run: GradScaler's way of finding its scale."""
        self.skipped_steps += skipped
        if not overflow:
            self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0
        self.step += 1
        self.step_in_epoch += 1
        self.real_tokens += int(real)
        self.padded_tokens += int(padded)
        self.rows += int(rows)
        return self.consecutive_skips >= max_skips


class NonFiniteError(RuntimeError):
    """Gradients stayed non-finite after a rollback: the run stops and names the batch."""


def autocast_context(precision: str, device: torch.device):
    if precision == "fp32":
        return nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def seed_micro_batch(seed: int) -> None:
    """Seed every generator a model or loss may draw from in a micro-batch: torch's (dropout,
    on every device), Python's `random` and NumPy's global one (a user's loss that samples),
    so that what it draws is a function of the micro-batch, whatever the world size or the
    restarts (a resume restores one rank's generators on every rank)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def micro_batch_seed(seed: int, step: int, partition: int) -> int:
    """The RNG seed of one micro-batch (dropout): a function of the step and partition, so that
    random ops, like the data, do not depend on the world size or on restarts."""
    return int(np.random.SeedSequence([seed, step, partition]).generate_state(1, np.uint64)[0] >> 1)


def dry_rank_batch(template: MicroBatch | None, pad_id: int,
                   extra_columns: tuple[str, ...] = (),
                   kinds: dict[str, ColumnKind] | None = None) -> MicroBatch:
    """A one-row micro-batch for a rank whose partitions ran dry (its loss is multiplied by 0):
    the first row of `template` (a real micro-batch this process has seen, or a dry one the loop
    made from the reader's `extra_kinds`), so that a user's loss finds its extra columns as in
    a real batch; else two pad tokens, with zeros in the extra columns: of the kind `kinds`
    gives (a list column (1, 2) like the tokens, a scalar (1,), each in its dtype), int64
    scalars where it gives none."""
    if template is not None:
        extras = {k: v[:1] for k, v in template.extras.items()}
        return MicroBatch(template.partition, template.ids[:1], template.tokens[:1],
                          template.lengths[:1], extras)
    tokens = np.full((1, 2), pad_id, dtype=np.int64)
    extras = {}
    for name in extra_columns:
        dtype, per_token = (kinds or {}).get(name, (np.dtype(np.int64), False))
        extras[name] = np.zeros((1, 2) if per_token else 1, dtype)
    return MicroBatch(-1, np.zeros(1, np.int64), tokens, np.full(1, 2, np.int64), extras)


@dataclass(frozen=True)
class StepSetup:
    """What stays the same from step to step of one attempt: how a step is computed and reduced."""

    device: torch.device
    world_size: int
    precision: str = "fp32"
    grad_clip: float = 1.0
    seed: int | None = None  # seeds each micro-batch's random ops by (seed, step, partition)
    scaler: Any = None
    exact: ExactGradSum | None = None
    count_targets: bool = False  # the loss counts its own targets (a user's loss_fn)
    pad_id: int = 0
    extra_columns: tuple[str, ...] = ()  # the data set's columns beyond id/tokens/length
    sharded: ShardedReduce | None = None  # train.sharding=fsdp (sharding.py)
    pad_multiple: int = 1  # data.pad_multiple: micro-batch columns rounded up on the device
    max_width: int | None = None  # ... never past data.max_seq_len

    def batch(self, mb: MicroBatch) -> dict[str, torch.Tensor]:
        """`mb`'s tensors on the device, its columns rounded up as `pad_multiple` says."""
        return mb.to_batch(self.device, self.pad_multiple, self.max_width, self.pad_id)


def forward_backward(
    model: torch.nn.Module,
    micro_batches: list[MicroBatch],
    *,
    setup: StepSetup,
    global_targets: float,
    step: int = 0,
    dry_template: MicroBatch | None = None,
) -> tuple[torch.Tensor, Any]:
    """Accumulate this rank's share of one global step's gradient: (its loss sum, its targets:
    a number or a device tensor, read only when needed).

    `model` maps a batch to (loss sum, targets) (`losses.LossModule`, maybe in DDP). The result in
    `.grad` is the gradient of (total loss / `global_targets`) over the global batch, the same as
    one process computes on the whole batch. With `setup.exact`, each micro-batch's loss sum is
    scaled by 1 / global_targets and the gradients summed by `ExactGradSum`. Without it (DDP), by
    world_size / global_targets, since DDP averages over ranks, and DDP syncs only on the last
    backward. Sharded (`setup.sharded`), FSDP2 sums: 1 / global_targets, as exact.
    """
    exact, sharded = setup.exact, setup.sharded
    summed = exact is not None or sharded is not None
    scale = (1.0 if summed else setup.world_size) / max(global_targets, 1.0)
    if sharded is not None:
        return sharded_forward_backward(model, micro_batches, setup=setup, scale=scale, step=step,
                                        dry_template=dry_template)
    if not micro_batches and exact is None:
        # This rank's partitions ran dry in the epoch's last steps: join DDP's all-reduce with a
        # zero gradient, through the user's model and loss (DDP's reducer is prepared as usual).
        dry_backward(model, setup, dry_template)
        return torch.zeros((), dtype=torch.float64, device=setup.device), 0.0
    total, targets = accumulate(model, micro_batches, setup=setup, scale=scale, step=step)
    if exact is not None:
        exact.finish()  # an empty rank joins the all-reduce with zeros
    return total, targets


def dry_backward(model: torch.nn.Module, setup: StepSetup, template: MicroBatch | None) -> None:
    """A backward of zero gradient through the user's model and loss (`dry_rank_batch`): a rank
    with no micro-batch (left) still joins the step's collectives."""
    with autocast_context(setup.precision, setup.device):
        dry = dry_rank_batch(template, setup.pad_id, setup.extra_columns)
        loss_sum, _ = model(dry.to_batch(setup.device))
    scaler = setup.scaler
    (scaler.scale(loss_sum * 0.0) if scaler is not None else loss_sum * 0.0).backward()


def sharded_forward_backward(model: torch.nn.Module, micro_batches: list[MicroBatch], *,
                             setup: StepSetup, scale: float, step: int,
                             dry_template: MicroBatch | None) -> tuple[torch.Tensor, Any]:
    """train.sharding=fsdp: this rank's micro-batches, then dry ones up to `rounds` (each
    forward's all-gather, and each reduce-scatter, is a collective every rank joins), then the
    gradient finished (sharding.py)."""
    sharded = setup.sharded
    rounds = sharded.rounds(len(micro_batches))
    total, targets = accumulate(model, micro_batches, setup=setup, scale=scale, step=step,
                                rounds=rounds)
    for i in range(len(micro_batches), rounds):
        sharded.set_sync(i == rounds - 1)
        dry_backward(model, setup, dry_template)
    sharded.finish()
    return total, targets


def accumulate(model: torch.nn.Module, micro_batches: list[MicroBatch], *, setup: StepSetup,
               scale: float, step: int, rounds: int | None = None) -> tuple[torch.Tensor, Any]:
    """Forward and backward each micro-batch (its loss sum times `scale`), its random ops seeded by
    (seed, step, partition); with `setup.exact` each gradient goes into the float64 sum at once,
    in DDP only the last backward syncs; sharded, as `setup.sharded` says for backward i of
    `rounds`. Returns (loss sum in float64, targets)."""
    ddp = isinstance(model, DistributedDataParallel)
    exact, scaler, device = setup.exact, setup.scaler, setup.device
    backward = (lambda x: scaler.scale(x).backward()) if scaler is not None else torch.Tensor.backward
    total = torch.zeros((), dtype=torch.float64, device=device)
    targets: Any = 0.0  # a float, or a device tensor when the loss counts on the device (no sync)
    for i, mb in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        if setup.seed is not None:
            seed_micro_batch(micro_batch_seed(setup.seed, step, mb.partition))
        if setup.sharded is not None:
            setup.sharded.set_sync(i == (rounds or len(micro_batches)) - 1)
        with nullcontext() if (last or not ddp) else model.no_sync():
            with autocast_context(setup.precision, device):
                loss_sum, n_targets = model(setup.batch(mb))
            backward(loss_sum * scale)
        if exact is not None:
            exact.add_grads()
        total += loss_sum.detach().double()
        targets = targets + n_targets
    return total, targets


def poison_gradient(model: torch.nn.Module, value: float = float("nan")) -> None:
    """Test hook (`fault.nan_at_step`): write `value` into the first element of this rank's
    first gradient, after the reduction, so that this rank alone holds a bad value. Sharded, a
    gradient is this rank's rows (a DTensor's local part): the first parameter of which it holds
    any, so the other ranks' shards stay finite."""
    for p in model.parameters():
        grad = p.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        if local is not None and local.numel():
            local.view(-1)[0] = value
            return


def _read_together(*values: Any) -> list[float]:
    """Numbers (tensors on one device, or floats) on the host in one wait for the device, not
    one wait each; each value exactly (float64 holds an fp32 or float64 value as it is)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return [float(v) for v in values]
    read = iter(torch.stack([t.detach().to(torch.float64).reshape(()) for t in tensors]).tolist())
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]


def optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    grad_clip: float,
    local_loss: torch.Tensor,
    device: torch.device,
    sharded: ShardedReduce | None = None,
    exact: bool = False,
) -> tuple[float, float, bool]:
    """Clip and step unless any rank saw a non-finite gradient: (loss sum, grad norm, skipped).

    Every rank must decide alike, or one steps while another does not. Unsharded, each rank's
    norm is of its own copy of the gradient (a copy may go bad after the reduction), so the
    flag is all-reduced. Sharded, a rank holds only its rows, which may be finite while another
    rank's are not; the norm is the global one (`ShardedReduce.grad_norm` all-reduces every
    row's sum of squares, and a NaN or inf anywhere makes the norm non-finite on every rank),
    summed in an order that does not depend on W: every rank sees the same norm, so the same
    decision. `exact` (the exact reduction, unsharded): clipped as sharded exact is
    (`sharding.clip_rows`), so that the two runs stay equal to the bit."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    if sharded is not None:
        norm = sharded.clip_(grad_clip)
    elif exact:
        from elastic_train.training.sharding import clip_rows

        params = [p for p in model.parameters() if p.requires_grad]
        norm = clip_rows(params, grad_clip, 0, 1, device)
    else:
        norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), grad_clip if grad_clip > 0 else float("inf")
        )
    norm, local = _read_together(norm, local_loss)
    nonfinite = 0.0 if math.isfinite(norm) else 1.0
    loss_sum, any_nonfinite = all_reduce_sum([local, nonfinite], device)
    if any_nonfinite:
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            # As GradScaler does on an overflow, alike on every rank (one whose own gradient was
            # finite found no inf): scale * backoff_factor, and growth counting starts again.
            scaler.update(new_scale=scaler.get_scale() * scaler.get_backoff_factor())
            scaler.load_state_dict({**scaler.state_dict(), "_growth_tracker": 0})
        return loss_sum, norm, True
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    elif sharded is not None:
        sharded.step(optimizer)
    else:
        optimizer.step()
    return loss_sum, norm, False


@dataclass
class StepResult:
    loss: float  # per target, over the global batch
    grad_norm: float
    skipped: bool
    forward_backward_s: float
    optimizer_s: float
    # skipped by fp16's loss scale: the loss finite, the scaled gradient overflowing at a scale
    # still above 1 (GradScaler backs off and tries again: starting at 2^16, a few such steps are
    # how it finds its scale, and a rollback would replay them to fail the same way)
    overflow: bool = False


def train_step(
    model: torch.nn.Module,
    raw_model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[MicroBatch],
    *,
    setup: StepSetup,
    data_targets: float,
    step: int,
    lr: float,
    dry_template: MicroBatch | None = None,
    poison: Any = None,
) -> StepResult:
    """One optimizer step over this rank's micro-batches of global step `step`.

    `data_targets` is the global count of next-token targets in the data (known before the
    forward): the gradient is scaled by 1 / max(data_targets, 1) as it accumulates, then, if the
    loss counted its own targets (`setup.count_targets`), corrected by max(data_targets, 1) / the
    loss's global count, so that the result is d(total loss / total targets) for any loss written
    as a sum, even when the data has no next-token target at all (rows of one token, a loss with
    a label per row). The correction is one multiplication after the reduction, the same on every
    rank and at every world size: the exact reduction stays exact.
    """
    set_lr(optimizer, lr)
    optimizer.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    local_loss, local_targets = forward_backward(
        model, micro_batches, setup=setup, global_targets=data_targets, step=step,
        dry_template=dry_template)
    targets = data_targets
    if setup.count_targets:
        (targets,) = all_reduce_sum([float(local_targets)], setup.device)
        scaled_by = max(data_targets, 1.0)  # forward_backward's divisor
        if max(targets, 1.0) != scaled_by:
            rescale_grads(raw_model, scaled_by / max(targets, 1.0))
    if poison is not None:
        poison(raw_model)
    t1 = time.perf_counter()
    loss_sum, grad_norm, skipped = optimizer_step(
        raw_model, optimizer, setup.scaler, setup.grad_clip, local_loss, setup.device,
        setup.sharded, exact=setup.exact is not None)
    # the scale, backed off already, was at least 2 before: an overflow of the scale's making
    overflow = (skipped and setup.scaler is not None and math.isfinite(loss_sum)
                and setup.scaler.get_scale() >= 1.0)
    return StepResult(loss_sum / max(targets, 1.0), grad_norm, skipped, t1 - t0,
                      time.perf_counter() - t1, overflow)
