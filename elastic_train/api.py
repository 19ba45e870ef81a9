"""The driver side: check the inputs, join or start Ray, build the TorchTrainer, run, summarise.

    from elastic_train import load_config, train
    result = train(load_config("jobs/configs/smoke.yaml", ["train.max_steps=50"]))
    print(result.summary["final_loss"], result.checkpoint_path)
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import ray
import ray.data
import ray.train

from elastic_train.cluster.capacity import check_capacity, wait_note
from elastic_train.cluster.console import RAY_LOG, ray_console, route_forwarded_lines
from elastic_train.cluster.cpushare import TrainFirst
from elastic_train.cluster.driver import build_trainer, init_ray, save_config, ship_by_value, start_runlog
from elastic_train.cluster.failures import Failure, describe_failure
from elastic_train.cluster.nodewatch import (
    NodeWatcher,
    start_coordinator,
)
from elastic_train.cluster.runlog import poll_progress
from elastic_train.cluster.runwatch import (
    RunWatch,
    SignalWatch,
    StopSignals,
    abort_controller,
    cancel_resource_request,
    cluster_processes,
)
from elastic_train.config import Config, redact
from elastic_train.data.dataset import DatasetInfo
from elastic_train.observe import provenance
from elastic_train.observe.progress import Progress
from elastic_train.observe.runfolder import join_uri, run_uri, split_uri, upload_staging
from elastic_train.observe.summary import build_summary
from elastic_train.preflight.finished import finished_message, finished_run
from elastic_train.preflight.inputs import check_inputs, data_tables, run_horizon
from elastic_train.preflight.packages import check_packages
from elastic_train.preflight.runlock import RunLock
from elastic_train.preflight.tracking import check_tracking
from elastic_train.training.losses import LossFn
from elastic_train.training.model import ModelFn

logger = logging.getLogger("elastic_train")


@dataclass
class TrainResult:
    """What `train` returns: the summary.json content, the run folder, the last checkpoint."""

    summary: dict[str, Any]
    run_dir: str
    checkpoint_path: str | None
    note: str | None = None  # set when nothing was trained: why (an already finished run)


def train(cfg: Config, model_fn: ModelFn | None = None, loss_fn: LossFn | None = None,
          progress: Progress | bool = True, verbose: bool = False) -> TrainResult:
    """Train (or resume) the run described by `cfg`; returns its summary and last checkpoint.

    `model_fn(vocab_size=, max_seq_len=, **model.kwargs) -> nn.Module` replaces `model.name`, and
    `loss_fn(model, batch) -> (loss_sum, num_targets)` the default next-token cross entropy
    (see `losses.py`); both are shipped to the workers by Ray (cloudpickle), so a driver script
    may define them inline. Inputs are checked before any worker starts (ConfigError), and so is
    the cluster's room for scaling.min_workers once Ray runs (runwatch.py bounds the wait on a
    cluster that can grow).

    `progress`: True (the default) shows the run's progress as `elastic-train train` does, in
    the way `log.progress` says (auto: a bar on a terminal, else a line every
    `log.print_every_steps` steps; none: nothing); False shows none; or pass an
    `observe.progress.Progress` of your own. Each failure of a worker is one line on stderr.

    A run already finished for this config (preflight/finished.py) is not run again: its
    summary comes back with `note` saying how to train on, and no file of it changes. A run that
    fails on the cluster still writes summary.json with status "failed" and the reason, then
    raises TrainingFailed; stopped by SIGINT or SIGTERM (`ray job stop`), summary.json says
    "stopped" and TrainingStopped is raised; either way what the run holds in Ray is released.
    A resume that ends before its first attempt begins (a checkpoint or model the workers
    refuse) raises the same but changes no file of the run folder (observe/runfolder.py).
    Ray's INFO logging goes to the run folder's ray.log, not the screen, unless `verbose` (see
    console.py).
    """
    startup = {"process_start": psutil.Process().create_time(), "train_call": time.time()}
    check_packages(cfg)  # first: the model check below would import them
    check_tracking(cfg)
    info = check_inputs(cfg, model_fn, loss_fn)
    with RunLock(cfg):  # one run at a time in a run folder: a second one is refused here
        return _train(cfg, model_fn, loss_fn, progress, verbose, startup, info)


def _train(cfg: Config, model_fn: ModelFn | None, loss_fn: LossFn | None,
           progress: Progress | bool, verbose: bool, startup: dict[str, float],
           info: DatasetInfo) -> TrainResult:
    """`train`, its inputs checked and the run folder held."""
    done = finished_run(cfg)
    if done is not None:
        note = finished_message(cfg, done)
        logger.warning(note)
        return TrainResult(done, run_uri(cfg), join_uri(run_uri(cfg), done["checkpoint"]), note)
    if progress is True:
        progress = Progress(cfg.train.max_steps, cfg.log.progress, cfg.log.print_every_steps)
    if isinstance(progress, Progress):
        progress.set_total(run_horizon(cfg, info).total)
    for fn in (model_fn, loss_fn):
        ship_by_value(fn)
    startup["checks_done"] = time.time()
    with ray_console(verbose) as ray_log:
        started_here = init_ray(cfg)
        unroute = route_forwarded_lines(ray_log, verbose)
        try:
            # After ray.init: Ray's core installs a SIGTERM handler of its own (it aborts)
            with StopSignals() as stop:
                check_capacity(cfg, started_here)
                return _run(cfg, info, model_fn, loss_fn, progress or None, verbose, ray_log,
                            startup, local=started_here, stop=stop)
        except KeyboardInterrupt as exc:  # before the fit began: nothing to summarise
            raise TrainingStopped(getattr(exc, "signal_name", "SIGINT"), {}) from None
        finally:
            if started_here:
                ray.shutdown()  # first: it stops the thread that forwards lines
            unroute()


def _run(cfg: Config, info: DatasetInfo, model_fn: ModelFn | None, loss_fn: LossFn | None,
         progress, verbose: bool, ray_log, startup: dict[str, float], local: bool,
         stop: StopSignals) -> TrainResult:
    """`train` on a running Ray (`local`: a cluster started for this run): the RunLog actor, the
    trainer, fit, summary.json, and the release of what the run held."""
    start = startup["ray_ready"] = time.time()
    start_coordinator()
    runlog = start_runlog(cfg)
    trainer = settled = staging = None
    try:
        folder = ray.get(runlog.local_folder.remote())  # a remote run's staging copy, uploaded by flush
        staging = folder if "://" in run_uri(cfg) else None
        ray_log.open(os.path.join(folder, RAY_LOG))
        save_config(cfg, runlog)
        record = provenance.driver_record(info, data_tables(cfg, info).eval_info)
        ray.get(runlog.stage_file.remote("provenance.json", json.dumps(record, indent=2)))
        trainer = build_trainer(cfg, info, runlog, model_fn, loss_fn, record, verbose,
                                pg_cleaner=not local or cfg.run.dashboard)
        startup["fit_call"] = time.time()
        ray.get(runlog.log_event.remote({"event": "fit_start", "driver_startup": startup}))
        upload = functools.partial(upload_staging, staging, run_uri(cfg)) if staging else None
        outcome = _fit(cfg, trainer, runlog, progress, local, stop,
                       functools.partial(_stopped_summary, cfg, folder, start, record),
                       functools.partial(_end_without_cluster, upload=upload))
        if outcome.stopped:  # the workers train on until the controller goes: end them first,
            abort_controller(trainer.controller)  # so the summary is of what they trained
        ray.get(runlog.take_held.remote())
        fatal = ray.get(runlog.progress.remote())["fatal"]
        summary = build_summary(folder, start_time=start, error=fatal or outcome.error,
                                limits=None if outcome.stopped else (cfg.train.max_steps,
                                                                     cfg.train.epochs))
        if outcome.stopped:
            summary["status"], summary["reason"] = "stopped", f"stopped by {outcome.stopped}"
        summary["provenance"] = record
        try:
            settled = _settle(runlog, ray_log, summary)
        except UploadFailed:  # settled; the staging copy, which the error names, stays
            settled, staging = False, None
            raise
        if outcome.stopped:
            raise TrainingStopped(outcome.stopped, summary)
        if summary["status"] != "finished":
            if outcome.failure is not None and outcome.failure.traceback and not fatal:
                print(redact.shown(f"the failing worker's error (rank {outcome.failure.rank}):\n"
                                   f"{outcome.failure.traceback}"), file=sys.stderr, flush=True)
            raise TrainingFailed(summary["reason"], summary)
        return TrainResult(summary, run_uri(cfg), outcome.checkpoint_path)
    finally:
        if trainer is not None:
            abort_controller(trainer.controller)  # a run that did not end by itself
        if settled is None:  # ended by an exception: the staged files are promoted or removed
            with contextlib.suppress(Exception):  # left staged, the next fit removes them
                settled = _settle(runlog, ray_log, None)
        ray.kill(runlog)
        if staging is not None and settled is not None:  # the store holds all the copy had
            shutil.rmtree(staging, ignore_errors=True)


def _settle(runlog, ray_log, summary: dict[str, Any] | None) -> bool:
    """The fit is over. An accepted run, or a new run's folder, keeps this fit's files and gets
    its summary.json (none: a driver's error ended the fit); a resume that never began (its
    checkpoint or model refused by the workers, or stopped or failed before its first attempt)
    leaves the earlier run's folder as it was, summary.json and ray.log included (runfolder.py).
    True if the files were kept, and then uploaded (a remote run folder: UploadFailed if they
    were not, its staging copy kept); False if this fit left none."""
    if not ray.get(runlog.settle.remote()):
        ray_log.discard()
        return False
    if summary is not None:
        ray.get(runlog.write_file.remote("summary.json", json.dumps(summary, indent=2)))
        ray.get(runlog.finish_tracking.remote(summary))  # log.mlflow / log.wandb: bounded wait
        ray.get(runlog.end_attempt.remote({"cause": summary["status"]}))
    try:
        ray.get(runlog.flush.remote())
    except ray.exceptions.RayTaskError as exc:  # the store refused the run folder's last upload
        raise UploadFailed(str(getattr(exc, "cause", exc)), summary or {}) from None
    return True


@dataclass
class _Outcome:
    """How a fit ended."""

    checkpoint_path: str | None = None
    error: str | None = None  # one line: why it failed
    failure: Failure | None = None  # ... as Ray Train said it
    stopped: str | None = None  # the signal that stopped it


def _fit(cfg: Config, trainer, runlog, progress, local: bool, stop: StopSignals,
         stopped_summary: Callable[[str], str],
         end_without_cluster: Callable[[str, str], None]) -> _Outcome:
    """trainer.fit(), with the driver's threads around it: progress, the run watch (a line
    per failure; the wait for workers bounded), the node watcher of an elastic run, CPU
    priorities. Ray Train's resource request is withdrawn as soon as the fit is over. On a
    local cluster, SIGTERM writes `stopped_summary(signal)` at once, and ends the process
    (`end_without_cluster`) if the cluster went down with it (runwatch.SignalWatch)."""
    outcome = _Outcome()
    if progress is not None:
        progress.start(runlog, poll=functools.partial(poll_progress, runlog))
    watch = RunWatch(cfg, runlog, abort=lambda: abort_controller(trainer.controller),
                     describe_wait=lambda: wait_note(cfg)).start()
    if progress is not None:
        progress.gate = watch.announced  # a failure's line before its next attempt's progress
    elastic = cfg.scaling.min_workers < cfg.scaling.max_workers
    watcher = NodeWatcher().start() if elastic else None
    train_first = TrainFirst().start() if local and cfg.run.train_first else None
    signals = SignalWatch(cluster_processes() if local else [], stopped_summary,
                          end_without_cluster).start()
    try:
        result = trainer.fit()
        outcome.checkpoint_path = result.checkpoint.path if result.checkpoint else None
    except ray.train.TrainingFailedError as exc:
        outcome.failure = describe_failure(exc)
        outcome.error = watch.reason or _reason(outcome.failure) or _short_reason(exc)
    except KeyboardInterrupt as exc:  # RunStopped, or Ray's own KeyboardInterrupt for it from a get
        outcome.stopped = getattr(exc, "signal_name", None) or (stop.received or ["SIGINT"])[0]
    except ray.exceptions.RayError as exc:  # the watch aborted the controller, or Ray lost it
        outcome.error = watch.reason or (f"Ray Train's controller was lost: "
                                         f"{type(exc).__name__}: {_short_reason(exc)}")
    finally:
        stop.disarm()
        signals.close()
        cancel_resource_request(trainer.train_run_context.run_id)
        if progress is not None:
            progress.stop()
        watch.stop()
        if watcher is not None:
            watcher.stop()
        if train_first is not None:
            train_first.stop()
            ray.get(runlog.log_event.remote({"event": "cpu_share", **train_first.changed}))
    return outcome


def _stopped_summary(cfg: Config, folder: str, start: float, record: dict[str, Any],
                     signal_name: str) -> str:
    """A "stopped" summary.json from the run folder's files, and the last attempt's `end`, written
    by the driver itself (runwatch.SignalWatch) for when the signal took the local cluster, and
    the RunLog actor with it, down too: the ordinary stop path replaces both with the RunLog's.
    `folder` is the run folder, or a remote run's staging copy (on this machine: the RunLog
    runs on the driver's node), which `_end_without_cluster` uploads once the RunLog is gone.
    Only for an accepted run (one that never began leaves the folder as it was). Returns what
    it did, for the closing line."""
    from elastic_train.observe.runfolder import CONFIG_FILE, PENDING

    path = Path(folder)
    accepted = (path / CONFIG_FILE).is_file() and not list(path.glob("*" + PENDING))
    if not accepted or not (path / "attempts.json").is_file():
        return ""
    try:
        summary = build_summary(folder, start_time=start, error=None, limits=None)  # no limit
        summary.update(status="stopped", reason=f"stopped by {signal_name}", provenance=record)
        attempts = json.loads((path / "attempts.json").read_text())
        if attempts and attempts[-1].get("start_time", 0) >= start and "end" not in attempts[-1]:
            attempts[-1]["end"] = {"time": time.time(), "cause": "stopped"}
            _write_atomically(path / "attempts.json", json.dumps(attempts))
        _write_atomically(path / "summary.json", json.dumps(summary, indent=2))
    except (OSError, ValueError) as exc:
        return f": summary.json not written ({exc})"
    return ": summary.json written from the run folder" + ("" if "://" not in run_uri(cfg) else
                                                          f"'s staging copy {folder}")


def _end_without_cluster(signal_name: str, written: str,
                         upload: Callable[[], None] | None = None) -> None:
    """The signal that stopped the driver stopped its local Ray cluster too: no call to Ray can
    return (the driver's would wait 60 s for its GCS, then the process dies). The summary is
    written already (`_stopped_summary`: `written` says how it went); what is left of the
    cluster is ended, a remote run's staging copy `upload`ed (the RunLog that would have is
    gone), the process says so and exits at once, 128 + the signal."""
    import signal as signals

    try:  # what is left of the cluster (the raylet's agents): it is going down, end it whole
        for process in psutil.Process().children(recursive=True):
            process.kill()
    except psutil.Error:
        pass
    if upload is not None and written:
        try:
            upload()
            written += " and uploaded"
        except OSError as exc:
            written += f" but not uploaded ({exc}): copy that folder there once the store answers"
    print(redact.shown(f"stopped by {signal_name}; the local Ray cluster went down with the "
                       f"driver{written}"), file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(128 + getattr(signals, signal_name))


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".driver.tmp")  # not the RunLog's `.tmp`: it may write too
    tmp.write_text(redact.shown(text))  # as the RunLog writes (observe/runfolder.py)
    os.replace(tmp, path)


class TrainingFailed(RuntimeError):
    """The run failed on the cluster; `summary` is what summary.json says."""

    def __init__(self, reason: str, summary: dict[str, Any]) -> None:
        super().__init__(reason)
        self.summary = summary


class UploadFailed(RuntimeError):
    """The run ended (`summary`: what summary.json says) but the last upload of its remote run
    folder failed: the message names the folder, the store's error and the staging copy that
    holds every file. Not a failed run: its checkpoints are Ray's own uploads."""

    def __init__(self, reason: str, summary: dict[str, Any]) -> None:
        super().__init__(reason)
        self.summary = summary


class TrainingStopped(TrainingFailed):
    """The driver was stopped by a signal (`signal_name`: SIGINT or SIGTERM); summary.json says
    "stopped" ({} if the fit had not begun)."""

    def __init__(self, signal_name: str, summary: dict[str, Any]) -> None:
        super().__init__(f"stopped by {signal_name}", summary)
        self.signal_name = signal_name


def _reason(failure: Failure) -> str | None:
    """One line for the summary: which rank, where, what."""
    if failure.rank is None:
        return failure.cause
    where = f" on node {failure.node}" if failure.node else ""
    return f"rank {failure.rank}{where}: {failure.cause}"


def _short_reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    errors = [line for line in text if "Error" in line]
    return (errors[-1] if errors else (text[-1] if text else type(exc).__name__))[:500]


__all__ = ["TrainResult", "TrainingFailed", "TrainingStopped", "check_inputs", "run_uri", "split_uri",
           "train"]
