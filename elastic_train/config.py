"""Run configuration: a tree of dataclasses loaded from YAML with strict keys and dotted overrides.

`load_config(path, overrides)` reads the YAML file (or the embedded default), applies `key=value`
overrides, checks every key and type, validates cross-field constraints and returns a `Config`.
Any problem raises `ConfigError` with one message that names the culprit.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DEFAULT_CONFIG_PATH = Path(__file__).parent / "configs" / "default.yaml"


class ConfigError(ValueError):
    """A config that cannot run; the message names the key, value or path at fault."""


@dataclass
class RunConfig:
    name: str = "default"  # run folder name under storage_path; the same name resumes that run
    storage_path: str = "./runs"  # local folder or a pyarrow.fs URI (s3://, gs://, ...)
    address: str | None = None  # Ray cluster to join; None: RAY_ADDRESS, else a new local cluster
    num_cpus: int | None = None  # logical CPUs of a new local cluster; None: enough for workers + data
    # a new local cluster only (both): its Ray dashboard at http://127.0.0.1:8265 (off: less CPU
    # for Ray, and Ray Train's state API and dashboard pages are absent); and its Ray daemons and
    # helper actors yield the CPU to the training processes (cpushare.py)
    dashboard: bool = False
    train_first: bool = True


@dataclass
class ScalingConfig:
    min_workers: int = 2  # the run starts once this many workers fit
    max_workers: int = 2  # and grows up to this many when the cluster has room
    use_gpu: bool = False  # one GPU per worker, NCCL; False: CPU workers, gloo
    max_failures: int = 3  # restarts allowed before the run fails (-1: unlimited)
    cpus_per_worker: float = 1.0  # CPUs each worker reserves
    resources_per_worker: dict[str, float] = field(default_factory=dict)  # extra Ray resources
    health_check_interval_s: float = 0.2  # controller poll; ray.train.report waits for it
    # give up reserving a group of this size after this long and decide again (not a failure); after
    # a node loss the first restart may ask for the old size and wait this long: keep it short
    worker_group_start_timeout_s: float = 15.0
    resize_monitor_interval_s: float = 5.0  # how often an elastic run looks for room to grow
    preemption_poll_interval_s: float = 1.0  # how often Ray looks for nodes being drained (spot notices)
    torch_threads: int = 1  # intra-op threads per CPU worker
    # a collective (all-reduce, barrier) that waits longer fails the attempt, so Ray restarts the
    # group instead of idling every GPU for torch's default 30 minutes; also the longest a step may
    # run (the step watchdog then ends that worker) and the longest a frozen worker may leave Ray's
    # health check unanswered
    collective_timeout_s: int = 300
    slow_step_factor: float = 10.0  # a step this many times the recent median is reported (event)


@dataclass
class DataConfig:
    path: str | None = None  # folder of Parquet shards; None: the embedded stdlib corpus
    seed: int = 0  # fixes the order of every epoch
    record_ids: bool = False  # write consumed/*.jsonl: the sample ids of each (attempt, rank, step)
    bucketing: bool = True  # length-bucketed batches; False: random batches (for comparison)
    max_seq_len: int = 512  # longest row, in tokens; prepare splits longer documents
    micro_batch_tokens: int = 2048  # padded tokens (rows x longest row) in one micro-batch
    global_batch_tokens: int = 16384  # padded-token budget of one optimizer step, any world size
    shuffle_window: int = 1024  # rows shuffled, sorted by length and bucketed together
    prefetch_steps: int = 2  # steps assembled ahead of the loop by a background thread
    pad_id: int | None = None  # token that pads rows; None: the data set's tokenizer pad id, else 0
    reader: str = "pyarrow"  # pyarrow: each worker streams the shards itself; ray_data: Ray Data
    # resuming a run whose data identity (path, seed, partitions, shards) differs from its
    # checkpoint's: refuse | keep_position (resume at the saved (epoch, step) of the other data)
    on_change: str = "refuse"


@dataclass
class ModelConfig:
    # gpt: the embedded byte-level GPT | hf: a transformers causal LM from `path` |
    # "package.module:function": called with vocab_size, max_seq_len and `kwargs`, returns an nn.Module
    name: str = "gpt"
    path: str | None = None  # hf: folder (or pyarrow.fs URI) with config.json, weights optional
    kwargs: dict[str, Any] = field(default_factory=dict)  # import path: extra keyword arguments
    vocab_size: int | None = None  # None: the data set's tokenizer size (256 for bytes)
    gradient_checkpointing: bool = False  # recompute activations in backward (non-reentrant)
    trust_remote_code: bool = False  # hf: run the model's own code from `path`
    n_layer: int = 2  # gpt only, like the three below
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.0


@dataclass
class TrainConfig:
    max_steps: int = 300  # stop after this many optimizer steps ...
    epochs: int = 1  # ... or after this many passes over the data, whichever comes first
    precision: str = "fp32"  # fp32 | bf16 | fp16 (fp16: GPU only)
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    seed: int = 0  # model initialisation
    max_consecutive_skips: int = 3  # non-finite steps in a row before rolling back
    compile: bool = False  # torch.compile the model
    # exact: sum micro-batch gradients and all-reduce them in float64, so a step's gradient is the
    # same to the bit at any world size (8 bytes/param more memory, twice the all-reduce bytes);
    # ddp: torch DDP (fp32, overlaps the last backward), curves differ by fp32 round-off across sizes;
    # auto: ddp on GPU workers, exact on CPU workers and with `deterministic`. Chosen once, at the
    # run's first start, and kept in its checkpoints (see `choose_grad_reduce`)
    grad_reduce: str = "auto"
    # torch.use_deterministic_algorithms (and CUBLAS_WORKSPACE_CONFIG on GPU): the same result on
    # every run, at the cost of slower kernels (or an error for an op that has no deterministic
    # form); makes `auto` choose exact
    deterministic: bool = False
    # ddp only: DDP communication hook. fp16 | bf16: all-reduce gradients in half precision (half
    # the bytes); powersgd: low-rank compression with error feedback (Vogels et al. 2019)
    grad_compression: str = "none"
    powersgd_rank: int = 2  # powersgd: rank of each gradient matrix's approximation
    # powersgd: plain all-reduce for this many steps first (also after a resize); >= 2, and no fewer
    # than optim.warmup_steps is a good rule (torch's PowerSGD docs)
    powersgd_warmup_steps: int = 20
    ddp_bucket_mb: float = 25.0  # ddp only: gradient bucket size; one all-reduce per bucket
    # ddp only: gradients are views into DDP's buckets (saves one gradient-sized copy: 4 bytes/param)
    # (DDP's static_graph is not offered: torch 2.13 fails an internal assert when the first step
    # accumulates under no_sync, which any step with more micro-batches than ranks does)
    gradient_as_bucket_view: bool = False


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | adamw8bit
    lr: float = 3e-3  # peak learning rate
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    warmup_steps: int = 20  # linear warmup, then cosine decay to min_lr_ratio * lr at max_steps
    min_lr_ratio: float = 0.1


@dataclass
class EvalConfig:
    # held-out data: a prepared data set of its own, or this share of data.path's blocks (whole
    # Parquet row groups, picked by a salted hash of their file and row group) never trained on
    path: str | None = None
    fraction: float = 0.0
    every_steps: int = 0  # evaluate after every N steps (0: only at the end) and at the end
    max_batches: int | None = None  # bound an evaluation to its first N global batches


@dataclass
class CheckpointConfig:
    every_steps: int = 50  # 0: only at the end
    keep: int = 2  # newest complete checkpoints kept
    keep_best: bool = False  # also keep the checkpoint of the lowest eval loss (best_checkpoint/)


@dataclass
class FaultConfig:
    # after a worker dies: restart (Ray restarts the whole group from the last committed
    # checkpoint; resizes too) | in_place (torchft: the others train on at once, taking over its
    # data partitions; Ray replaces it and it heals from a live peer; fixed worker count)
    recovery: str = "restart"
    # in place: a replica missing from every step this long is frozen (SIGSTOP, a stalled machine)
    # and its process is ended by a task on its node (fence.py); None: its own step watchdog's
    # deadline (3 x scaling.collective_timeout_s) + 10 s, when a process that can run has ended itself
    fence_after_s: float | None = None
    crash_at_step: int | None = None  # test hook: that rank's process dies hard once at this step
    crash_rank: int = 0
    crash_in_checkpoint: bool = False  # die in the middle of writing the checkpoint of that step
    nan_at_step: int | None = None  # test hook: poison one rank's gradient at this step
    nan_rank: int = 0
    nan_repeat: bool = False  # poison it on every attempt (tests rollback, then failure)
    crash_in_eval: bool = False  # die in the middle of the evaluation after crash_at_step
    hang_at_step: int | None = None  # test hook: that rank's step blocks forever, once, at this step
    hang_rank: int = 0
    slow_rank: int | None = None  # test hook: this rank sleeps slow_step_s in every step
    slow_step_s: float = 0.0
    # test hook (an elastic run's grow, without a race against the run's end): rank 0 waits after
    # this step until a joining node asks for a checkpoint, takes it after the next step, then
    # holds a step later until Ray replaces the group at its new size
    hold_for_resize_at_step: int | None = None
    # test hook (in place: a replacement that surely joins before the run ends): a rank that ends
    # this step waits until a replacement has joined the run (a lost rank never gets there, and
    # a replacement heals to the survivors' step and goes on from the next)
    wait_for_replacement_at_step: int | None = None


@dataclass
class LogConfig:
    print_every_steps: int = 10  # a progress line every N steps when not on a terminal
    progress: str = "auto"  # auto | bar | lines | none
    tensorboard: bool = False
    peak_flops: float = 1e12  # per worker, for the MFU estimate


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check (and widen int -> float) a YAML value against a field's annotation."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        _, vt = typing.get_args(tp)
        return {str(k): _coerce(v, vt, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) is dict:
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _build(cls: type, raw: Any, prefix: str) -> Any:
    """Build dataclass `cls` from a mapping, rejecting unknown keys by their dotted name."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise ConfigError(f"unknown config key '{dotted}' (known: {', '.join(sorted(names))})")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value if value is not None else {}, dotted)
        else:
            kwargs[key] = _coerce(value, tp, dotted)
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:  # an absent or empty section
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override '{dotted}': '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=value` -> ("a.b", value); the value is read as a YAML scalar or flow mapping."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override '{text}': expected dotted.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).split())
        raise ConfigError(f"override '{text}': value is not valid YAML ({detail})") from None
    return key.strip(), value


def load_config(
    path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None
) -> Config:
    """Load a config file (None: the embedded default), apply overrides, validate."""
    source = Path(path) if path is not None else DEFAULT_CONFIG_PATH
    if not str(path if path is not None else source).strip():
        raise ConfigError("--config: an empty path")
    if source.is_dir():
        raise ConfigError(f"config file '{source}' is a folder, not a YAML file")
    if not source.is_file():
        raise ConfigError(f"config file '{source}' does not exist")
    try:
        tree = yaml.safe_load(source.read_bytes().decode("utf-8")) or {}
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file '{source}' is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"config file '{source}' cannot be read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).split())
        raise ConfigError(f"config file '{source}' is not valid YAML: {detail}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config file '{source}': top level must be a mapping")
    items = overrides.items() if isinstance(overrides, dict) else map(parse_override, overrides or [])
    for key, value in items:
        _set_dotted(tree, key, value)
    cfg = _build(Config, tree, "")
    validate(cfg)
    return cfg


def config_from_dict(tree: dict[str, Any]) -> Config:
    """Rebuild a Config from `Config.to_dict()` output (e.g. a checkpoint's saved config)."""
    cfg = _build(Config, tree, "")
    validate(cfg)
    return cfg


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def check_run_name(name: str) -> None:
    """`run.name` is one plain folder name: the run folder must lie inside run.storage_path."""
    plain = (bool(name) and name.strip() == name and name not in (".", "..")
             and not any(c in name for c in "/\\\0") and len(name.encode()) <= 255
             and name.isprintable())
    _require(plain, f"run.name must be a plain folder name (no '/', not '.' or '..', no "
                    f"surrounding spaces), got {name!r}")


def _finite_floats(node: Any, prefix: str) -> None:
    """Every float in the config is finite: inf or nan can never be a useful setting."""
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), f"{prefix}.{f.name}"
        if dataclasses.is_dataclass(value):
            _finite_floats(value, f.name)
        elif isinstance(value, float):
            _require(math.isfinite(value), f"{key} must be a finite number, got {value}")
        elif isinstance(value, dict):
            for k, v in value.items():
                _require(not isinstance(v, float) or math.isfinite(v),
                         f"{key}.{k} must be a finite number, got {v}")


def _at_least(key: str, value: float | None, low: float, *, strict: bool = False) -> None:
    if value is None:
        return
    ok = value > low if strict else value >= low
    _require(ok, f"{key} must be {'>' if strict else '>='} {low:g}, got {value}")


def validate(cfg: Config) -> None:
    """Every value's range and every cross-field rule that needs no data and no cluster."""
    s, d, t, o = cfg.scaling, cfg.data, cfg.train, cfg.optim
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if dataclasses.is_dataclass(section):
            _finite_floats(section, f.name)
    check_run_name(cfg.run.name)
    _require(bool(cfg.run.storage_path.strip()), "run.storage_path: an empty path")
    _require(cfg.run.address is None or bool(cfg.run.address.strip()), "run.address: empty")
    _at_least("run.num_cpus", cfg.run.num_cpus, 1)
    _validate_scaling(s)
    _validate_data(d, s)
    _require(t.max_steps >= 1, f"train.max_steps must be >= 1, got {t.max_steps}")
    _require(t.epochs >= 1, f"train.epochs must be >= 1, got {t.epochs}")
    _require(
        t.precision in ("fp32", "bf16", "fp16"),
        f"train.precision must be fp32, bf16 or fp16, got {t.precision!r}",
    )
    _validate_reduce(t)
    _require(
        t.precision != "fp16" or s.use_gpu,
        "train.precision=fp16 needs scaling.use_gpu=true (fp16 autocast and GradScaler are "
        "GPU features); use bf16 on CPU",
    )
    _require(t.max_consecutive_skips >= 1, "train.max_consecutive_skips must be >= 1")
    _at_least("train.grad_clip", t.grad_clip, 0)
    _at_least("train.seed", t.seed, 0)
    _require(o.name in ("adamw", "adamw8bit"), f"optim.name must be adamw or adamw8bit, got {o.name!r}")
    _require(o.lr > 0, f"optim.lr must be > 0, got {o.lr}")
    _at_least("optim.weight_decay", o.weight_decay, 0)
    for key, beta in (("optim.beta1", o.beta1), ("optim.beta2", o.beta2)):
        _require(0 <= beta < 1, f"{key} must be in [0, 1), got {beta}")
    _require(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    _require(o.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {o.warmup_steps}")
    _require(cfg.checkpoint.every_steps >= 0,
             f"checkpoint.every_steps must be >= 0, got {cfg.checkpoint.every_steps}")
    _require(cfg.checkpoint.keep >= 1, f"checkpoint.keep must be >= 1, got {cfg.checkpoint.keep}")
    _validate_eval(cfg.eval, cfg.checkpoint)
    _validate_model(cfg.model)
    _validate_fault(cfg.fault, s)
    if cfg.fault.recovery == "in_place":
        _validate_in_place(cfg)
    _require(
        cfg.log.progress in ("auto", "bar", "lines", "none"),
        f"log.progress must be auto, bar, lines or none, got {cfg.log.progress!r}",
    )
    _at_least("log.print_every_steps", cfg.log.print_every_steps, 1)
    _at_least("log.peak_flops", cfg.log.peak_flops, 0, strict=True)


def _validate_reduce(t: TrainConfig) -> None:
    _require(t.grad_reduce in ("auto", "exact", "ddp"),
             f"train.grad_reduce must be auto, exact or ddp, got {t.grad_reduce!r}")
    _require(t.grad_compression in GRAD_COMPRESSIONS,
             f"train.grad_compression must be {', '.join(GRAD_COMPRESSIONS[:-1])} or "
             f"{GRAD_COMPRESSIONS[-1]}, got {t.grad_compression!r}")
    # What is refused on any device; `auto` on CPU workers is refused by the driver, which knows
    # the choice saved in the run's checkpoint (checks.check_reduce).
    check_compression(t, choose_grad_reduce(t, use_gpu=True))
    _require(t.powersgd_rank >= 1, f"train.powersgd_rank must be >= 1, got {t.powersgd_rank}")
    # torch's PowerSGDState refuses fewer: DDP rebuilds its buckets after the first step, and the
    # error feedback is kept per bucket
    _require(t.powersgd_warmup_steps >= 2,
             f"train.powersgd_warmup_steps must be >= 2, got {t.powersgd_warmup_steps}")
    _at_least("train.ddp_bucket_mb", t.ddp_bucket_mb, 0, strict=True)


GRAD_COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")


@dataclass(frozen=True)
class ReduceChoice:
    """Which gradient reduction a run uses (`exact` or `ddp`), and why (for events and summary)."""

    chosen: str
    reason: str


def choose_grad_reduce(t: TrainConfig, use_gpu: bool, saved: str | None = None) -> ReduceChoice:
    """Resolve `train.grad_reduce`. An explicit exact or ddp is used as set; `auto` is exact with
    `train.deterministic`, else the choice `saved` in the run's checkpoint (made at its first
    start: a resume on other nodes or devices keeps the numerics it began with), else ddp on GPU
    workers (DDP overlaps communication with backward and needs no float64 buffer) and exact on CPU
    workers (small models, where the bitwise guarantee costs little)."""
    if t.grad_reduce != "auto":
        return ReduceChoice(t.grad_reduce, f"train.grad_reduce={t.grad_reduce}")
    if t.deterministic:
        return ReduceChoice("exact", "auto: train.deterministic=true")
    if saved in ("exact", "ddp"):
        return ReduceChoice(saved, "auto: kept from the run's checkpoint (chosen at its first start)")
    if use_gpu:
        return ReduceChoice("ddp", "auto: GPU workers")
    return ReduceChoice("exact", "auto: CPU workers")


def check_compression(t: TrainConfig, choice: ReduceChoice) -> None:
    """A communication hook needs the ddp reduction: refuse it with exact, saying why exact ran."""
    _require(choice.chosen == "ddp" or t.grad_compression == "none",
             f"train.grad_compression={t.grad_compression} needs train.grad_reduce=ddp, but the "
             f"run reduces exactly ({choice.reason}): exact sums float64 gradients so that a step "
             "is the same to the bit at any world size, which compression would break. Set "
             "train.grad_reduce=ddp, or train.grad_compression=none")


def _validate_scaling(s: ScalingConfig) -> None:
    _require(s.min_workers >= 1, f"scaling.min_workers must be >= 1, got {s.min_workers}")
    _require(
        s.max_workers >= s.min_workers,
        f"scaling.min_workers ({s.min_workers}) > scaling.max_workers ({s.max_workers})",
    )
    _at_least("scaling.cpus_per_worker", s.cpus_per_worker, 0, strict=True)
    _require(s.max_failures >= -1, f"scaling.max_failures must be >= -1, got {s.max_failures}")
    for key in ("health_check_interval_s", "worker_group_start_timeout_s",
                "resize_monitor_interval_s", "preemption_poll_interval_s", "collective_timeout_s"):
        _at_least(f"scaling.{key}", getattr(s, key), 0, strict=True)
    _at_least("scaling.torch_threads", s.torch_threads, 1)
    _at_least("scaling.slow_step_factor", s.slow_step_factor, 1, strict=True)
    for name, amount in s.resources_per_worker.items():
        _require(name not in ("CPU", "GPU"), f"scaling.resources_per_worker.{name}: set it with "
                 f"scaling.{'cpus_per_worker' if name == 'CPU' else 'use_gpu'} instead")
        _at_least(f"scaling.resources_per_worker.{name}", amount, 0, strict=True)


def _validate_data(d: DataConfig, s: ScalingConfig) -> None:
    _require(d.path is None or bool(d.path.strip()), "data.path: an empty path (null: the "
                                                     "embedded corpus)")
    _at_least("data.seed", d.seed, 0)
    _require(d.max_seq_len >= 2, f"data.max_seq_len must be >= 2, got {d.max_seq_len}")
    _require(
        d.micro_batch_tokens >= d.max_seq_len,
        f"data.micro_batch_tokens ({d.micro_batch_tokens}) is smaller than data.max_seq_len "
        f"({d.max_seq_len}): the longest row would not fit in a micro-batch",
    )
    _require(
        d.global_batch_tokens % d.micro_batch_tokens == 0,
        f"data.global_batch_tokens ({d.global_batch_tokens}) is not a multiple of "
        f"data.micro_batch_tokens ({d.micro_batch_tokens})",
    )
    partitions = d.global_batch_tokens // d.micro_batch_tokens
    _require(
        partitions >= s.max_workers,
        f"data.global_batch_tokens ({d.global_batch_tokens}) cannot be split among "
        f"scaling.max_workers ({s.max_workers}): it holds {partitions} micro-batches of "
        f"data.micro_batch_tokens ({d.micro_batch_tokens}); it needs at least one per worker",
    )
    _require(d.shuffle_window >= 1, f"data.shuffle_window must be >= 1, got {d.shuffle_window}")
    _require(d.prefetch_steps >= 1, f"data.prefetch_steps must be >= 1, got {d.prefetch_steps}")
    _at_least("data.pad_id", d.pad_id, 0)
    _require(d.reader in ("pyarrow", "ray_data"),
             f"data.reader must be pyarrow or ray_data, got {d.reader!r}")
    _require(d.on_change in ("refuse", "keep_position"),
             f"data.on_change must be refuse or keep_position, got {d.on_change!r}")


def _validate_eval(e: EvalConfig, c: CheckpointConfig) -> None:
    _require(e.path is None or bool(e.path.strip()), "eval.path: an empty path")
    _require(0 <= e.fraction < 0.5, f"eval.fraction must be in [0, 0.5), got {e.fraction}")
    _require(not (e.path and e.fraction), f"eval.path ({e.path}) and eval.fraction ({e.fraction}) "
                                          "both set: evaluate on one or the other")
    _at_least("eval.every_steps", e.every_steps, 0)
    _at_least("eval.max_batches", e.max_batches, 1)
    _require(not c.keep_best or eval_enabled(e), "checkpoint.keep_best needs an evaluation: set "
                                                 "eval.path or eval.fraction")


def eval_enabled(e: EvalConfig) -> bool:
    return bool(e.path) or e.fraction > 0


def _validate_fault(f: FaultConfig, s: ScalingConfig) -> None:
    _require(f.recovery in ("restart", "in_place"),
             f"fault.recovery must be restart or in_place, got {f.recovery!r}")
    _require(f.wait_for_replacement_at_step is None or f.recovery == "in_place",
             "fault.wait_for_replacement_at_step is a test hook of fault.recovery=in_place")
    _require(f.fence_after_s is None or f.recovery == "in_place",
             "fault.fence_after_s applies to fault.recovery=in_place (restart mode ends a whole "
             "group, frozen workers too)")
    _at_least("fault.fence_after_s", f.fence_after_s, 1)
    for key in ("crash_at_step", "nan_at_step", "hang_at_step", "wait_for_replacement_at_step"):
        _at_least(f"fault.{key}", getattr(f, key), 1)
    for key in ("crash_rank", "nan_rank", "hang_rank", "slow_rank"):
        rank = getattr(f, key)
        _require(rank is None or 0 <= rank < s.max_workers,
                 f"fault.{key} ({rank}) must be a worker rank, in "
                 f"[0, scaling.max_workers={s.max_workers})")
    _at_least("fault.slow_step_s", f.slow_step_s, 0)
    _require((f.slow_rank is None) == (f.slow_step_s == 0),
             f"fault.slow_rank ({f.slow_rank}) and fault.slow_step_s ({f.slow_step_s}) go together: "
             "set both (a rank and a sleep > 0) or neither")


def _validate_in_place(cfg: Config) -> None:
    """What in-place recovery (inplace.py) does not do (yet), refused by name."""
    s, t = cfg.scaling, cfg.train
    _require(s.min_workers == s.max_workers,
             f"fault.recovery=in_place needs a fixed worker count (scaling.min_workers="
             f"{s.min_workers}, scaling.max_workers={s.max_workers}): Ray 2.60 replaces a lost "
             "replica in place only at an unchanged size")
    _require(t.grad_reduce in ("auto", "exact"),
             f"fault.recovery=in_place reduces exactly (float64, through torchft); "
             f"train.grad_reduce={t.grad_reduce} is not supported")
    _require(t.precision != "fp16", "fault.recovery=in_place does not support train.precision=fp16 "
                                    "(a grad scaler's state is not healed yet): use bf16")
    _require(cfg.data.reader == "pyarrow",
             f"fault.recovery=in_place reads with data.reader=pyarrow; got {cfg.data.reader!r}")
    _require(cfg.fault.hold_for_resize_at_step is None,
             "fault.hold_for_resize_at_step is a test hook of elastic resizes (restart mode)")


def _validate_model(m: ModelConfig) -> None:
    name_ok = m.name in ("gpt", "hf") or (":" in m.name and all(m.name.split(":", 1)))
    _require(name_ok, f"model.name must be gpt, hf or an import path 'package.module:function', "
                      f"got {m.name!r}")
    _require(m.name != "hf" or bool(m.path), "model.path: model.name=hf needs the folder (or URI) "
                                             "of a transformers model with a config.json")
    _require(m.vocab_size is None or m.vocab_size >= 1, f"model.vocab_size must be >= 1, got {m.vocab_size}")
    if m.name == "gpt":
        _require(m.n_layer >= 1, f"model.n_layer must be >= 1, got {m.n_layer}")
        _require(m.n_head >= 1, f"model.n_head must be >= 1, got {m.n_head}")
        _require(m.d_model >= 1, f"model.d_model must be >= 1, got {m.d_model}")
        _require(m.d_model % m.n_head == 0,
                 f"model.d_model ({m.d_model}) is not divisible by model.n_head ({m.n_head})")
        _require(0 <= m.dropout < 1, f"model.dropout must be in [0, 1), got {m.dropout}")


def num_partitions(cfg: Config) -> int:
    """Canonical data partitions K: one micro-batch of each makes one global step."""
    return cfg.data.global_batch_tokens // cfg.data.micro_batch_tokens
