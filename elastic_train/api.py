"""The driver side: check the inputs, join or start Ray, build the TorchTrainer, run, summarise.

    from elastic_train import load_config, train
    result = train(load_config("jobs/configs/smoke.yaml", ["train.max_steps=50"]))
    print(result.summary["final_loss"], result.checkpoint_path)
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import psutil
import ray
import ray.data
import ray.train

from elastic_train.cluster.console import RAY_LOG, ray_console, route_forwarded_lines
from elastic_train.cluster.cpushare import TrainFirst
from elastic_train.cluster.driver import build_trainer, init_ray, save_config, ship_by_value, start_runlog
from elastic_train.cluster.nodewatch import (
    NodeWatcher,
    start_coordinator,
)
from elastic_train.cluster.runlog import poll_progress
from elastic_train.config import Config
from elastic_train.data.dataset import DatasetInfo
from elastic_train.observe import provenance
from elastic_train.observe.runfolder import run_uri, split_uri
from elastic_train.observe.summary import build_summary
from elastic_train.preflight.inputs import check_inputs, data_tables
from elastic_train.training.losses import LossFn
from elastic_train.training.model import ModelFn

logger = logging.getLogger("elastic_train")


@dataclass
class TrainResult:
    """What `train` returns: the summary.json content, the run folder, the last checkpoint."""

    summary: dict[str, Any]
    run_dir: str
    checkpoint_path: str | None


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
            progress.start(runlog, poll=functools.partial(poll_progress, runlog))
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
