"""The per-worker training loop: build, restore, then for each step forward/backward, step, log.

It reads top to bottom like nanoGPT: `train_loop` -> `train_step` -> `forward_backward`. Everything
Ray-specific (checkpoints, data shard, logging actor) sits behind the `WorkerEnv` protocol (see
`worker.py`), so a step is plain torch and torch.distributed and runs in a 2-process gloo test
without Ray. The loop does not know which model it trains, nor its loss: both come in as a
`losses.LossModule` that maps a batch to (loss sum, targets).
"""

from __future__ import annotations

import math
import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np
import psutil
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic_train.blocks import BlockReader, BlockTable, iter_rank_steps, make_reader
from elastic_train.checkpoint import (
    BestCheckpointWriter,
    load_checkpoint,
    load_comm_hook_state,
    read_state,
    snapshot,
)
from elastic_train.commhooks import (
    PowerSGDState,
    ddp_kwargs,
    forget_powersgd_memory,
    load_powersgd_state,
    powersgd_state_dict,
    register_comm_hook,
)
from elastic_train.config import (
    Config,
    ReduceChoice,
    check_compression,
    choose_grad_reduce,
    num_partitions,
)
from elastic_train.data import MicroBatch, Prefetcher
from elastic_train.losses import LossFn, LossModule
from elastic_train.model import (
    ModelFn,
    build_model,
    count_parameters,
    input_embedding_rows,
    model_flops_per_token,
)
from elastic_train.optim import (
    build_optimizer,
    lr_at,
    optimizer_state_bytes,
    set_lr,
    training_bytes_per_param,
)
from elastic_train.plan import StreamSpec, assign_blocks, owned_partitions, partition_balance, utilisation
from elastic_train.stragglers import RANK_BUSY, RANK_DATA_WAIT


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
                   max_skips: int) -> bool:
        """Count one trained step (`skipped`: its gradient was non-finite, nothing applied); True
        when `max_skips` steps in a row were skipped (the non-finite policy acts then)."""
        self.skipped_steps += skipped
        self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0
        self.step += 1
        self.step_in_epoch += 1
        self.real_tokens += int(real)
        self.padded_tokens += int(padded)
        self.rows += int(rows)
        return self.consecutive_skips >= max_skips


class NonFiniteError(RuntimeError):
    """Gradients stayed non-finite after a rollback: the run stops and names the batch."""


class ModelTooLargeError(RuntimeError):
    """The model cannot fit the device: the run stops at once (a restart would not help)."""


def check_fits_device(model: torch.nn.Module, cfg: Config, device: torch.device,
                      grad_reduce: str) -> None:
    """On a GPU, refuse a model whose weights, gradients, optimizer state and reduction buffers
    (of `grad_reduce`, the resolved reduction) alone exceed the device's memory (README: "How
    large a model fits")."""
    if device.type != "cuda":
        return
    per_param = training_bytes_per_param(cfg.optim.name, grad_reduce, cfg.train.grad_compression)
    needed = count_parameters(model) * per_param
    total = torch.cuda.get_device_properties(device).total_memory
    if needed > total:
        raise ModelTooLargeError(
            f"model of {count_parameters(model) / 1e9:.2f}B parameters needs {needed / 2**30:.1f} GiB "
            f"({per_param:.0f} bytes per parameter with optim.name={cfg.optim.name} and "
            f"train.grad_reduce={grad_reduce}) before activations; the GPU has "
            f"{total / 2**30:.1f} GiB")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gather_from_all(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order (just [value] without a process group)."""
    if _distributed():
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, value)
        return out
    return [value]


_collective_s = 0.0  # this process's running time inside the loop's all-reduces (one loop a process)


def _all_reduce(t: torch.Tensor) -> None:
    """dist.all_reduce, timed: a rank's step time less its time in collectives is its own work
    (busy time). Every rank of a synchronous step takes as long as the slowest; only the busy
    time tells the straggler from the ranks that wait for it."""
    global _collective_s
    t0 = time.perf_counter()
    dist.all_reduce(t)
    _collective_s += time.perf_counter() - t0


def collective_seconds() -> float:
    """Seconds this process has spent in the loop's all-reduces so far."""
    return _collective_s


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum a few numbers over all ranks in one collective (identity without a process group)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if _distributed():
        _all_reduce(t)
    return t.tolist()


def rank_slots(world_size: int, rank: int, *values: float) -> list[float]:
    """One vector of `world_size` slots per value, zero but for this rank's slot: summed over
    ranks (in the step's one all-reduce), every rank's values, in rank order."""
    out = [0.0] * (world_size * len(values))
    for i, value in enumerate(values):
        out[i * world_size + rank] = value
    return out


def autocast_context(precision: str, device: torch.device):
    if precision == "fp32":
        return nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


class ExactGradSum:
    """World-size-invariant gradient reduction (`train.grad_reduce=exact`).

    A micro-batch's gradient does not depend on the world size: the same rows, the same weights.
    What does is the order in which they are summed: one rank adds 8 of them in turn, two ranks add
    4 each and then each other's sums, and fp32 rounds differently. Here each micro-batch's gradient
    is added to a float64 buffer as soon as its backward ends, and the buffers are all-reduced in
    float64: a sum of fp32 numbers in float64 is exact, or off by 2**-53 relative, far below the
    2**-24 of the final cast back to fp32, so the gradient comes out the same to the bit whatever the
    order. The model is not wrapped in DDP on this path; there is one all-reduce per step.

    Exact, precisely, while one parameter's K summands span fewer than about 28 - log2(K) binary
    orders of magnitude (24 significant bits each, 53 in float64). Beyond that float64 rounds, and
    the fp32 result then depends on the order when the exact sum lies within that rounding of an
    fp32 rounding boundary: roughly K * 2**-28 per rounded element. We measured how often float64
    rounds at all (benchmarks/reduce.py, BENCHMARKS.md) and keep float64 rather than an int64
    fixed-point sum, which is order-independent by construction but needs its shared exponent (a
    MAX all-reduce over every micro-batch's gradient) before the first micro-batch is added: that
    means holding every micro-batch's gradient, or a second backward, or redoing a step whose
    gradient outgrew a guessed exponent; and one exponent per tensor drops the low bits of its
    small elements, which the fp32 gradient keeps.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, extra: int = 0) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        numel = sum(p.numel() for p in self.params)
        # `extra` float64 slots after the gradients: numbers that ride in the same all-reduce
        # (in-place recovery reduces everything of a step in one fault-tolerant collective)
        self.buffer = torch.zeros(numel + extra, dtype=torch.float64, device=device)
        self.flat, self.extra = self.buffer[:numel], self.buffer[numel:]
        self.views, offset = [], 0
        for p in self.params:
            self.views.append(self.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def add_grads(self) -> None:
        """Move the gradients of the backward that just ended into the float64 sum."""
        for p, acc in zip(self.params, self.views, strict=True):
            if p.grad is not None:
                acc.add_(p.grad)
                p.grad = None

    def finish(self) -> None:
        """All-reduce the sums and leave them in `.grad` (fp32), ready for clipping and the step."""
        if _distributed():
            _all_reduce(self.flat)
        self.set_grads()

    def set_grads(self, divisor: float | None = None) -> None:
        """The (reduced) sums, divided by `divisor` in float64 if given, into `.grad`; the
        buffer is zeroed for the next step."""
        for p, acc in zip(self.params, self.views, strict=True):
            p.grad = (acc if divisor is None else acc / divisor).to(p.dtype, copy=True)
        self.buffer.zero_()

    @staticmethod
    def broadcast_parameters(model: torch.nn.Module) -> None:
        """Start every rank from rank 0's weights, as DDP's constructor does."""
        if _distributed():
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(t.data, src=0)


def micro_batch_seed(seed: int, step: int, partition: int) -> int:
    """The RNG seed of one micro-batch (dropout): a function of the step and partition, so that
    random ops, like the data, do not depend on the world size or on restarts."""
    return int(np.random.SeedSequence([seed, step, partition]).generate_state(1, np.uint64)[0] >> 1)


def dry_rank_batch(template: MicroBatch | None, pad_id: int,
                   extra_columns: tuple[str, ...] = ()) -> MicroBatch:
    """A one-row micro-batch for a rank whose partitions ran dry (its loss is multiplied by 0):
    the first row of a real micro-batch when this process has seen one, so that a user's loss
    finds its extra columns; else two pad tokens, with zeros in the extra columns."""
    if template is not None:
        extras = {k: v[:1] for k, v in template.extras.items()}
        return MicroBatch(template.partition, template.ids[:1], template.tokens[:1],
                          template.lengths[:1], extras)
    tokens = np.full((1, 2), pad_id, dtype=np.int64)
    extras = {name: np.zeros(1, np.int64) for name in extra_columns}
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


def forward_backward(
    model: torch.nn.Module,
    micro_batches: list[MicroBatch],
    *,
    setup: StepSetup,
    global_targets: float,
    step: int = 0,
    dry_template: MicroBatch | None = None,
) -> tuple[torch.Tensor, float]:
    """Accumulate this rank's share of one global step's gradient: (its loss sum, its targets).

    `model` maps a batch to (loss sum, targets) (`losses.LossModule`, maybe in DDP). The result in
    `.grad` is the gradient of (total loss / `global_targets`) over the global batch, the same as
    one process computes on the whole batch. With `setup.exact`, each micro-batch's loss sum is
    scaled by 1 / global_targets and the gradients summed by `ExactGradSum`. Without it (DDP), by
    world_size / global_targets, since DDP averages over ranks, and DDP syncs only on the last
    backward.
    """
    exact, scaler = setup.exact, setup.scaler
    scale = (1.0 if exact is not None else setup.world_size) / max(global_targets, 1.0)
    if not micro_batches and exact is None:
        # This rank's partitions ran dry in the epoch's last steps: join DDP's all-reduce with a
        # zero gradient, through the user's model and loss (DDP's reducer is prepared as usual).
        with autocast_context(setup.precision, setup.device):
            dry = dry_rank_batch(dry_template, setup.pad_id, setup.extra_columns)
            loss_sum, _ = model(dry.to_batch(setup.device))
        (scaler.scale(loss_sum * 0.0) if scaler is not None else loss_sum * 0.0).backward()
        return torch.zeros((), dtype=torch.float64, device=setup.device), 0.0
    total, targets = accumulate(model, micro_batches, setup=setup, scale=scale, step=step)
    if exact is not None:
        exact.finish()  # an empty rank joins the all-reduce with zeros
    return total, targets


def accumulate(model: torch.nn.Module, micro_batches: list[MicroBatch], *, setup: StepSetup,
               scale: float, step: int) -> tuple[torch.Tensor, float]:
    """Forward and backward each micro-batch (its loss sum times `scale`), its random ops seeded by
    (seed, step, partition); with `setup.exact` each gradient goes into the float64 sum at once,
    in DDP only the last backward syncs. Returns (loss sum in float64, targets)."""
    ddp = isinstance(model, DistributedDataParallel)
    exact, scaler, device = setup.exact, setup.scaler, setup.device
    backward = (lambda x: scaler.scale(x).backward()) if scaler is not None else torch.Tensor.backward
    total = torch.zeros((), dtype=torch.float64, device=device)
    targets = 0.0
    for i, mb in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        if setup.seed is not None:
            torch.manual_seed(micro_batch_seed(setup.seed, step, mb.partition))
        with nullcontext() if (last or not ddp) else model.no_sync():
            with autocast_context(setup.precision, device):
                loss_sum, n_targets = model(mb.to_batch(device))
            backward(loss_sum * scale)
        if exact is not None:
            exact.add_grads()
        total += loss_sum.detach().double()
        targets += float(n_targets)
    return total, targets


def rescale_grads(model: torch.nn.Module, factor: float) -> None:
    """Multiply every gradient by `factor` (a loss counted other targets than the data's)."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(factor)


def optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    grad_clip: float,
    local_loss: torch.Tensor,
    device: torch.device,
) -> tuple[float, float, bool]:
    """Clip and step unless any rank saw a non-finite gradient: (loss sum, grad norm, skipped)."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(
        model.parameters(), grad_clip if grad_clip > 0 else float("inf")
    )
    nonfinite = 0.0 if math.isfinite(float(norm)) else 1.0
    loss_sum, any_nonfinite = all_reduce_sum([float(local_loss), nonfinite], device)
    if any_nonfinite:
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            # As GradScaler does on an overflow, alike on every rank (one whose own gradient was
            # finite found no inf): scale * backoff_factor, and growth counting starts again.
            scaler.update(new_scale=scaler.get_scale() * scaler.get_backoff_factor())
            scaler.load_state_dict({**scaler.state_dict(), "_growth_tracker": 0})
        return loss_sum, float(norm), True
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    return loss_sum, float(norm), False


@dataclass
class StepResult:
    loss: float  # per target, over the global batch
    grad_norm: float
    skipped: bool
    forward_backward_s: float
    optimizer_s: float


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
    forward): the gradient is scaled by it as it accumulates, then, if the loss counted its own
    targets (`setup.count_targets`), corrected by data_targets / the loss's global count, so that
    the result is d(total loss / total targets) for any loss written as a sum.
    """
    set_lr(optimizer, lr)
    optimizer.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    local_loss, local_targets = forward_backward(
        model, micro_batches, setup=setup, global_targets=data_targets, step=step,
        dry_template=dry_template)
    targets = data_targets
    if setup.count_targets:
        (targets,) = all_reduce_sum([local_targets], setup.device)
        if targets != data_targets:
            rescale_grads(raw_model, data_targets / max(targets, 1.0))
    if poison is not None:
        poison(raw_model)
    t1 = time.perf_counter()
    loss_sum, grad_norm, skipped = optimizer_step(
        raw_model, optimizer, setup.scaler, setup.grad_clip, local_loss, setup.device)
    return StepResult(loss_sum / max(targets, 1.0), grad_norm, skipped, t1 - t0,
                      time.perf_counter() - t1)


class WorkerEnv(Protocol):
    """What `train_loop` uses of the outside world (Ray Train: `worker.RayWorkerEnv`; a plain
    gloo test can pass its own)."""

    device: torch.device
    world_rank: int
    world_size: int
    last_saved_step: int
    extra_columns: tuple[str, ...]  # the data set's columns beyond id/tokens/length
    block_table: BlockTable  # the data set's blocks (built by the driver from Parquet footers)
    eval_table: BlockTable | None  # the held-out blocks to evaluate on (None: no evaluation)
    provenance: dict[str, Any]  # what checkpoints record of what wrote them (provenance.py)
    startup: dict[str, float]  # when this attempt's start-up phases ended (time.time())

    def prepare_model(self, model: torch.nn.Module,
                      ddp_kwargs: dict[str, Any] | None) -> torch.nn.Module: ...
    def latest_checkpoint_dir(self) -> str | None: ...
    def save_checkpoint(self, snap: dict, step: int, final: bool) -> None: ...
    def checkpoint_requested(self) -> bool: ...
    def checkpoint_committed(self, step: int) -> None: ...
    def begin_attempt(self) -> int: ...
    def log_step(self, record: dict[str, Any]) -> None: ...
    def log_event(self, record: dict[str, Any]) -> None: ...
    def log_eval(self, record: dict[str, Any]) -> None: ...
    def best_writer(self) -> BestCheckpointWriter: ...  # keeps best checkpoints in the run folder
    def log_consumed(self, attempt: int, state: TrainState, micro_batches: list[MicroBatch]) -> None: ...
    def inject_faults(self, step: int) -> None: ...
    def maybe_crash_in_eval(self, step: int) -> None: ...
    def step_began(self, step: int) -> None: ...
    def step_ended(self, step_time_s: float | None) -> None: ...
    def maybe_poison_gradient(self, model: torch.nn.Module, step: int) -> None: ...
    def handle_nonfinite(self, step: int, micro_batches: list[MicroBatch]) -> None: ...


@dataclass
class Training:
    """Everything one attempt trains with, built and restored by `build_training`."""

    model: torch.nn.Module  # LossModule(raw_model, loss), on the device, maybe in DDP or compiled
    raw_model: torch.nn.Module  # the user's module: what checkpoints and the optimizer hold
    loss_module: LossModule  # LossModule(raw_model, loss) itself: evaluation calls it
    optimizer: torch.optim.Optimizer
    setup: StepSetup
    state: TrainState
    cursors: dict[int, tuple[int, int]] = field(default_factory=dict)  # this rank's, after the last step
    powersgd: PowerSGDState | None = None  # train.grad_compression=powersgd in DDP: this rank's state


def build_training(cfg: Config, env: WorkerEnv, model_fn: ModelFn | None = None,
                   loss_fn: LossFn | None = None, reduce_extra: int = 0) -> Training:
    """Resolve the reduction, build the model, move it to the device, then build the optimizer
    and restore the latest checkpoint. The order matters: the reduction decides whether the model
    goes into DDP, and a resumed run keeps the one its checkpoint names; on a GPU,
    `Optimizer.load_state_dict` puts the state on the device of the parameters it finds, so it
    must find them on the GPU already. `reduce_extra`: float64 slots after the gradient in the
    exact reduction's buffer (in-place recovery: inplace.py)."""
    torch.manual_seed(cfg.train.seed)
    ckpt_dir = env.latest_checkpoint_dir()
    choice = resolve_reduce(cfg, env, ckpt_dir)
    set_deterministic(cfg.train.deterministic, env.device)
    raw_model = build_model(cfg.model, cfg.data.max_seq_len, model_fn)
    env.startup["model_built"] = time.time()
    exact = choice.chosen == "exact"
    check_fits_device(raw_model, cfg, env.device, choice.chosen)
    loss_module = LossModule(raw_model, loss_fn)
    model = env.prepare_model(loss_module, None if exact else ddp_kwargs(cfg.train))
    powersgd = register_comm_hook(model, cfg.train)
    if env.world_rank == 0:
        compression = cfg.train.grad_compression if isinstance(model, DistributedDataParallel) else "none"
        env.log_event({"event": "grad_reduce", "chosen": choice.chosen, "reason": choice.reason,
                       "grad_compression": compression})
    optimizer = build_optimizer(raw_model, cfg.optim, cfg.scaling.use_gpu)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16) if cfg.train.precision == "fp16" else None
    state = TrainState()
    if ckpt_dir is not None:
        state = TrainState(**load_checkpoint(ckpt_dir, raw_model, optimizer, scaler))
        check_state_device(optimizer, env.device)
    state.grad_reduce = choice.chosen
    if powersgd is not None:
        restore_powersgd(powersgd, env, ckpt_dir, state.step)
    env.startup["restored"] = time.time()
    reducer = None
    if exact:
        ExactGradSum.broadcast_parameters(raw_model)
        reducer = ExactGradSum(raw_model, env.device, extra=reduce_extra)
    if cfg.train.compile:
        model = torch.compile(model)
    setup = StepSetup(
        device=env.device, world_size=env.world_size, precision=cfg.train.precision,
        grad_clip=cfg.train.grad_clip, seed=cfg.train.seed, scaler=scaler, exact=reducer,
        count_targets=loss_fn is not None, pad_id=cfg.data.pad_id or 0,
        extra_columns=env.extra_columns)
    return Training(model, raw_model, loss_module, optimizer, setup, state, powersgd=powersgd)


def resolve_reduce(cfg: Config, env: WorkerEnv, ckpt_dir: str | None) -> ReduceChoice:
    """`train.grad_reduce` for this attempt: the choice the checkpoint names if the run made one
    (config.choose_grad_reduce), and a compression setting it cannot honour refused (ConfigError;
    the driver refuses it before any worker starts when it can)."""
    if cfg.fault.recovery == "in_place":  # one fault-tolerant all-reduce of float64 sums
        return ReduceChoice("exact", "fault.recovery=in_place")
    saved = read_state(ckpt_dir)["train_state"].get("grad_reduce") if ckpt_dir else None
    choice = choose_grad_reduce(cfg.train, env.device.type == "cuda", saved)
    check_compression(cfg.train, choice)
    return choice


def set_deterministic(on: bool, device: torch.device) -> None:
    """train.deterministic: deterministic kernels only (torch raises for an op without one).
    cuBLAS needs a fixed workspace for that, set before its first use in the process."""
    if on and device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on)


def restore_powersgd(powersgd: PowerSGDState, env: WorkerEnv, ckpt_dir: str | None,
                     step: int) -> None:
    """At the world size of the checkpoint, each rank takes back its own PowerSGD state (error
    feedback, warm-start Q, step counter): the resume computes what an uninterrupted run does.
    At another (a resize) the saved states do not fit; the fresh state warms up again."""
    if ckpt_dir is None:
        return
    saved = load_comm_hook_state(ckpt_dir, "powersgd", env.world_rank, env.world_size)
    if saved is not None:
        load_powersgd_state(powersgd, saved, env.device)
    elif env.world_rank == 0:
        env.log_event({"event": "powersgd_reset", "step": step, "world_size": env.world_size,
                       "warmup_steps": powersgd.start_powerSGD_iter,
                       "reason": f"the checkpoint holds no PowerSGD state of {env.world_size} ranks"})


def check_state_device(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Every optimizer state tensor lies on the training device after a restore (on a GPU, state
    left on the CPU would make every step copy it, or fail)."""
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.device.type != device.type:
                raise RuntimeError(f"optimizer state restored on {value.device}, parameters on {device}")


def _epoch_stream(cfg: Config, reader: BlockReader, state: TrainState, partitions: list[int]) -> Prefetcher:
    """This rank's steps of `state.epoch` from where the state says the run is, read ahead."""
    spec = StreamSpec(num_partitions(cfg), cfg.data.micro_batch_tokens, cfg.data.shuffle_window,
                      cfg.data.seed, cfg.data.bucketing)
    cursors = {int(p): (c[0], c[1]) for p, c in state.cursors.items()}
    if state.step_in_epoch and not cursors:
        raise RuntimeError("checkpoint without data cursors mid-epoch (written by an older version)")
    return Prefetcher(
        iter_rank_steps(reader, spec, partitions=partitions, epoch=state.epoch, cursors=cursors,
                        pad_id=cfg.data.pad_id or 0),
        cfg.data.prefetch_steps,
    )


def _log_epoch_plan(env: WorkerEnv, cfg: Config, epoch: int) -> None:
    """How evenly the epoch's blocks fill the partitions (largest / mean tokens: the last steps,
    where smaller partitions are dry, leave ranks idle)."""
    k = num_partitions(cfg)
    assignment = assign_blocks(env.block_table.tokens, k, cfg.data.seed, epoch)
    env.log_event({"event": "epoch_plan", "epoch": epoch, "partitions": k,
                   "partition_balance": partition_balance(env.block_table.tokens, assignment),
                   "blocks_per_partition": min(len(a) for a in assignment)})


def _log_reads(env: WorkerEnv, attempt: int, reader: BlockReader) -> None:
    env.log_event({"event": "data_read", "attempt": attempt, "rank": env.world_rank,
                   "rows_read": reader.counter.rows, "bytes_read": reader.counter.bytes})


@dataclass
class EvalResult:
    loss: float  # per target token, over the whole evaluation (all ranks)
    targets: int
    micro_batches: int
    seconds: float


def evaluate(loss_module: LossModule, reader: BlockReader, spec: StreamSpec, partitions: list[int], *,
             setup: StepSetup, max_batches: int | None = None, on_batch=None) -> EvalResult:
    """The loss per target token over the held-out blocks of `reader`'s table.

    They are dealt to the run's K partitions and cut into micro-batches as a training epoch is
    (epoch 0 of that table), and this rank evaluates its partitions' micro-batches, the first
    `max_batches` of each: the same rows in the same micro-batches at any world size. Loss sums
    are added in float64 and all-reduced once; a float64 sum of fp32 losses is exact, so the
    result is the same to the bit at any world size (with the same weights: exact reduction).
    """
    t0 = time.perf_counter()
    total = torch.zeros((), dtype=torch.float64, device=setup.device)
    targets, count = 0.0, 0
    steps = iter_rank_steps(reader, spec, partitions=partitions, epoch=0, pad_id=setup.pad_id)
    loss_module.eval()  # no dropout
    try:
        with torch.no_grad():
            for j, (micro_batches, _) in enumerate(steps):
                if not micro_batches or (max_batches is not None and j >= max_batches):
                    break
                for mb in micro_batches:
                    with autocast_context(setup.precision, setup.device):
                        loss_sum, n_targets = loss_module(mb.to_batch(setup.device))
                    total += loss_sum.detach().double()
                    targets += float(n_targets)
                    count += 1
                    if on_batch is not None:
                        on_batch()
    finally:
        loss_module.train()
        reader.close()
    loss_sum, targets, count = all_reduce_sum([float(total), targets, count], setup.device)
    return EvalResult(loss_sum / max(targets, 1.0), int(targets), int(count),
                      time.perf_counter() - t0)


def run_eval(cfg: Config, env: WorkerEnv, t: Training, partitions: list[int], attempt: int,
             best: BestCheckpointWriter | None, log: bool) -> None:
    """Evaluate `partitions` after the current step; if `log`, log it; keep a new best
    checkpoint through `best` if given."""
    state = t.state
    reader = make_reader(cfg.data.reader, env.eval_table, env.extra_columns,
                         input_embedding_rows(t.raw_model))
    spec = StreamSpec(num_partitions(cfg), cfg.data.micro_batch_tokens, cfg.data.shuffle_window,
                      cfg.data.seed, cfg.data.bucketing)
    result = evaluate(t.loss_module, reader, spec, partitions, setup=t.setup,
                      max_batches=cfg.eval.max_batches,
                      on_batch=lambda: env.maybe_crash_in_eval(state.step))
    state.eval_step = state.step
    improved = state.best_eval_loss is None or result.loss < state.best_eval_loss
    if improved:
        state.best_eval_loss, state.best_step = result.loss, state.step
    if not log:
        return
    env.log_eval({"step": state.step, "epoch": state.epoch, "time": time.time(), "attempt": attempt,
                  "eval_loss": result.loss, "eval_perplexity": math.exp(min(result.loss, 700.0)),
                  "eval_targets": result.targets, "eval_micro_batches": result.micro_batches,
                  "eval_s": result.seconds, "best_eval_loss": state.best_eval_loss,
                  "best_step": state.best_step})
    if improved and best is not None:
        best.submit(snapshot(t.raw_model, t.optimizer, t.setup.scaler, asdict(state),
                             cfg.to_dict(), env.world_size, env.provenance), state.step, result.loss)


def _memory(process: psutil.Process) -> dict[str, int]:
    """The worker's resident memory, and the part of it that is its own: without the pages it
    shares (Ray's object store, mapped files), which grow as it touches more of them and are
    no leak of the process."""
    mem = process.memory_info()
    return {"rss_bytes": mem.rss, "rss_private_bytes": mem.rss - getattr(mem, "shared", 0)}


def train_loop(cfg: Config, env: WorkerEnv, model_fn: ModelFn | None = None,
               loss_fn: LossFn | None = None) -> None:
    """Run (or resume) training on this worker until max_steps or the last epoch."""
    t = build_training(cfg, env, model_fn, loss_fn)
    state, rank, world_size = t.state, env.world_rank, env.world_size
    attempt = env.begin_attempt()
    partitions = owned_partitions(rank, world_size, num_partitions(cfg))
    flops_per_token = model_flops_per_token(cfg.model, cfg.data.max_seq_len,
                                            count_parameters(t.raw_model))
    process = psutil.Process()
    state_logged = False  # optimizer-state bytes per parameter, logged once per attempt
    template = None  # a real micro-batch, for the dry-rank step (see dry_rank_batch)
    reader = make_reader(cfg.data.reader, env.block_table, env.extra_columns,
                         input_embedding_rows(t.raw_model))
    evaluating = env.eval_table is not None
    best = env.best_writer() if evaluating and cfg.checkpoint.keep_best and rank == 0 else None
    env.log_event({"event": "start", "attempt": attempt, "world_size": world_size,
                   "resumed_step": state.step, "rank": rank,
                   "utilisation": utilisation(num_partitions(cfg), world_size)})
    previous: tuple[float, float] | None = None  # this rank's (busy, data wait) of its last step
    tail_s = 0.0  # the last step's time after its record (the record's call, fault hooks)
    while state.step < cfg.train.max_steps and state.epoch < cfg.train.epochs:
        if rank == 0:
            _log_epoch_plan(env, cfg, state.epoch)
        stream = _epoch_stream(cfg, reader, state, partitions)
        try:
            while state.step < cfg.train.max_steps:
                t0, collective0 = time.perf_counter(), collective_seconds()
                env.step_began(state.step + 1)
                (micro_batches, cursors), wait_s = stream.next()
                env.startup.setdefault("first_batch", time.time())
                template = micro_batches[0] if micro_batches else template
                n_mb, targets, real, padded, rows, requested, *per_rank = all_reduce_sum(
                    [len(micro_batches), sum(mb.targets for mb in micro_batches),
                     sum(mb.real_tokens for mb in micro_batches),
                     sum(mb.padded_tokens for mb in micro_batches),
                     sum(len(mb.ids) for mb in micro_batches), env.checkpoint_requested(),
                     *rank_slots(world_size, rank, *(previous or (0.0, 0.0)))],
                    env.device,
                )
                if n_mb == 0:  # every rank's partitions are exhausted: the epoch is over
                    state.epoch, state.step_in_epoch, state.cursors = state.epoch + 1, 0, {}
                    env.step_ended(None)
                    break
                lr = lr_at(state.step, cfg.optim, cfg.train.max_steps)
                result = train_step(
                    t.model, t.raw_model, t.optimizer, micro_batches, setup=t.setup,
                    data_targets=targets, step=state.step, lr=lr, dry_template=template,
                    poison=lambda m: env.maybe_poison_gradient(m, state.step + 1))
                if result.skipped:
                    forget_powersgd_memory(t.powersgd)
                elif rank == 0 and not state_logged:  # the state exists after the first step
                    state_logged = True
                    env.log_event({"event": "optimizer_state", "bytes_per_param":
                                   optimizer_state_bytes(t.optimizer) / count_parameters(t.raw_model)})
                if state.count_step(result.skipped, real, padded, rows, cfg.train.max_consecutive_skips):
                    env.handle_nonfinite(state.step, micro_batches)
                t.cursors = cursors
                env.log_consumed(attempt, state, micro_batches)
                step_time_s = time.perf_counter() - t0
                if rank == 0 and "first_step" not in env.startup:
                    env.startup["first_step"] = time.time()
                    env.log_event({"event": "startup", "attempt": attempt, **env.startup})
                if rank == 0:
                    env.log_step(_step_record(
                        state, attempt=attempt, world_size=world_size, loss=result.loss, lr=lr,
                        grad_norm=result.grad_norm, real_tokens=int(real), padded_tokens=int(padded),
                        step_time_s=step_time_s, data_wait_s=wait_s,
                        forward_backward_s=result.forward_backward_s, optimizer_s=result.optimizer_s,
                        # host overhead: neither data wait nor compute (the counters' all-reduce,
                        # bookkeeping, actor calls), this step's and the last one's tail
                        host_s=step_time_s - wait_s - result.forward_backward_s - result.optimizer_s
                        + tail_s,
                        tokens_per_s=real / step_time_s,
                        mfu=flops_per_token * real / step_time_s / (cfg.log.peak_flops * world_size),
                        **_memory(process), skipped=result.skipped, rows=int(rows),
                        micro_batches=int(n_mb), **_cuda_memory(env.device),
                        **(_rank_fields(per_rank, world_size) if previous else {}),
                    ))
                env.inject_faults(state.step)
                step_s = time.perf_counter() - t0
                tail_s = step_s - step_time_s
                previous = (step_s - (collective_seconds() - collective0), wait_s)
                env.step_ended(step_s)
                if evaluating and cfg.eval.every_steps and state.step % cfg.eval.every_steps == 0:
                    run_eval(cfg, env, t, partitions, attempt, best, rank == 0)  # between steps: no watchdog
                periodic = cfg.checkpoint.every_steps and state.step % cfg.checkpoint.every_steps == 0
                if periodic or requested:
                    # requested: the driver expects a resize; commit it before going on (SYNC)
                    _log_reads(env, attempt, reader)
                    save(env, cfg, t, final=False, sync=bool(requested))
                    if requested:
                        env.checkpoint_committed(state.step)
        finally:
            stream.close()
            reader.close()
    if evaluating and state.eval_step != state.step:  # the end, unless just evaluated
        run_eval(cfg, env, t, partitions, attempt, best, rank == 0)
    if best is not None:
        best.wait()
    _log_reads(env, attempt, reader)
    save(env, cfg, t, final=True)


def _step_record(state: TrainState, **fields: Any) -> dict[str, Any]:
    record = {"step": state.step, "epoch": state.epoch, "time": time.time()}
    record.update(fields)
    record.update(skipped_steps=state.skipped_steps)
    return record


def _rank_fields(per_rank: list[float], world_size: int) -> dict[str, list[float]]:
    """Every rank's busy time and data wait of the step before (see `_all_reduce`), gathered by
    this step's all-reduce."""
    return {RANK_BUSY: per_rank[:world_size], RANK_DATA_WAIT: per_rank[world_size:]}


def _cuda_memory(device: torch.device) -> dict[str, int]:
    if device.type != "cuda":
        return {}
    return {"cuda_allocated_bytes": torch.cuda.memory_allocated(device),
            "cuda_reserved_bytes": torch.cuda.memory_reserved(device)}


def save(env: WorkerEnv, cfg: Config, t: Training, final: bool, sync: bool = False) -> float:
    """Snapshot this rank's share (the blocking part) and hand it to Ray to write in the background."""
    state = t.state
    if state.step == env.last_saved_step:  # e.g. the final save right after a periodic one
        return 0.0
    t0 = time.perf_counter()
    if state.step_in_epoch:  # every rank's partitions' cursors, so any world size can resume
        merged = {}
        for part in gather_from_all(t.cursors):
            merged.update(part)
        state.cursors = {str(p): list(c) for p, c in sorted(merged.items())}
    # Every rank copies and writes its share of the replicated state, in parallel (checkpoint.py),
    # and its own PowerSGD state (error feedback), which only it has.
    comm_hook = None
    if t.powersgd is not None:
        comm_hook = {"kind": "powersgd", "world_size": env.world_size,
                     "state": powersgd_state_dict(t.powersgd)}
    snap = snapshot(t.raw_model, t.optimizer, t.setup.scaler, asdict(state), cfg.to_dict(),
                    env.world_size, env.provenance, shard=env.world_rank, shards=env.world_size,
                    comm_hook=comm_hook)
    env.save_checkpoint(snap, state.step, final=final or sync)
    blocked_s = time.perf_counter() - t0
    if env.world_rank == 0:
        env.log_event({"event": "checkpoint", "step": state.step, "blocked_s": blocked_s,
                       "final": final})
    return blocked_s

