"""Cross-field checks of a config, and the choices that follow from it (reduction, partitions).

Each check raises `ConfigError` naming the key at fault; `validate(cfg)` runs them all.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from elastic_train.config.schema import (
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    EvalConfig,
    FaultConfig,
    ModelConfig,
    ScalingConfig,
    TrainConfig,
)


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
    _require(not cfg.model.lora.load_in_4bit or s.use_gpu,
             "model.lora.load_in_4bit (QLoRA: a bitsandbytes 4-bit base) runs on GPU workers "
             "only: set scaling.use_gpu=true, or drop load_in_4bit (model.base_dtype=bf16 halves "
             "the base on CPU)")
    _validate_sharding(cfg)
    _require(t.compile or not t.compile_modules,
             "train.compile_modules names the modules to compile: set train.compile=true too")
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
    _require(o.schedule_steps is None or o.schedule_steps >= 1,
             f"optim.schedule_steps must be >= 1 (or null: the run's last step), got {o.schedule_steps}")
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
    _at_least("data.pad_multiple", cfg.data.pad_multiple or 1, 1)
    steps = cfg.log.profile_steps
    _require(not steps or (len(steps) == 2 and 1 <= steps[0] <= steps[1]),
             f"log.profile_steps must be [first, last] with 1 <= first <= last, got {steps!r}")


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
SHARDINGS = ("none", "fsdp")


def _validate_sharding(cfg: Config) -> None:
    """train.sharding, and what `fsdp` does not do, refused by name with the reason."""
    t = cfg.train
    _require(t.sharding in SHARDINGS,
             f"train.sharding must be none or fsdp, got {t.sharding!r}")
    for i, name in enumerate(cfg.model.shard_modules):
        _require(bool(name.strip()), f"model.shard_modules[{i}]: an empty class name")
    if t.sharding != "fsdp":
        return
    _require(t.grad_compression == "none",
             f"train.grad_compression={t.grad_compression} with train.sharding=fsdp: communication "
             "hooks belong to DDP, and FSDP reduce-scatters each block's gradients itself; set "
             "train.grad_compression=none (fsdp's ddp reduction reduce-scatters in fp32)")
    _require(cfg.optim.name != "adamw8bit",
             "optim.name=adamw8bit with train.sharding=fsdp: bitsandbytes quantises its state in "
             "blocks laid over each rank's local shard, so the state (and every step after the "
             "first) would depend on the world size, and a checkpoint could not be resharded; "
             "use optim.name=adamw")
    _require(cfg.fault.recovery != "in_place",
             "fault.recovery=in_place with train.sharding=fsdp: a replacement heals by copying the "
             "whole model and optimizer state from one live peer, and with fsdp no peer holds "
             "more than its own 1/W (replicated groups of sharded ranks, HSDP, are not built); "
             "use fault.recovery=restart, which reshards from the last checkpoint at any size")
    _require(t.precision != "fp16",
             "train.precision=fp16 with train.sharding=fsdp: the grad scaler would unscale sharded "
             "gradients rank by rank and skip steps on one rank's overflow alone; use bf16")
    _require(not t.compile, "train.compile with train.sharding=fsdp is not supported yet: "
                            "set train.compile=false")
    _require(not cfg.model.lora.load_in_4bit,
             "model.lora.load_in_4bit with train.sharding=fsdp: bitsandbytes' 4-bit weights are "
             "packed bytes with their quantisation state (block scales) beside them, which FSDP2 "
             "cannot cut into row shards; a 4-bit base is half a byte a parameter (a 70B base "
             "~35 GB), so use train.sharding=none, or shard a bf16 base (model.base_dtype=bf16)")


@dataclass(frozen=True)
class ReduceChoice:
    """Which gradient reduction a run uses (`exact` or `ddp`), and why (for events and summary)."""

    chosen: str
    reason: str


def choose_grad_reduce(t: TrainConfig, use_gpu: bool, saved: str | None = None) -> ReduceChoice:
    """Resolve `train.grad_reduce`. An explicit exact or ddp is used as set; `auto` is exact with
    `train.deterministic`, else the choice `saved` in the run's checkpoint (made at its first
    start: a resume on other nodes or devices keeps the numerics it began with), else ddp when a
    gradient compression is set (it needs DDP's hooks), else exact on GPU and CPU workers alike:
    on one H200 the exact sum cost 2.0% of the step of a ~100M GPT and 2.8% of a ~1B GPT against
    ddp (BENCHMARKS.md, GPU), so the bitwise world-size invariance holds where users train."""
    if t.grad_reduce != "auto":
        return ReduceChoice(t.grad_reduce, f"train.grad_reduce={t.grad_reduce}")
    if t.deterministic:
        return ReduceChoice("exact", "auto: train.deterministic=true")
    if saved in ("exact", "ddp"):
        return ReduceChoice(saved, "auto: kept from the run's checkpoint (chosen at its first start)")
    if t.grad_compression != "none":
        return ReduceChoice("ddp", f"auto: train.grad_compression={t.grad_compression} needs ddp")
    return ReduceChoice("exact", "auto: GPU workers" if use_gpu else "auto: CPU workers")


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
    for key in ("health_check_interval_s", "worker_group_start_timeout_s", "start_timeout_s",
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
    _require(d.max_seq_len is None or d.max_seq_len >= 2,
             f"data.max_seq_len must be >= 2, got {d.max_seq_len}")
    _at_least("data.micro_batch_tokens", d.micro_batch_tokens, 1)
    _at_least("data.global_batch_tokens", d.global_batch_tokens, 1)
    _require(
        d.max_seq_len is None or d.micro_batch_tokens is None
        or d.micro_batch_tokens >= d.max_seq_len,
        f"data.micro_batch_tokens ({d.micro_batch_tokens}) is smaller than data.max_seq_len "
        f"({d.max_seq_len}): the longest row would not fit in a micro-batch",
    )
    if d.micro_batch_tokens is None or d.global_batch_tokens is None:
        _validate_data_rest(d)
        return  # from the data set: checked once filled in (preflight/inputs.py)
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
    _validate_data_rest(d)


def _validate_data_rest(d: DataConfig) -> None:
    _require(d.shuffle_window >= 1, f"data.shuffle_window must be >= 1, got {d.shuffle_window}")
    _require(d.prefetch_steps >= 1, f"data.prefetch_steps must be >= 1, got {d.prefetch_steps}")
    _at_least("data.pad_id", d.pad_id, 0)
    _require(d.reader in ("pyarrow", "ray_data"),
             f"data.reader must be pyarrow or ray_data, got {d.reader!r}")
    _require(d.on_change in ("refuse", "keep_position"),
             f"data.on_change must be refuse or keep_position, got {d.on_change!r}")


# eval.fraction and prepare's --eval-fraction stay below this: holding out half the data or more
# leaves the training set smaller than what measures it
MAX_EVAL_FRACTION = 0.5


def _validate_eval(e: EvalConfig, c: CheckpointConfig) -> None:
    _require(e.path is None or bool(e.path.strip()), "eval.path: an empty path")
    _require(0 <= e.fraction < MAX_EVAL_FRACTION,
             f"eval.fraction must be in [0, {MAX_EVAL_FRACTION}), got {e.fraction}")
    _require(not (e.path and e.fraction), f"eval.path ({e.path}) and eval.fraction ({e.fraction}) "
                                          "both set: add eval.fraction=0 to evaluate on eval.path "
                                          "alone (the embedded default run sets eval.fraction "
                                          "0.03), or leave eval.path out")
    _at_least("eval.every_steps", e.every_steps, 0)
    _at_least("eval.max_batches", e.max_batches, 1)
    _require(not c.keep_best or eval_enabled(e), "checkpoint.keep_best needs an evaluation: set "
                                                 "eval.path or eval.fraction")


def eval_enabled(e: EvalConfig) -> bool:
    return bool(e.path) or e.fraction > 0


FAULT_KINDS = ("crash", "kill", "stop")
# fault.schedule's kinds that a test carries out on the cluster (tests/test_elastic.py): the run
# announces them, rank 0 at the end of STEP, and holds or goes on as each needs
NODE_KINDS = ("lose", "join", "drain")


def fault_schedule(entries: list[str]) -> list[tuple[int, str, int]]:
    """fault.schedule's entries as (step, kind, rank); a malformed one is a ConfigError naming it."""
    out = []
    for entry in entries:
        parts = str(entry).split(":")
        ok = len(parts) in (2, 3) and parts[0].isdigit() and int(parts[0]) >= 1 \
            and parts[1] in FAULT_KINDS + NODE_KINDS and (len(parts) == 2 or parts[2].isdigit())
        _require(ok, f"fault.schedule: {entry!r} is not STEP:KIND[:RANK] with STEP >= 1 and KIND "
                 f"one of {', '.join(FAULT_KINDS + NODE_KINDS)}")
        _require(parts[1] not in NODE_KINDS or len(parts) == 2 or parts[2] == "0",
                 f"fault.schedule: {entry!r}: a node's fault ({', '.join(NODE_KINDS)}) is announced "
                 "by rank 0 (write STEP:KIND)")
        out.append((int(parts[0]), parts[1], int(parts[2]) if len(parts) == 3 else 0))
    return out


def _validate_fault(f: FaultConfig, s: ScalingConfig) -> None:
    _require(f.recovery in ("restart", "in_place"),
             f"fault.recovery must be restart or in_place, got {f.recovery!r}")
    _require(f.wait_for_replacement_at_step is None or f.recovery == "in_place",
             "fault.wait_for_replacement_at_step is a test hook of fault.recovery=in_place")
    _require(f.fence_after_s is None or f.recovery == "in_place",
             "fault.fence_after_s applies to fault.recovery=in_place (restart mode ends a whole "
             "group, frozen workers too)")
    _at_least("fault.fence_after_s", f.fence_after_s, 1)
    _at_least("fault.in_place_timeout_s", f.in_place_timeout_s, 0.1)
    _at_least("fault.step_pause_s", f.step_pause_s, 0)
    _require(not f.crash_in_heal or (f.recovery == "in_place" and f.crash_at_step is not None),
             "fault.crash_in_heal is a test hook of fault.recovery=in_place: it needs "
             "fault.crash_at_step (the first death, whose replacement then dies as it heals)")
    for key in ("crash_at_step", "nan_at_step", "hang_at_step", "wait_for_replacement_at_step"):
        _at_least(f"fault.{key}", getattr(f, key), 1)
    for key in ("crash_rank", "nan_rank", "hang_rank", "slow_rank"):
        rank = getattr(f, key)
        _require(rank is None or 0 <= rank < s.max_workers,
                 f"fault.{key} ({rank}) must be a worker rank, in "
                 f"[0, scaling.max_workers={s.max_workers})")
    for step, kind, rank in fault_schedule(f.schedule):
        _require(rank < s.max_workers, f"fault.schedule: rank {rank} must be a worker rank, in "
                 f"[0, scaling.max_workers={s.max_workers})")
        _require(kind not in NODE_KINDS or f.recovery == "restart",
                 f"fault.schedule: {step}:{kind} is a test hook of fault.recovery=restart (in place, "
                 "survivors train on: nothing holds for the node)")
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
    _require(t.grad_compression == "none",
             f"train.grad_compression={t.grad_compression} with fault.recovery=in_place: the "
             "replicas' gradients are summed exactly (float64), which no compression takes; set "
             "train.grad_compression=none")
    _require(t.precision != "fp16", "fault.recovery=in_place does not support train.precision=fp16 "
                                    "(a grad scaler's state is not healed yet): use bf16")
    _require(cfg.data.reader == "pyarrow",
             f"fault.recovery=in_place reads with data.reader=pyarrow; got {cfg.data.reader!r}")
    _require(cfg.fault.hold_for_resize_at_step is None,
             "fault.hold_for_resize_at_step is a test hook of elastic resizes (restart mode)")
    _require(not t.compile,
             "train.compile with fault.recovery=in_place is not supported yet: a replacement "
             "compiles (or loads) its graphs while the survivors wait for it in the quorum, and "
             "the in-place step does not count or save them; use fault.recovery=restart, whose "
             "restarted processes load the run's compile cache")


GPT_KWARGS = ("n_layer", "n_head", "d_model", "dropout")  # model.kwargs the embedded GPT takes


def gpt_config(m: ModelConfig) -> ModelConfig:
    """The embedded GPT's settings: model.kwargs (only GPT_KWARGS, checked by `validate`) over the
    fields of the same names."""
    return dataclasses.replace(m, **{k: v for k, v in m.kwargs.items() if k in GPT_KWARGS},
                               kwargs={})


def _validate_model(m: ModelConfig) -> None:
    name_ok = m.name in ("gpt", "hf") or (":" in m.name and all(m.name.split(":", 1)))
    _require(name_ok, f"model.name must be gpt, hf or an import path 'package.module:function', "
                      f"got {m.name!r}")
    _require(m.name != "hf" or bool(m.path), "model.path: model.name=hf needs the folder (or URI) "
                                             "of a transformers model with a config.json")
    _require(m.vocab_size is None or m.vocab_size >= 1, f"model.vocab_size must be >= 1, got {m.vocab_size}")
    _validate_lora(m)
    if m.name == "hf":  # the model is its folder's config.json: these would be ignored silently
        _require(not m.kwargs, f"model.kwargs ({', '.join(sorted(m.kwargs))}) with model.name=hf: "
                               "the model is built from model.path's config.json, which takes no "
                               "overrides here; edit that config (or save a copy) instead")
        _require(m.vocab_size is None, f"model.vocab_size={m.vocab_size} with model.name=hf: the "
                                       "vocabulary is model.path's config.json's; leave it unset")
    if m.name != "gpt":  # the embedded GPT's own key (its sizes default in default.yaml)
        _require(m.dropout == 0.0, f"model.dropout={m.dropout} with model.name={m.name}: it is the "
                                   "embedded GPT's; " + ("set the dropout in model.path's config.json "
                                   "(e.g. attention_dropout)" if m.name == "hf" else
                                   "pass it to your model as model.kwargs.dropout"))
    if m.name == "gpt":
        unknown = sorted(set(m.kwargs) - set(GPT_KWARGS))
        _require(not unknown, f"model.kwargs: {', '.join(unknown)} not known to model.name=gpt "
                              f"(the embedded GPT takes {', '.join(GPT_KWARGS)})")
        for key, value in m.kwargs.items():
            number = isinstance(value, (int, float)) if key == "dropout" else isinstance(value, int)
            _require(number and not isinstance(value, bool),
                     f"model.kwargs.{key}: expected {'a number' if key == 'dropout' else 'int'}, "
                     f"got {value!r}")
        m = gpt_config(m)  # the values the GPT will be built with
        _require(m.n_layer >= 1, f"model.n_layer must be >= 1, got {m.n_layer}")
        _require(m.n_head >= 1, f"model.n_head must be >= 1, got {m.n_head}")
        _require(m.d_model >= 1, f"model.d_model must be >= 1, got {m.d_model}")
        _require(m.d_model % m.n_head == 0,
                 f"model.d_model ({m.d_model}) is not divisible by model.n_head ({m.n_head})")
        _require(0 <= m.dropout < 1, f"model.dropout must be in [0, 1), got {m.dropout}")


def _validate_lora(m: ModelConfig) -> None:
    """model.lora.* and model.base_dtype."""
    lora = m.lora
    _require(lora.r >= 0, f"model.lora.r must be >= 0 (0: no LoRA), got {lora.r}")
    _require(lora.alpha > 0, f"model.lora.alpha must be > 0, got {lora.alpha}")
    _require(0 <= lora.dropout < 1, f"model.lora.dropout must be in [0, 1), got {lora.dropout}")
    for i, name in enumerate(lora.target_modules):
        _require(bool(str(name).strip()), f"model.lora.target_modules[{i}]: an empty name")
    _require(m.base_dtype in ("fp32", "bf16"),
             f"model.base_dtype must be fp32 or bf16, got {m.base_dtype!r}")
    _require(lora.r > 0 or m.base_dtype == "fp32",
             "model.base_dtype=bf16 is the frozen base's dtype under LoRA: set model.lora.r > 0 "
             "(a full fine-tune keeps fp32 weights; use train.precision=bf16 for bf16 compute)")
    _require(lora.r > 0 or not lora.load_in_4bit,
             "model.lora.load_in_4bit (QLoRA) needs model.lora.r > 0")
    _require(not lora.load_in_4bit or m.base_dtype == "fp32",
             "model.base_dtype=bf16 does not apply to a 4-bit base (model.lora.load_in_4bit): its "
             "weights are NF4 computing in bf16, and what is not 4-bit (embeddings, norms, the "
             "head) stays fp32 for a stable update; drop model.base_dtype=bf16")
    _require(not lora.load_in_4bit or m.name == "hf",
             "model.lora.load_in_4bit (QLoRA) quantises a transformers model as it loads: set "
             f"model.name=hf (got {m.name!r})")


# What data.micro_batch_tokens and data.global_batch_tokens stand for where a config is used
# without the driver's checks, which fill them in from the data set (preflight/inputs.py)
UNFILLED_BATCH_TOKENS = (2048, 16384)


def batch_tokens(cfg: Config) -> tuple[int, int]:
    """(data.micro_batch_tokens, data.global_batch_tokens), `UNFILLED_BATCH_TOKENS` for those
    unset: the driver fills them in from the data set before any worker starts."""
    d = cfg.data
    return (d.micro_batch_tokens or UNFILLED_BATCH_TOKENS[0],
            d.global_batch_tokens or UNFILLED_BATCH_TOKENS[1])


def num_partitions(cfg: Config) -> int:
    """Canonical data partitions K: one micro-batch of each makes one global step."""
    micro, total = batch_tokens(cfg)
    return total // micro
