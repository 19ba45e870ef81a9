"""The driver side: check the inputs, join or start Ray, build the TorchTrainer, run, summarise.

    from elastic_train import load_config, train
    result = train(load_config("jobs/configs/smoke.yaml", ["train.max_steps=50"]))
    print(result.summary["final_loss"], result.checkpoint_path)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import psutil
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray
import ray.data
import ray.train
import torch
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from elastic_train import provenance
from elastic_train.blocks import BlockTable, build_block_table, check_blocks
from elastic_train.checkpoint import MANIFEST, model_signature, signature_mismatch
from elastic_train.checks import (
    IDENTITY_FILE,
    check_gpu,
    check_reduce,
    check_sample_ids,
    check_storage,
    data_identity,
    identity_change,
)
from elastic_train.config import Config, ConfigError, check_run_name, num_partitions, validate
from elastic_train.console import RAY_LOG, ray_console, ray_train_logging, route_forwarded_lines
from elastic_train.cpushare import TrainFirst
from elastic_train.losses import LossFn
from elastic_train.model import BYTE_VOCAB, ModelFn, build_meta_model, input_embedding_rows
from elastic_train.nodewatch import CheckpointBeforeGrow, ElasticScalingPolicy, NodeWatcher, start_coordinator
from elastic_train.prepare import DatasetInfo, default_corpus_dir, inspect_dataset
from elastic_train.rowgroups import hold_out
from elastic_train.runlog import RunLog, split_uri
from elastic_train.summary import build_summary
from elastic_train.worker import train_worker

logger = logging.getLogger("elastic_train")


@dataclass
class TrainResult:
    """What `train` returns: the summary.json content, the run folder, the last checkpoint."""

    summary: dict[str, Any]
    run_dir: str
    checkpoint_path: str | None


def resolve_dataset(cfg: Config, key: str = "data.path") -> DatasetInfo:
    """The dataset to train on (or, with key="eval.path", to evaluate on), checked before any
    worker starts (ConfigError naming the key if unusable)."""
    if key == "eval.path":
        path = cfg.eval.path
    else:
        path = cfg.data.path or str(default_corpus_dir(cfg.data.max_seq_len))
    try:
        info = inspect_dataset(path)
        check_sample_ids(info)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{key}: {exc}") from None
    if info.max_length > cfg.data.max_seq_len:
        raise ConfigError(
            f"{key}: dataset {path} has rows of {info.max_length} tokens, longer than "
            f"data.max_seq_len={cfg.data.max_seq_len}; prepare it again with --max-seq-len "
            f"{cfg.data.max_seq_len} or raise data.max_seq_len"
        )
    return info


@dataclass
class DataTables:
    """The blocks a run trains on and those it evaluates on (None: no evaluation)."""

    train: BlockTable
    eval: BlockTable | None
    eval_info: DatasetInfo | None  # eval.path's data set (None with eval.fraction)


def data_tables(cfg: Config, info: DatasetInfo) -> DataTables:
    """data.path's blocks, less the share eval.fraction holds out; or eval.path's blocks."""
    table = dataset_blocks(info)
    if cfg.eval.fraction > 0:
        train, held = hold_out(table, cfg.eval.fraction)
        return DataTables(train, held, None)
    if cfg.eval.path:
        eval_info = resolve_dataset(cfg, "eval.path")
        missing = set(extra_columns(info)) - set(extra_columns(eval_info))
        if missing:
            raise ConfigError(f"eval.path: data set {eval_info.path} lacks the column(s) "
                              f"{sorted(missing)} that the training data has (the loss reads them)")
        if (eval_info.tokenizer_kind, eval_info.vocab_size) != (info.tokenizer_kind, info.vocab_size):
            raise ConfigError(
                f"eval.path: data set {eval_info.path} was tokenized with another tokenizer "
                f"({eval_info.tokenizer_kind}, vocabulary {eval_info.vocab_size}) than data.path "
                f"({info.tokenizer_kind}, vocabulary {info.vocab_size}): its loss would mean nothing")
        return DataTables(table, dataset_blocks(eval_info), eval_info)
    return DataTables(table, None, None)


def run_uri(cfg: Config) -> str:
    """`<run.storage_path>/<run.name>`, absolute for a local folder."""
    check_run_name(cfg.run.name)  # the run folder lies inside storage_path, whatever built cfg
    storage = cfg.run.storage_path
    if "://" not in storage:
        storage = os.path.abspath(os.path.expanduser(storage))
    return storage.rstrip("/") + "/" + cfg.run.name


def check_inputs(cfg: Config, model_fn: ModelFn | None = None) -> DatasetInfo:
    """Every check that needs no cluster: the dataset, the model (built once on the meta device:
    shapes only), their fit, storage, the checkpoint to resume. Fills in what the config leaves
    to the data set (`model.vocab_size`, `data.pad_id`), so the resolved config says it."""
    validate(cfg)  # again: a Config built in Python has not been through load_config
    check_gpu(cfg)
    info = resolve_dataset(cfg)
    if cfg.data.pad_id is None:
        cfg.data.pad_id = info.pad_id if info.pad_id is not None else 0
    if cfg.model.vocab_size is None and cfg.model.name != "hf":
        # a tokenizer may report fewer tokens than its largest id: the larger of the two
        cfg.model.vocab_size = max(info.vocab_size or 0, (info.max_token_id or -1) + 1) or BYTE_VOCAB
    tables = data_tables(cfg, info)
    try:
        check_blocks(tables.train, num_partitions(cfg), info.path)
    except ValueError as exc:
        raise ConfigError(f"data.path: {exc}") from None
    model = meta_model(cfg, model_fn)
    check_model_fits_data(cfg, info, model)
    if tables.eval_info is not None:
        check_model_fits_data(cfg, tables.eval_info, model)
    check_storage(cfg)
    saved = check_resumable(cfg, model_signature(model), info)
    check_reduce(cfg, saved)
    return info


def meta_model(cfg: Config, model_fn: ModelFn | None = None) -> torch.nn.Module:
    """The model on the meta device (no memory), or a ConfigError naming what failed."""
    try:
        return build_meta_model(cfg.model, cfg.data.max_seq_len, model_fn)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_model_fits_data(cfg: Config, info: DatasetInfo, model: torch.nn.Module) -> None:
    """The model embeds every token id of the data, the pad id, and positions up to
    data.max_seq_len (where the model says how many it has)."""
    rows = input_embedding_rows(model)
    largest = max(info.max_token_id or 0, cfg.data.pad_id or 0)
    if rows is not None and largest >= rows:
        raise ConfigError(
            f"model: its embedding has {rows} rows but data set {info.path} uses token id {largest}; "
            f"set model.vocab_size (or the model's own vocabulary) to at least {largest + 1}")
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if positions is not None and cfg.data.max_seq_len > positions:
        raise ConfigError(f"data.max_seq_len ({cfg.data.max_seq_len}) is longer than the model's "
                          f"max_position_embeddings ({positions})")


def dataset_blocks(info: DatasetInfo) -> BlockTable:
    """The data set's blocks (row groups), from the Parquet footers; workers open `_uri`s."""
    return build_block_table(info.filesystem, info.files, [_uri(info, f) for f in info.files])


def extra_columns(info: DatasetInfo) -> tuple[str, ...]:
    """Numeric columns of the data set beyond id/tokens/length (e.g. `label`): they reach the
    loss in the batch. `source` and `offset` (written by prepare) are left out."""
    with info.filesystem.open_input_file(info.files[0]) as f:
        schema = pq.read_schema(f)
    def numeric(t) -> bool:
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            t = t.value_type
        return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)
    skip = {"id", "tokens", "length", "source", "offset"}
    return tuple(f.name for f in schema if f.name not in skip and numeric(f.type))


def check_resumable(cfg: Config, ours: dict[str, list[int]],
                    info: DatasetInfo | None = None) -> dict[str, Any] | None:
    """If the run folder holds checkpoints, the newest complete one must fit the configured model
    (signature `ours`) and, given `info`, have been trained on the same data identity (path, seed,
    partition count, shards; see checks.py) unless data.on_change=keep_position: refused here,
    before Ray starts, with the run folder left as it was. (The worker checks the checkpoint Ray
    hands it again, in case one appears meanwhile.) Returns that checkpoint's state.json (None
    without one)."""
    fs, folder, _ = split_uri(run_uri(cfg))
    if fs.get_file_info(folder).type != pafs.FileType.Directory:
        return None
    names = sorted((f.base_name for f in fs.get_file_info(pafs.FileSelector(folder))
                    if f.type == pafs.FileType.Directory and f.base_name.startswith("checkpoint_")),
                   reverse=True)
    for name in names:
        directory = f"{folder}/{name}"
        if fs.get_file_info(f"{directory}/{MANIFEST}").type != pafs.FileType.File:
            continue  # incomplete: never loaded
        state = _read_json(fs, f"{directory}/state.json", "checkpoint file")
        if not (isinstance(state, dict) and isinstance(state.get("config"), dict)
                and isinstance(state.get("model_signature"), dict)):
            raise ConfigError(f"checkpoint file '{directory}/state.json' is corrupt: not the state "
                              "of a checkpoint")
        mismatch = signature_mismatch(state, ours)
        if mismatch:
            raise ConfigError(f"run {cfg.run.name}: its latest checkpoint {name} {mismatch}; use "
                              f"another run.name, or the model config it was trained with")
        if info is not None:
            _check_same_data(cfg, info, state, fs, folder, name)
            if isinstance(state.get("provenance"), dict):
                _check_provenance(cfg, info, state["provenance"], name)
        return state
    return None


def _check_provenance(cfg: Config, info: DatasetInfo, saved: dict, name: str) -> None:
    """A resume on other data content or another tokenizer is refused (unless
    data.on_change=keep_position); on other library versions or code, it warns naming them."""
    refusing, warning = provenance.changes(saved, provenance.driver_record(info))
    if refusing and cfg.data.on_change != "keep_position":
        raise ConfigError(f"run {cfg.run.name}: its latest checkpoint {name} was trained on other data: "
                          f"{'; '.join(refusing)}. Use another run.name, the data it was trained on, "
                          "or data.on_change=keep_position to resume anyway")
    if refusing:
        warning = refusing + warning
    if warning:
        logger.warning("run %s: resuming checkpoint %s, written with %s", cfg.run.name, name,
                       "; ".join(warning))


def _read_json(fs: pafs.FileSystem, path: str, what: str):
    """A JSON file's content, or a ConfigError naming the file."""
    try:
        with fs.open_input_stream(path) as f:
            return json.loads(f.read())
    except (OSError, ValueError) as exc:  # json.JSONDecodeError and UnicodeDecodeError too
        raise ConfigError(f"{what} '{path}' is corrupt or unreadable: {exc}") from None


def _check_same_data(cfg: Config, info: DatasetInfo, state: dict, fs: pafs.FileSystem,
                     folder: str, name: str) -> None:
    """The checkpoint's data position means the same rows now: same data identity."""
    current = data_identity(cfg, info)
    data = state["config"].get("data")
    data = data if isinstance(data, dict) else {}
    saved = {"seed": data["seed"]} if isinstance(data.get("seed"), int) else {}
    if data.get("global_batch_tokens") and data.get("micro_batch_tokens"):
        saved["partitions"] = data["global_batch_tokens"] // data["micro_batch_tokens"]
    path = data.get("path")
    if isinstance(path, str) and ("://" in path or os.path.isabs(path)):
        # (a relative one depended on that run's working folder)
        saved["path"] = path.rstrip("/") if "://" in path else os.path.normpath(path)
    identity_path = f"{folder}/{IDENTITY_FILE}"
    if fs.get_file_info(identity_path).type == pafs.FileType.File:
        recorded = _read_json(fs, identity_path, "run file")
        saved.update(recorded if isinstance(recorded, dict) else {})
    change = identity_change(saved, current)
    if change is None:
        return
    if cfg.data.on_change == "keep_position":
        logger.warning("run %s: resuming checkpoint %s at its data position although %s "
                       "(data.on_change=keep_position)", cfg.run.name, name, change)
        return
    raise ConfigError(f"run {cfg.run.name}: its latest checkpoint {name} was trained on other data: "
                      f"{change}; its data position would mean other rows. Use another run.name, "
                      "the data it was trained on, or data.on_change=keep_position to resume anyway")


def init_ray(cfg: Config) -> bool:
    """Join the cluster of run.address / RAY_ADDRESS, or start a local one; True if started here.

    A local cluster's every process gets RAY_ADDRESS set to it (its GCS port chosen here), so that
    Ray's own helpers that look a cluster up (Train's placement-group cleaner, the state API)
    find this one even when other Ray clusters run on the machine, and the driver's import path
    (`driver_pythonpath`). Both through the environment the cluster's processes inherit, not a
    job runtime_env: Ray prestarts worker processes without the job's runtime_env, and an actor
    of a job that has one never uses them (our RunLog, Ray Train's controller and helpers would
    each start a process of their own while two idle ones wait)."""
    # The Train controller inherits these from the driver's environment.
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(cfg.scaling.health_check_interval_s)
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(
        cfg.scaling.worker_group_start_timeout_s
    )
    os.environ["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] = str(cfg.scaling.preemption_poll_interval_s)
    # A frozen worker (SIGSTOP, a machine stalled in swap) answers no health check: Ray declares it
    # dead after this long (10 minutes by default), the same bound as a stuck collective. Ray's own
    # barrier timeout (RAY_TRAIN_COLLECTIVE_TIMEOUT_S) stays off: ranks wait at ray.train.report
    # while rank 0 writes a final checkpoint, which may rightly take longer.
    os.environ["RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S"] = str(cfg.scaling.collective_timeout_s)
    if ray.is_initialized():
        return False
    address = cfg.run.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        _check_cluster_gpus(cfg)
        return False
    workers_cpus = cfg.scaling.max_workers * cfg.scaling.cpus_per_worker
    # Ray Data's read tasks need CPUs beyond the workers' or they wait forever.
    num_cpus = cfg.run.num_cpus or max(os.cpu_count() or 1, int(workers_cpus) + 2)
    for attempt in range(2):  # the chosen port may be taken before the GCS binds it
        port = _free_port()
        inherited = {"RAY_GCS_SERVER_PORT": str(port), "RAY_ADDRESS": f"127.0.0.1:{port}",
                     "PYTHONPATH": driver_pythonpath()}
        try:
            with _environ(inherited):
                ray.init(address="local", num_cpus=num_cpus, include_dashboard=cfg.run.dashboard,
                         dashboard_host="127.0.0.1")
            return True
        except (ConnectionError, RuntimeError):
            if attempt:
                raise
            ray.shutdown()
    return True


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    """os.environ with `values` set, as it was again afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_cluster_gpus(cfg: Config) -> None:
    """scaling.use_gpu on a cluster that has no GPU now: said before the trainer waits for one.
    A warning, not an error: an autoscaler (cluster.yaml) may still be adding GPU nodes."""
    if cfg.scaling.use_gpu and not ray.cluster_resources().get("GPU", 0):
        logger.warning("scaling.use_gpu=true but the cluster has no GPU yet; the run waits until "
                       "an autoscaler adds GPU nodes (or forever, if none will)")


def ship_by_value(fn) -> None:
    """Let Ray (cloudpickle) send a driver's function with its code, not as a reference to its
    module, unless that module is installed (importable on every worker): a function defined in a
    driver script, a test module or a folder only the driver sees then still runs on the workers."""
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    if module is None or module.__name__ == "__main__" or module.__name__.startswith("elastic_train"):
        return  # __main__ goes by value anyway; ours is installed
    file = getattr(module, "__file__", None) or ""
    if "site-packages" in file or "dist-packages" in file:
        return
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(module)


def driver_pythonpath() -> str:
    """The driver's import path for a local cluster's workers: its working folder, PYTHONPATH and
    script folder, so that a model named by import path imports on the workers as it does here
    (under `ray job submit`, the job's working directory does this)."""
    entries = [os.getcwd(), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    entries += [p for p in sys.path[:1] if p]  # the driver script's folder
    return os.pathsep.join(dict.fromkeys(os.path.abspath(p) for p in entries if p))


def nccl_env(cfg: Config) -> dict[str, str]:
    """The workers' NCCL settings on a GPU run ({} on CPU): a timed-out collective aborts the
    communicator and fails the attempt (instead of hanging in the kernel), and the flight recorder
    keeps the last collectives of every rank, dumped on a timeout into the run folder's
    `nccl_trace/rank_<N>` (for remote storage, a local folder on each node, named in the README)."""
    if not cfg.scaling.use_gpu:
        return {}
    folder = run_uri(cfg)
    if "://" in folder:
        folder = os.path.join(tempfile.gettempdir(), "elastic_train", cfg.run.name)
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": os.path.join(folder, "nccl_trace", "rank_")}


def build_trainer(cfg: Config, info: DatasetInfo, runlog, model_fn: ModelFn | None = None,
                  loss_fn: LossFn | None = None, record: dict | None = None,
                  verbose: bool = False, pg_cleaner: bool = True) -> TorchTrainer:
    """`pg_cleaner=False`: without Ray's placement-group cleaner (see `Trainer`)."""
    s = cfg.scaling
    in_place = cfg.fault.recovery == "in_place"
    tables = data_tables(cfg, info)
    num_workers = s.min_workers if s.min_workers == s.max_workers else (s.min_workers, s.max_workers)
    resources = {"CPU": s.cpus_per_worker, **s.resources_per_worker}
    if s.use_gpu:
        resources["GPU"] = 1
    storage = cfg.run.storage_path
    if "://" not in storage:
        storage = os.path.abspath(os.path.expanduser(storage))
    trainer = Trainer(
        train_loop_per_worker=train_worker,
        torch_config=torch_config(cfg),
        train_loop_config={"config": cfg.to_dict(), "runlog": runlog,
                           "block_table": tables.train, "eval_table": tables.eval,
                           "extra_columns": extra_columns(info), "model_fn": model_fn,
                           "loss_fn": loss_fn, "provenance": record or {}},
        scaling_config=ScalingConfig(
            num_workers=num_workers, use_gpu=s.use_gpu, resources_per_worker=resources,
            elastic_resize_monitor_interval_s=s.resize_monitor_interval_s,
        ),
        run_config=RunConfig(
            name=cfg.run.name, storage_path=storage,
            # in place, every replacement of a lost worker counts as a failure in Ray: unlimited
            failure_config=FailureConfig(max_failures=-1 if in_place else s.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep),
            logging_config=ray_train_logging(verbose),
            worker_runtime_env={"env_vars": nccl_env(cfg)},
        ),
    )
    trainer.pg_cleaner = pg_cleaner
    trainer.runlog = None if in_place else runlog
    return trainer


def torch_config(cfg: Config) -> TorchConfig:
    """Ray's process-group setup: one group of all workers (restart), or one per worker with a
    torchft lighthouse (in_place: inplace.py)."""
    s = cfg.scaling
    if cfg.fault.recovery == "in_place":
        from elastic_train.inplace_ray import torch_config as in_place_config

        return in_place_config(cfg)
    return TorchConfig(backend="nccl" if s.use_gpu else "gloo", timeout_s=s.collective_timeout_s)


class Trainer(TorchTrainer):
    """TorchTrainer that lets an elastic run's grow wait for a checkpoint, leaves out what a run
    without Ray Train datasets does not use, and can leave out Ray's placement-group cleaner where
    it cannot work.

    `runlog` set: Ray's elastic scaling policy is replaced by `nodewatch.CheckpointBeforeGrow`
    (through Ray 2.60's private `_initialize_and_run_controller`; tests/test_grow_hold.py fails if
    it moves).

    The cleaner (a detached actor) asks Ray's state API every second whether the controller is
    alive, to remove the run's placement group after an ungraceful death. A local cluster without
    the dashboard (`run.dashboard: false`) has no state API: the cleaner would only warn every
    second ("Failed to query Ray Train Controller actor state"), and the run's `ray.shutdown`
    removes the placement group anyway.

    Ray Train's datasets callback starts a DatasetManager actor for every worker group, datasets
    or none: a process whose start (~1.2 CPU-s) shares the cores with the workers' own on the path
    to every attempt's first step. The workers read their shards themselves (blocks.py), so a
    trainer without datasets (ours) leaves it out.

    Both through Ray 2.60's private `_create_default_callbacks`; if it moves, the warnings and the
    actor come back (tests/test_config.py names the callbacks it expects), nothing breaks."""

    pg_cleaner = True
    runlog = None  # an elastic run's RunLog: a grow waits for a checkpoint (nodewatch.CheckpointBeforeGrow)

    def _create_default_callbacks(self):
        unused = set() if self.datasets else {"DatasetsCallback"}
        if not self.pg_cleaner:
            unused.add("PlacementGroupCleanerCallback")
        return [c for c in super()._create_default_callbacks() if type(c).__name__ not in unused]

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        policy = controller_init_kwargs["scaling_policy"]
        if self.runlog is not None and type(policy) is ElasticScalingPolicy:
            controller_init_kwargs["scaling_policy"] = CheckpointBeforeGrow(policy.scaling_config,
                                                                            self.runlog)
        return super()._initialize_and_run_controller(**controller_init_kwargs)


def _uri(info: DatasetInfo, path: str) -> str:
    """A shard's path as workers on any node open it (pyarrow.fs URI for remote storage)."""
    if isinstance(info.filesystem, pafs.LocalFileSystem):
        return path
    return f"{info.filesystem.type_name}://{path}"


def start_runlog(cfg: Config):
    node_id = ray.get_runtime_context().get_node_id()
    return RunLog.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
    ).remote(run_uri(cfg), tensorboard=cfg.log.tensorboard)


def save_config(cfg: Config, runlog) -> None:
    """config.yaml is the resolved config; an earlier, different one is kept beside it."""
    folder = ray.get(runlog.local_folder.remote())
    path = os.path.join(folder, "config.yaml")
    text = cfg.to_yaml()
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
        if old != text:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            ray.get(runlog.write_file.remote(f"config.{stamp}.yaml", old))
            logger.warning("run %s: config differs from the saved one; kept it as config.%s.yaml",
                           cfg.run.name, stamp)
    ray.get(runlog.write_file.remote("config.yaml", text))
    path = cfg.data.path or str(default_corpus_dir(cfg.data.max_seq_len))
    identity = data_identity(cfg, inspect_dataset(path))  # what check_resumable compares with
    ray.get(runlog.write_file.remote(IDENTITY_FILE, json.dumps(identity, indent=2)))


def train(cfg: Config, model_fn: ModelFn | None = None, loss_fn: LossFn | None = None,
          progress=None, verbose: bool = False) -> TrainResult:
    """Train (or resume) the run described by `cfg`; returns its summary and last checkpoint.

    `model_fn(vocab_size=, max_seq_len=, **model.kwargs) -> nn.Module` replaces `model.name`, and
    `loss_fn(model, batch) -> (loss_sum, num_targets)` the default next-token cross entropy
    (see `losses.py`); both are shipped to the workers by Ray (cloudpickle), so a driver script
    may define them inline. Inputs are checked before any worker starts (ConfigError). A run that
    fails on the cluster still writes summary.json with status "failed" and the reason, then
    raises TrainingFailed. Ray's INFO logging goes to the run folder's ray.log, not the screen,
    unless `verbose` (see console.py).
    """
    startup = {"process_start": psutil.Process().create_time(), "train_call": time.time()}
    info = check_inputs(cfg, model_fn)
    for fn in (model_fn, loss_fn):
        ship_by_value(fn)
    startup["checks_done"] = time.time()
    with ray_console(verbose) as ray_log:
        started_here = init_ray(cfg)
        unroute = route_forwarded_lines(ray_log, verbose)
        try:
            return _run(cfg, info, model_fn, loss_fn, progress, verbose, ray_log, startup,
                        local=started_here)
        finally:
            if started_here:
                ray.shutdown()  # first: it stops the thread that forwards lines
            unroute()


def _run(cfg: Config, info: DatasetInfo, model_fn: ModelFn | None, loss_fn: LossFn | None,
         progress, verbose: bool, ray_log, startup: dict[str, float], local: bool) -> TrainResult:
    """`train` on a running Ray (`local`: a cluster started for this run): the RunLog actor, the
    trainer, fit, summary.json."""
    start = startup["ray_ready"] = time.time()
    start_coordinator()
    runlog = start_runlog(cfg)
    try:
        folder = ray.get(runlog.local_folder.remote())  # a remote run's staging copy, uploaded by flush
        ray_log.open(os.path.join(folder, RAY_LOG))
        save_config(cfg, runlog)
        record = provenance.driver_record(info, data_tables(cfg, info).eval_info)
        ray.get(runlog.write_file.remote("provenance.json", json.dumps(record, indent=2)))
        trainer = build_trainer(cfg, info, runlog, model_fn, loss_fn, record, verbose,
                                pg_cleaner=not local or cfg.run.dashboard)
        startup["fit_call"] = time.time()
        ray.get(runlog.log_event.remote({"event": "fit_start", "driver_startup": startup}))
        error, checkpoint_path = None, None
        if progress is not None:
            progress.start(runlog)
        elastic = cfg.scaling.min_workers < cfg.scaling.max_workers
        watcher = NodeWatcher().start() if elastic else None
        train_first = TrainFirst().start() if local and cfg.run.train_first else None
        try:
            result = trainer.fit()
            checkpoint_path = result.checkpoint.path if result.checkpoint else None
        except ray.train.TrainingFailedError as exc:
            error = _short_reason(exc)
        finally:
            if progress is not None:
                progress.stop()
            if watcher is not None:
                watcher.stop()
            if train_first is not None:
                train_first.stop()
                ray.get(runlog.log_event.remote({"event": "cpu_share", **train_first.changed}))
        fatal = ray.get(runlog.progress.remote())["fatal"]
        summary = build_summary(folder, start_time=start, error=fatal or error)
        summary["provenance"] = record
        ray.get(runlog.write_file.remote("summary.json", json.dumps(summary, indent=2)))
        ray.get(runlog.flush.remote())
        if summary["status"] != "finished":
            raise TrainingFailed(summary["reason"], summary)
        return TrainResult(summary, run_uri(cfg), checkpoint_path)
    finally:
        ray.kill(runlog)


class TrainingFailed(RuntimeError):
    """The run failed on the cluster; `summary` is what summary.json says."""

    def __init__(self, reason: str, summary: dict[str, Any]) -> None:
        super().__init__(reason)
        self.summary = summary


def _short_reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    errors = [line for line in text if "Error" in line]
    return (errors[-1] if errors else (text[-1] if text else type(exc).__name__))[:500]


__all__ = ["TrainResult", "TrainingFailed", "check_inputs", "run_uri", "split_uri", "train"]
