"""Build one attempt's `Training`: the reduction chosen, the model on its device (in DDP or not),
the optimizer, and the latest checkpoint restored, in the order that makes each of them right."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import psutil
import torch
from torch.nn.parallel import DistributedDataParallel

from elastic_train.config import (
    Config,
    ReduceChoice,
    check_compression,
    choose_grad_reduce,
)
from elastic_train.training.checkpoint import (
    load_checkpoint,
    load_comm_hook_state,
    read_state,
)
from elastic_train.training.commhooks import (
    PowerSGDState,
    ddp_kwargs,
    load_powersgd_state,
    register_comm_hook,
)
from elastic_train.training.compile import CompileWatch, compile_model, prepare_compile
from elastic_train.training.env import WorkerEnv
from elastic_train.training.lora import LoraModel
from elastic_train.training.lorashard import shard_frozen_base
from elastic_train.training.losses import LossFn, LossModule
from elastic_train.training.memory import (
    RAY_MEMORY_THRESHOLD,
    GiB,
    check_fits_memory,
    device_bytes,
    host_bytes_per_rank,
    model_shapes,
    peak_rss_bytes,
    return_large_frees_to_os,
)
from elastic_train.training.model import (
    ModelFn,
    build_meta_model,
    build_model,
    can_materialize,
    is_meta_model,
)
from elastic_train.training.optim import build_optimizer, set_hyperparameters
from elastic_train.training.reduce import ExactGradSum
from elastic_train.training.sharding import (
    ShardedReduce,
    load_sharded_checkpoint,
    shard_model,
)
from elastic_train.training.step import StepSetup, TrainState


def check_fits_rank(meta: torch.nn.Module, cfg: Config, env: WorkerEnv, grad_reduce: str) -> None:
    """Before any parameter is materialized: what this rank needs of the model built on the meta
    device against the GPU's memory, or on CPU the node's memory over the ranks sharing it
    (memory.py); ModelTooLargeError, one line, otherwise. (A user's factory that refuses the
    meta device is built on the CPU before it: `build_meta_model`.)"""
    if env.device.type == "cuda":
        available, where = device_bytes(env.device), "the GPU's memory"
    else:
        ranks = getattr(env, "local_world_size", env.world_size)
        node = psutil.virtual_memory().total
        available = host_bytes_per_rank(node, ranks)
        where = f"{RAY_MEMORY_THRESHOLD:.0%} of the node's {node / GiB:.1f} GiB over {ranks} rank(s)"
    check_fits_memory(model_shapes(meta, cfg), cfg, grad_reduce, env.world_size, available, where)


@dataclass
class Training:
    """Everything one attempt trains with, built and restored by `build_training`."""

    model: torch.nn.Module  # LossModule(raw_model, loss), on the device, maybe in DDP
    raw_model: torch.nn.Module  # the user's module: what checkpoints and the optimizer hold
    loss_module: LossModule  # LossModule(raw_model, loss) itself: evaluation calls it
    optimizer: torch.optim.Optimizer
    setup: StepSetup
    state: TrainState
    cursors: dict[int, tuple[int, int]] = field(default_factory=dict)  # this rank's, after the last step
    powersgd: PowerSGDState | None = None  # train.grad_compression=powersgd in DDP: this rank's state
    compiled: CompileWatch | None = None  # train.compile: counts and saves the compiled graphs
    build_peak_bytes: int | None = None  # this process's peak resident bytes once built and sharded


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
    meta = build_meta_model(cfg.model, cfg.data.max_seq_len, model_fn)
    check_fits_rank(meta, cfg, env, choice.chosen)  # before a byte of the model is allocated
    if cfg.train.sharding == "fsdp" and env.device.type == "cpu":
        return_large_frees_to_os()  # the step's block-sized buffers go back to the OS (memory.py)
    if not is_meta_model(meta):
        raw_model = meta  # a user's factory that refused meta, built for real: not built twice
    elif cfg.train.sharding == "fsdp" and can_materialize(meta):
        raw_model = meta  # sharded on meta, then each rank creates its own rows (sharding.py)
    else:
        raw_model = build_model(cfg.model, cfg.data.max_seq_len, model_fn)
    env.startup["model_built"] = time.time()
    exact = choice.chosen == "exact"
    loss_module = LossModule(raw_model, loss_fn)
    sharded = None
    if cfg.train.sharding == "fsdp":
        model, sharded = loss_module, _shard(loss_module, raw_model, cfg, env.device, exact)
    else:
        model = env.prepare_model(loss_module, None if exact else ddp_kwargs(cfg.train))
    build_peak_bytes = peak_rss_bytes()  # VmHWM: what building and sharding took at most
    powersgd = register_comm_hook(model, cfg.train)
    if env.world_rank == 0:
        compression = cfg.train.grad_compression if isinstance(model, DistributedDataParallel) else "none"
        env.log_event({"event": "grad_reduce", "chosen": choice.chosen, "reason": choice.reason,
                       "grad_compression": compression, "device": env.device.type,
                       "precision": cfg.train.precision,
                       "micro_batch_tokens": cfg.data.micro_batch_tokens})
    optimizer = build_optimizer(raw_model, cfg.optim, cfg.scaling.use_gpu)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16) if cfg.train.precision == "fp16" else None
    state = TrainState()
    if ckpt_dir is not None and sharded is not None:  # this rank's rows, from any world size
        state = TrainState(**load_sharded_checkpoint(ckpt_dir, raw_model, optimizer))
    elif ckpt_dir is not None:
        state = TrainState(**load_checkpoint(ckpt_dir, raw_model, optimizer, scaler))
        check_state_device(optimizer, env.device)
    set_hyperparameters(optimizer, cfg.optim)  # the config's, not the checkpoint's
    state.grad_reduce = choice.chosen
    if powersgd is not None:
        restore_powersgd(powersgd, env, ckpt_dir, state.step)
    env.startup["restored"] = time.time()
    reducer = None
    if exact and sharded is None:
        ExactGradSum.broadcast_parameters(raw_model)
        reducer = ExactGradSum(raw_model, env.device, extra=reduce_extra)
    compiled = prepare_compile(cfg, env.world_rank)  # caches set up before anything compiles
    if compiled is not None:  # in place: checkpoints, DDP and the optimizer see the eager module
        compiled.modules = compile_model(raw_model, cfg.train.compile_modules)
    setup = StepSetup(
        device=env.device, world_size=env.world_size, precision=cfg.train.precision,
        grad_clip=cfg.train.grad_clip, seed=cfg.train.seed, scaler=scaler, exact=reducer,
        count_targets=loss_fn is not None, pad_id=cfg.data.pad_id or 0,
        extra_columns=env.extra_columns, sharded=sharded, pad_multiple=cfg.data.pad_multiple or 1,
        max_width=cfg.data.max_seq_len)
    return Training(model, raw_model, loss_module, optimizer, setup, state, powersgd=powersgd,
                    compiled=compiled, build_peak_bytes=build_peak_bytes)


def _shard(loss_module: LossModule, raw_model: torch.nn.Module, cfg: Config, device: torch.device,
           exact: bool) -> ShardedReduce:
    """train.sharding=fsdp: FSDP2 in place of DDP (sharding.py); the exact reduction is FSDP's
    float64 reduce-scatter, so no ExactGradSum buffer. LoRA: the frozen base alone is sharded,
    the adapters reduced whole (lorashard.py)."""
    if isinstance(raw_model, LoraModel):
        return shard_frozen_base(loss_module, raw_model, exact=exact,
                                 reshard_after_forward=cfg.train.reshard_after_forward,
                                 shard_modules=cfg.model.shard_modules, device=device)
    return shard_model(loss_module, raw_model, exact=exact, precision=cfg.train.precision,
                       reshard_after_forward=cfg.train.reshard_after_forward,
                       shard_modules=cfg.model.shard_modules, device=device)


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
