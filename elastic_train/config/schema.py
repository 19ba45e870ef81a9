"""The configuration's tree: one dataclass per section, one comment per field.

These comments are the configuration reference: `docs/configuration.md` is generated from them
(`python -m elastic_train.config.reference`), and a test fails when it is out of date.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import yaml


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
    cpus_per_worker: float | None = None  # CPUs each worker reserves; None: 1, or 4 on GPU workers
    resources_per_worker: dict[str, float] = field(default_factory=dict)  # extra Ray resources
    health_check_interval_s: float = 0.2  # controller poll; ray.train.report waits for it
    # give up reserving a group of this size after this long and decide again (not a failure); after
    # a node loss the first restart may ask for the old size and wait this long: keep it short
    worker_group_start_timeout_s: float = 15.0
    # the longest a run waits for room for min_workers on a cluster that can grow (an autoscaler):
    # then it fails, naming what is missing. A cluster that cannot grow (a local one, a `ray start`
    # without autoscaler) is told at once. Also bounds the worker-group starts that keep timing out
    start_timeout_s: float = 300.0
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
    # longest row, in tokens (prepare splits longer documents); None: the data set's own, as
    # `_prepare.json` records it (else its longest row), filled in before the run starts
    max_seq_len: int | None = None
    # padded tokens (rows x longest row) in one micro-batch; None: from the data set on CPU (the
    # longest row, about 1/256 of its tokens, at most 2048: preflight/inputs.py), on GPU the
    # largest divisor of global_batch_tokens up to 16384 that gives every worker one
    # (config/devices.py)
    micro_batch_tokens: int | None = None
    # a micro-batch's columns padded up to a multiple of this on the device (never past
    # max_seq_len), so that its shapes repeat; the padding figures count the rows' own padding
    # only. None: 64 on GPU workers, 1 (no rounding) on CPU
    pad_multiple: int | None = None
    # padded-token budget of one optimizer step, any world size; None: from the data set (about
    # 1/32 of its tokens, between scaling.max_workers and 8 micro-batches), filled in before the
    # run starts
    global_batch_tokens: int | None = None
    shuffle_window: int = 1024  # rows shuffled, sorted by length and bucketed together
    prefetch_steps: int = 2  # steps assembled ahead of the loop by a background thread
    pad_id: int | None = None  # token that pads rows; None: the data set's tokenizer pad id, else 0
    reader: str = "pyarrow"  # pyarrow: each worker streams the shards itself; ray_data: Ray Data
    # resuming a run whose data identity (path, seed, partitions, shards) differs from its
    # checkpoint's: refuse | keep_position (resume at the saved (epoch, step) of the other data)
    on_change: str = "refuse"


@dataclass
class LoraConfig:
    # LoRA adapters of this rank on the frozen model (peft: the `lora` extra); 0: train every weight
    r: int = 0
    alpha: float = 16.0  # the adapters' update is scaled by alpha / r
    dropout: float = 0.0  # dropout on the adapters' input while training
    # names (or name suffixes) of the modules that get adapters, e.g. [q_proj, v_proj]; empty:
    # peft's default for the model type (transformers models it knows)
    target_modules: list[str] = field(default_factory=list)
    # 4-bit (bitsandbytes NF4) frozen base: QLoRA, GPU only (refused on CPU workers)
    load_in_4bit: bool = False


@dataclass
class ModelConfig:
    # gpt: the embedded byte-level GPT | hf: a transformers causal LM from `path` |
    # "package.module:function": called with vocab_size, max_seq_len and `kwargs`, returns an nn.Module
    name: str = "gpt"
    path: str | None = None  # hf: folder (or pyarrow.fs URI) with config.json, weights optional
    # import path: extra keyword arguments; gpt: n_layer, n_head, d_model or dropout (they replace
    # the fields below; any other key is refused)
    kwargs: dict[str, Any] = field(default_factory=dict)
    vocab_size: int | None = None  # None: the data set's tokenizer size (256 for bytes)
    gradient_checkpointing: bool = False  # recompute activations in backward (non-reentrant)
    trust_remote_code: bool = False  # hf: run the model's own code from `path`
    # train.sharding=fsdp: class names of the modules sharded as blocks (each gathered whole for its
    # forward); empty: the GPT's blocks, a transformers model's _no_split_modules, else the
    # children of the model's largest nn.ModuleList
    shard_modules: list[str] = field(default_factory=list)
    # hf: a tokenizer in `path` must have the vocabulary of the data set's (same token -> id), or
    # the ids the model learnt would mean other tokens; false: train anyway (you mean it)
    tokenizer_check: bool = True
    # set by the Python API's train(cfg, model_fn=...): the inline model's module.qualname. Such a
    # run's model is rebuilt only by passing that model_fn again (export/load_trained); the command
    # line refuses it
    inline_fn: str | None = None
    lora: LoraConfig = field(default_factory=LoraConfig)
    # with lora: the frozen base's dtype (fp32 | bf16: half its bytes); adapters and their
    # optimizer state stay fp32
    base_dtype: str = "fp32"
    n_layer: int = 2  # gpt only, like the three below
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.0


@dataclass
class TrainConfig:
    max_steps: int = 300  # stop after this many optimizer steps ...
    epochs: int = 1  # ... or after this many passes over the data, whichever comes first
    precision: str = "auto"  # auto (bf16 on GPU workers, fp32 on CPU) | fp32 | bf16 | fp16 (GPU only)
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    seed: int = 0  # model initialisation
    max_consecutive_skips: int = 3  # non-finite steps in a row before rolling back
    # torch.compile the model (docs/performance.md, "Compile"), with dynamic rows and length, so
    # bucketed micro-batches of any shape share two graphs and every process computes a shape alike
    compile: bool = False
    # compile: class names of the modules to compile one by one (e.g. [Block] for the embedded GPT,
    # [LlamaDecoderLayer]): identical blocks share a graph; empty: the whole model as one
    compile_modules: list[str] = field(default_factory=list)
    # compile: the node-local folder of Inductor's caches, shared by the run's attempts; empty:
    # <tmp>/elastic_train_compile/<run name>-<hash>. Seeded from the run folder's compile_cache/
    compile_cache_dir: str = ""
    # exact: sum micro-batch gradients and all-reduce them in float64, so a step's gradient is the
    # same to the bit at any world size (8 bytes/param more memory, twice the all-reduce bytes);
    # ddp: torch DDP (fp32, overlaps the last backward), curves differ by fp32 round-off across sizes;
    # auto: exact (ddp with a grad_compression: it needs DDP's hooks; exact cost 2-3% of a step on
    # an H200, docs/performance.md). Chosen once, at the
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
    # none: every rank holds the whole model, its gradients and optimizer state | fsdp: FSDP2
    # (fully_shard on each block and on the root): each rank holds 1/W of them; exact stays
    # bitwise at any world size (float64 master shards, float64 reduce-scatter: sharding.py)
    sharding: str = "none"
    # fsdp: free a block's gathered weights after its forward and gather them again in backward
    # (less memory, one more all-gather per block); false keeps them until backward
    reshard_after_forward: bool = True
    # set by the Python API's train(cfg, loss_fn=...): the loss's module.qualname. A config naming
    # one trains only with that loss_fn passed again (the command line refuses it), and a resume
    # of such a run without it is refused: it would go on with the default loss
    loss_fn: str | None = None


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | adamw8bit
    lr: float = 3e-3  # peak learning rate
    # AdamW's decoupled decay, of the parameters of 2 or more dimensions (matrices, embeddings,
    # LoRA's A and B); norms and biases are not decayed
    weight_decay: float = 0.1
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    # linear warmup, then cosine decay to min_lr_ratio * lr at step schedule_steps
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    # the step at which the cosine reaches its floor; None: the run's last step, counted from the
    # data before the run starts: train.max_steps, or the end of train.epochs where that comes
    # first (train.max_steps for a data set too large to count, data/horizon.py)
    schedule_steps: int | None = None


@dataclass
class EvalConfig:
    # held-out data, never trained on: a prepared data set of its own
    path: str | None = None
    # > 0: evaluate on data.path's held-out documents, the `eval/` set that `prepare
    # --eval-fraction F` wrote beside its shards, whole documents none of whose rows is trained
    # on (F is the share prepare held out; this value only switches evaluation on). A data set
    # with a `doc` column but no such set is refused; one without `doc` (made by another tool)
    # has this share of its blocks held out (whole Parquet row groups, by a salted hash)
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
    # in place: the longest a replica waits on a peer that may be gone (the process group's
    # rendezvous with the quorum's members, sending or receiving a heal, a peer manager's reply),
    # not on a peer's work: a step's all-reduce still waits scaling.collective_timeout_s. Must
    # exceed the time the whole state takes to cross to a replacement (a heal)
    in_place_timeout_s: float = 5.0
    crash_at_step: int | None = None  # test hook: that rank's process dies hard once at this step
    crash_rank: int = 0
    crash_in_checkpoint: bool = False  # die in the middle of writing the checkpoint of that step
    nan_at_step: int | None = None  # test hook: poison one rank's gradient at this step
    nan_rank: int = 0
    nan_repeat: bool = False  # poison it on every attempt (tests rollback, then failure)
    crash_in_eval: bool = False  # die in the middle of the evaluation after crash_at_step
    # test hook (in place): the first replacement of crash_rank dies as it heals from its peer
    crash_in_heal: bool = False
    # test hook: every rank sleeps this long after each step (paces a run so that a schedule of
    # faults from outside spans it; the numbers trained are unchanged)
    step_pause_s: float = 0.0
    hang_at_step: int | None = None  # test hook: that rank's step blocks forever, once, at this step
    hang_rank: int = 0
    slow_rank: int | None = None  # test hook: this rank sleeps slow_step_s in every step
    slow_step_s: float = 0.0
    # test hook (an elastic run's grow, without a race against the run's end): rank 0 waits after
    # this step until a joining node asks for a checkpoint, takes it after the next step, then
    # holds a step later until Ray replaces the group at its new size
    hold_for_resize_at_step: int | None = None
    # test hook: faults in series, "STEP:KIND[:RANK]" (rank 0 by default; in place, the rank among
    # the replicas taking part, so that a fault finds a live process), each once per run, at
    # the end of STEP once the checkpoint saved last is committed (each recovery then resumes
    # from a checkpoint written after the one before). KIND: crash (the rank's process exits),
    # kill (another process SIGKILLs it), stop (it SIGTERMs a driver on its machine, which stops
    # the run as `ray job stop` does: run the same command again). e.g. [25:crash:1, 45:kill, 68:stop]
    # Kinds a test carries out on the cluster (restart mode; rank 0 announces them in a
    # `crash_injected` event): lose (every rank holds after STEP until Ray restarts the group:
    # the test kills a node), join (rank 0 waits after STEP for the grow's checkpoint request:
    # the test adds a node; it saves the next step, then holds), drain (the run goes on: the
    # test drains a node and takes it at the deadline)
    schedule: list[str] = field(default_factory=list)
    # test hook (in place: a replacement that surely joins before the run ends): a rank that ends
    # this step waits until a replacement has joined the run and reached its first quorum (a
    # lost rank never gets there, and a replacement heals to the survivors' step and goes on from
    # the next)
    wait_for_replacement_at_step: int | None = None


@dataclass
class LogConfig:
    print_every_steps: int = 10  # a progress line every N steps when not on a terminal
    progress: str = "auto"  # auto | bar | lines | none
    tensorboard: bool = False
    peak_flops: float = 1e12  # per worker, for the MFU estimate
    # [first, last]: profile these steps on rank 0 with torch.profiler and log the summary as a
    # `profile` event (top kernels, GPU-idle fraction, host calls that synchronize; profile.py)
    profile_steps: list[int] = field(default_factory=list)
    # An MLflow tracking URI (file:/path, http://host:5000; sqlite:///db with the full mlflow): the
    # run folder's figures, logged from the driver's node; a server that is down costs a warning
    mlflow: str | None = None
    # A Weights & Biases project (WANDB_MODE=offline writes the run under the run folder's wandb/)
    wandb: str | None = None


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
