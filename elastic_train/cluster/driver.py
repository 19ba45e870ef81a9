"""The driver's Ray objects: join or start Ray, the RunLog actor, and the TorchTrainer (scaling,
failure, checkpoint and logging config) that runs `cluster/worker.py`'s train function."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import tempfile
import time
from typing import Any

import ray
import ray.data
import ray.train
import yaml
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from elastic_train.cluster.console import ray_train_logging
from elastic_train.cluster.failures import BoundedFailurePolicy
from elastic_train.cluster.nodewatch import (
    CheckpointBeforeGrow,
    ElasticScalingPolicy,
)
from elastic_train.cluster.runlog import RunLog
from elastic_train.cluster.worker import train_worker
from elastic_train.config import Config, ConfigError, config_changes, redact
from elastic_train.data.dataset import DatasetInfo, extra_columns, inspect_dataset
from elastic_train.data.prepare import default_corpus_dir
from elastic_train.observe.runfolder import CONFIG_FILE, run_uri
from elastic_train.preflight.checks import (
    IDENTITY_FILE,
    data_identity,
)
from elastic_train.preflight.inputs import data_tables
from elastic_train.training.losses import LossFn
from elastic_train.training.model import ModelFn

logger = logging.getLogger("elastic_train")


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
        join_cluster(address, "run.address" if cfg.run.address else "RAY_ADDRESS",
                     log_to_driver=True)
        _check_cluster_gpus(cfg)
        return False
    workers_cpus = cfg.scaling.max_workers * cfg.scaling.cpus_per_worker
    # Ray Data's read tasks need CPUs beyond the workers' or they wait forever.
    num_cpus = cfg.run.num_cpus or max(os.cpu_count() or 1, int(workers_cpus) + 2)
    start_local_ray({"PYTHONPATH": driver_pythonpath()}, num_cpus=num_cpus,
                    include_dashboard=cfg.run.dashboard, dashboard_host="127.0.0.1")
    return True


def join_cluster(address: str, key: str, **init_kwargs) -> None:
    """ray.init of the cluster at `address` (given by `key`), or one ConfigError line naming
    `key`: where no process listens at the address's host and port, at once (ray.init would
    retry for minutes, then raise a traceback), and where Ray refuses to join (no cluster at
    "auto"; a token cluster without RAY_AUTH_TOKEN, docs/operations.md)."""
    from ray.exceptions import AuthenticationError

    host, _, port = address.removeprefix("ray://").rpartition(":")
    if host and port.isdigit():
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except OSError as exc:
            raise ConfigError(
                f"{key}: no Ray cluster answers at {address} ({exc.strerror or exc}): start one "
                f"there (ray start --head), or leave {key} unset to start a local one") from None
    try:
        ray.init(address=address, **init_kwargs)
    except (ConnectionError, AuthenticationError) as exc:
        ray.shutdown()
        first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise ConfigError(f"{key}: cannot join the Ray cluster at {address}: {first}") from None


def start_local_ray(environ: dict[str, str], **init_kwargs) -> None:
    """ray.init of a new local cluster on a free GCS port, its processes told its address (and
    `environ`) through the environment they inherit. Tried twice: the chosen port may be taken
    before the GCS binds it (another cluster starting on the machine)."""
    for attempt in range(2):
        port = _free_port()
        inherited = {"RAY_GCS_SERVER_PORT": str(port), "RAY_ADDRESS": f"127.0.0.1:{port}", **environ}
        try:
            with _environ(inherited):
                ray.init(address="local", **init_kwargs)
            return
        except (ConnectionError, RuntimeError):
            if attempt:
                raise
            ray.shutdown()


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
    `nccl_trace/rank_<N>` (for remote storage, a local folder on each node, named in docs/hangs.md)."""
    if not cfg.scaling.use_gpu:
        return {}
    folder = run_uri(cfg)
    if "://" in folder:
        folder = os.path.join(tempfile.gettempdir(), "elastic_train", cfg.run.name)
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": os.path.join(folder, "nccl_trace", "rank_")}


def _driver_process() -> tuple[str, int] | None:
    """(node id, pid) of this driver, for fault.schedule's stop; None before Ray runs (a trainer
    built without a cluster: asking Ray's context would start one)."""
    return (ray.get_runtime_context().get_node_id(), os.getpid()) if ray.is_initialized() else None


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
                           "loss_fn": loss_fn, "provenance": record or {},
                           "driver": _driver_process()},
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
    trainer.failure_runlog, trainer.in_place = runlog, in_place
    return trainer


def torch_config(cfg: Config) -> TorchConfig:
    """Ray's process-group setup: one group of all workers (restart), or one per worker with a
    torchft lighthouse (in_place: inplace.py)."""
    s = cfg.scaling
    if cfg.fault.recovery == "in_place":
        from elastic_train.cluster.inplace_ray import torch_config as in_place_config

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

    failure_runlog = None  # set: Ray's failure policy is replaced by failures.BoundedFailurePolicy
    in_place = False
    controller = None  # Ray Train's controller actor, once fit has started it

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        policy = controller_init_kwargs["scaling_policy"]
        if self.runlog is not None and type(policy) is ElasticScalingPolicy:
            controller_init_kwargs["scaling_policy"] = CheckpointBeforeGrow(policy.scaling_config,
                                                                            self.runlog)
        if self.failure_runlog is not None:
            controller_init_kwargs["failure_policy"] = BoundedFailurePolicy(
                self.run_config.failure_config, self.failure_runlog, in_place=self.in_place)
        return super()._initialize_and_run_controller(**controller_init_kwargs)

    def _register_sigint_handler(self, controller) -> None:
        """Keep the controller's handle instead of Ray's SIGINT handler: the driver's own
        handler (api.py: SIGINT and SIGTERM) ends the run, writes its summary and releases what
        it holds (runwatch.py). Ray 2.60 calls this from `_initialize_and_run_controller` with
        the controller it started (tests/test_raycompat.py)."""
        self.controller = controller


RUNLOG_NAMESPACE = "elastic_train"  # the RunLog actors' names: "runlog:<run folder>"
RUNLOG_NAME_WAIT_S = 10.0  # for the name of a RunLog just killed (a run before this one)


def start_runlog(cfg: Config):
    """The run's RunLog actor, on this node, named after the run folder on the cluster: a
    second run of the same folder on this cluster (a remote store has no file locks:
    preflight/runlock.py) is refused, naming it. The name of a run's RunLog is freed when the
    run ends or its driver dies; one just killed is waited for RUNLOG_NAME_WAIT_S."""
    node_id = ray.get_runtime_context().get_node_id()
    name, deadline = f"runlog:{redact.shown(run_uri(cfg))}", time.monotonic() + RUNLOG_NAME_WAIT_S
    while True:
        try:
            return RunLog.options(
                name=name, namespace=RUNLOG_NAMESPACE,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(run_uri(cfg), tensorboard=cfg.log.tensorboard,
                     tracking=tracking_settings(cfg))
        except ValueError:  # the name is taken
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"run folder {run_uri(cfg)} is in use by another run on this Ray cluster "
                    "(its RunLog actor is alive): wait for it to end or stop it, or give this "
                    "one another run.name") from None
            time.sleep(0.5)


def tracking_settings(cfg: Config) -> dict[str, Any] | None:
    """What the RunLog's tracker needs (observe/tracking.py), None without log.mlflow/log.wandb;
    the driver's MLFLOW_* and WANDB_* variables go with it (the actor may run in another env)."""
    if not (cfg.log.mlflow or cfg.log.wandb):
        return None
    env = {k: v for k, v in os.environ.items() if k.startswith(("MLFLOW_", "WANDB_"))}
    return {"mlflow": cfg.log.mlflow, "wandb": cfg.log.wandb, "run_name": cfg.run.name,
            "params": redact.shown_tree(cfg.to_dict()), "env": env}


def _changed_keys(old_yaml: str, cfg: Config) -> str:
    """The keys in which `cfg` differs from a saved config.yaml, "old -> new"."""
    try:
        old = yaml.safe_load(old_yaml)
    except yaml.YAMLError:
        old = None
    if not isinstance(old, dict):
        return "the saved one is not a YAML mapping"
    return config_changes(old, redact.shown_tree(cfg.to_dict())) or "only in its formatting"


def save_config(cfg: Config, runlog) -> None:
    """config.yaml is the resolved config; an earlier, different one is kept beside it. Both, and
    the data identity, are staged: they take their names once the run is accepted (runfolder.py),
    so a resume refused on the workers leaves the accepted config.yaml in place."""
    folder = ray.get(runlog.local_folder.remote())
    path = os.path.join(folder, CONFIG_FILE)
    text = redact.shown(cfg.to_yaml())  # as saved: other keys to the same store are no change
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
        if old != text:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            ray.get(runlog.stage_file.remote(f"config.{stamp}.yaml", old))
            logger.warning("run %s: config differs from the saved one (%s); keeping it as "
                           "config.%s.yaml once the run starts", cfg.run.name,
                           _changed_keys(old, cfg), stamp)
    ray.get(runlog.stage_file.remote(CONFIG_FILE, text))
    path = cfg.data.path or str(default_corpus_dir(cfg.data.max_seq_len))
    identity = data_identity(cfg, inspect_dataset(path))  # what check_resumable compares with
    ray.get(runlog.stage_file.remote(IDENTITY_FILE, json.dumps(identity, indent=2)))
