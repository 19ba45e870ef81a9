"""Tracked runs: the run's figures in MLflow (`log.mlflow`) and Weights & Biases (`log.wandb`).

One place logs them: the RunLog actor on the driver's node (cluster/runlog.py) hands every step and
evaluation record it keeps to a `Tracker`, never a worker. What a tracked run holds: the resolved
config as parameters, each step's and evaluation's figures, summary.json's totals, the report's
plots (loss.png, throughput.png) as artifacts, and tags for the attempt and the world size.

The effective-step rule (`EffectiveSteps`). A step's effective record is its latest attempt's, as in
metrics.jsonl's readers; but a tracker cannot take a record back (MLflow appends a second value of a
step, W&B's history only goes forward). So a record is held back until no later attempt can replay
its step: until a checkpoint of that step or later is committed (a restart resumes from the latest
committed checkpoint, so it replays only steps after it), or the run ends. A record of attempt a is
dropped as superseded once an attempt b > a has logged a step at or before it. A step is logged
once; its metrics hold the step's and its evaluation's figures (the loop evaluates a step before
it checkpoints it, so its evaluation is there before a commit releases the step).

Only the run's end releases everything. Before the first commit nothing is released (a restart
would replay from the start), and a poll that cannot read Ray's snapshot (half written, or a
format this module does not know) releases nothing until a later poll reads it. In place
(`fault.recovery=in_place`) Ray commits only the final checkpoint (the periodic ones are written
in place, recovery/checkpoints.py): the committed step read is Ray's alone, never the in-place
pointer's, so such a run's steps are held until the run's end (or, on a resumed run, released up
to the checkpoint Ray committed before). We chose that over reading `in_place_checkpoint.json`:
it is always safe (a restore takes a checkpoint at least as new as Ray's), and the committed
step's other readers (the failure lines, attempts.json) keep Ray's meaning.

A tracking server that is down or slow never stops or slows training: the RunLog only puts records
on a bounded queue (never waiting); one background thread talks to the servers. A backend that
fails is dropped with one warning; the run folder keeps every figure as always. The tracked run's id
is kept in the run folder (`tracking.json`), so a resume continues the same tracked run; steps that a
failed driver released (the run's end releases all it holds) are not logged again by the resume.

Imports no Ray (the RunLog passes in how to read the committed step and where to warn), and neither
mlflow nor wandb until a run asks for them (optional extras: `pip install -e '.[track]'`).
"""

from __future__ import annotations

import json
import math
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

STATE_FILE = "tracking.json"  # in the run folder: the tracked runs' ids and the steps released
QUEUE_SIZE = 20_000  # records waiting for the thread; more are dropped (a warning), never waited for
COMMIT_POLL_S = 2.0  # how often the thread looks for a newly committed checkpoint
FINISH_WAIT_S = 60.0  # how long the run's end waits for the last figures to reach the servers
SKIPPED_FIELDS = ("step", "time")  # a record's fields that are not figures (step is the x axis)
MLFLOW_EXPERIMENT = "elastic_train"  # unless MLFLOW_EXPERIMENT_NAME says otherwise


def figures(record: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of a record (nested ones, flags and text left out)."""
    return {k: float(v) for k, v in record.items()
            if k not in SKIPPED_FIELDS and isinstance(v, int | float) and not isinstance(v, bool)}


class EffectiveSteps:
    """Which records to log, and when: see the module docstring. Pure; the thread owns it."""

    def __init__(self, released: dict[str, int] | None = None) -> None:
        self.released = {"step": -1, "eval": -1, **(released or {})}  # per kind: logged up to here
        self.pending: dict[tuple[str, int], dict[str, Any]] = {}  # (kind, step): latest attempt's
        self.first_step: dict[int, int] = {}  # attempt -> the lowest step it logged

    def add(self, kind: str, record: dict[str, Any]) -> None:
        attempt, step = record["attempt"], record["step"]
        if step <= self.released[kind]:
            return  # logged already: a tracker cannot take it back
        if kind == "step":
            self.first_step[attempt] = min(self.first_step.get(attempt, step), step)
        old = self.pending.get((kind, step))
        if old is None or attempt >= old["attempt"]:
            self.pending[(kind, step)] = record

    def _superseded(self, record: dict[str, Any]) -> bool:
        return any(b > record["attempt"] and first <= record["step"]
                   for b, first in self.first_step.items())

    def release(self, up_to: int | None) -> list[tuple[int, dict[str, float]]]:
        """The effective records of steps up to `up_to` (None: all, for the run's end only),
        merged per step, in step order; superseded records are dropped."""
        out: dict[int, dict[str, float]] = {}
        for (kind, step), record in sorted(self.pending.items(), key=lambda kv: kv[0][1]):
            if self._superseded(record):
                del self.pending[(kind, step)]
            elif up_to is None or step <= up_to:
                del self.pending[(kind, step)]
                out.setdefault(step, {}).update(figures(record))
                self.released[kind] = max(self.released[kind], step)
        return sorted(out.items())


class Backend(Protocol):
    """One tracking service. Every call may raise: the Tracker drops a backend that does."""

    name: str
    target: str  # the URI or project, for the warning

    def open(self, run_id: str | None, run_name: str, params: dict[str, Any]) -> str: ...
    def log(self, rows: list[tuple[int, dict[str, float]]]) -> None: ...  # (step, figures)
    def tag(self, tags: dict[str, str]) -> None: ...
    def finish(self, summary: dict[str, Any], files: list[Path]) -> None: ...


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The resolved config as dotted keys: `train.max_steps` -> "8"."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, list | dict) else str(value)
    return out


def summary_figures(summary: dict[str, Any]) -> dict[str, float]:
    return {f"summary/{k}": v for k, v in figures(summary).items() if math.isfinite(v)}


class MlflowBackend:
    """MLflow through its client API (no global active run: the actor may hold other runs)."""

    name = "mlflow"

    def __init__(self, uri: str) -> None:
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 refuses a file store unless told; the user asked for one by its URI
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        # a server that is down: fail in seconds, not after minutes of retries (the run goes on)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        from mlflow.tracking import MlflowClient

        self.target = uri
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = ""

    def open(self, run_id: str | None, run_name: str, params: dict[str, Any]) -> str:
        from mlflow.entities import Param

        if run_id:
            self.client.update_run(run_id, status="RUNNING")
            have = self.client.get_run(run_id).data.params  # params are immutable: only new keys
        else:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", MLFLOW_EXPERIMENT)
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(name))
            run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            have = {}
        self.run_id = run_id
        new = [Param(k, v[:6000]) for k, v in flatten(params).items() if k not in have]
        for i in range(0, len(new), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(run_id, params=new[i:i + 100])
        return run_id

    def log(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for step, figs in rows for k, v in figs.items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics a batch
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def tag(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])

    def finish(self, summary: dict[str, Any], files: list[Path]) -> None:
        self.log([(int(summary.get("steps") or 0), summary_figures(summary))])
        for path in files:
            self.client.log_artifact(self.run_id, str(path))
        status = {"finished": "FINISHED", "stopped": "KILLED"}.get(summary.get("status"), "FAILED")
        self.client.set_terminated(self.run_id, status)


class WandbBackend:
    """W&B: one run per tracked run, its own x axis `step` (W&B's own step only goes forward)."""

    name = "wandb"

    def __init__(self, project: str, folder: Path) -> None:
        import wandb

        self.wandb, self.target, self.folder = wandb, project, folder
        self.run: Any = None

    def open(self, run_id: str | None, run_name: str, params: dict[str, Any]) -> str:
        settings = self.wandb.Settings(silent=True, init_timeout=30, console="off")
        self.run = self.wandb.init(project=self.target, name=run_name, id=run_id or None,
                                   resume="allow", config=params, dir=str(self.folder),
                                   settings=settings, reinit="create_new")
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        return self.run.id

    def log(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        for step, figs in rows:
            self.run.log({"step": step, **figs})

    def tag(self, tags: dict[str, str]) -> None:
        self.run.tags = tuple(f"{k}={v}" for k, v in tags.items())

    def finish(self, summary: dict[str, Any], files: list[Path]) -> None:
        self.run.summary.update({k.removeprefix("summary/"): v for k, v in summary_figures(summary).items()})
        self.run.summary["status"] = str(summary.get("status"))
        for path in files:  # copied into the run's own folder: W&B links files it saves
            kept = Path(shutil.copy(path, Path(self.run.dir) / path.name))
            self.run.save(str(kept), base_path=self.run.dir, policy="now")
        self.run.finish(exit_code=0 if summary.get("status") == "finished" else 1)


def build_backends(mlflow_uri: str | None, wandb_project: str | None, folder: Path) -> list[Backend]:
    backends: list[Backend] = []
    if mlflow_uri:
        backends.append(MlflowBackend(mlflow_uri))
    if wandb_project:
        backends.append(WandbBackend(wandb_project, folder))
    return backends


def report_plots(folder: Path, out: Path) -> list[Path]:
    """The report's loss.png and throughput.png (observe/report.py), drawn into `out`."""
    from elastic_train.observe.report import find_marks, load_run, plot_loss, plot_throughput

    run = load_run(folder)
    marks = find_marks(run.records, run.attempts)
    plot_loss(run, marks, out / "loss.png")
    plot_throughput(run, marks, out / "throughput.png")
    return [p for p in (out / "loss.png", out / "throughput.png", folder / "summary.json") if p.is_file()]


class Tracker:
    """The RunLog's side: `add`, `attempt` and `finish` put work on a bounded queue and return;
    one daemon thread opens the tracked runs and logs. See the module docstring."""

    def __init__(self, make_backends: Callable[[], list[Backend]], folder: Path, run_name: str,
                 params: dict[str, Any], committed: Callable[[], int | None],
                 warn: Callable[[str], None], poll_s: float = COMMIT_POLL_S) -> None:
        self.make_backends, self.folder, self.run_name, self.params = make_backends, folder, run_name, params
        self.committed, self.warn, self.poll_s = committed, warn, poll_s
        self.state: dict[str, Any] = self._load_state()
        self.steps = EffectiveSteps(self.state.get("released"))
        self.queue: queue.Queue = queue.Queue(maxsize=QUEUE_SIZE)
        self.backends: list[Backend] = []
        self.dropped = False
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="tracking", daemon=True)
        self.thread.start()

    # -- the RunLog's side: never waits ----------------------------------------------------------
    def add(self, kind: str, record: dict[str, Any]) -> None:
        self._put(("add", kind, record))

    def attempt(self, index: int, world_size: int) -> None:
        self._put(("tag", {"attempt": str(index), "world_size": str(world_size)}))

    def finish(self, summary: dict[str, Any], timeout_s: float = FINISH_WAIT_S) -> bool:
        """The run ended: release every held record, log the summary and the plots, close the
        tracked runs. Waits at most `timeout_s`; True if all of it was done."""
        try:
            self.queue.put(("finish", summary), timeout=timeout_s)
        except queue.Full:
            return False
        return self.done.wait(timeout_s)

    def _put(self, item: tuple) -> None:
        try:
            self.queue.put_nowait(item)
        except queue.Full:
            if not self.dropped:
                self.dropped = True
                self.warn("tracking falls behind the run: figures left out of the tracked run "
                          "(the run folder has them all)")

    # -- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._open()
            next_poll = time.monotonic()
            while True:
                try:
                    item = self.queue.get(timeout=self.poll_s)
                except queue.Empty:
                    item = None
                if item is not None and item[0] == "finish":
                    self._finish(item[1])
                    return
                if item is not None:
                    self._handle(item)
                if self.steps.pending and time.monotonic() >= next_poll:
                    next_poll = time.monotonic() + self.poll_s
                    committed = self._committed()
                    if committed is not None:  # none yet, or unreadable: hold everything
                        self._log(self.steps.release(committed))
        finally:
            self.done.set()

    def _open(self) -> None:
        try:
            backends = self.make_backends()
        except Exception as exc:  # an import that fails where preflight found the package
            self.warn(f"tracking is off: {type(exc).__name__}: {exc}")
            return
        for backend in backends:
            run_id = self._call(backend, lambda b=backend: b.open(
                self.state.get(b.name), self.run_name, self.params))
            if run_id is not None:
                self.backends.append(backend)
                self.state[backend.name] = run_id
        self._save_state()

    def _handle(self, item: tuple) -> None:
        if item[0] == "add":
            self.steps.add(item[1], item[2])
        elif item[0] == "tag":
            for backend in list(self.backends):
                self._call(backend, lambda b=backend: b.tag(item[1]))

    def _committed(self) -> int | None:
        """The committed step; None if none is committed yet or the snapshot cannot be read now
        (both release nothing: see the module docstring)."""
        try:
            return self.committed()
        except Exception:  # a snapshot being rewritten: look again at the next poll
            return None

    def _log(self, released: list[tuple[int, dict[str, float]]]) -> None:
        if not released:
            return
        for backend in list(self.backends):
            self._call(backend, lambda b=backend: b.log(released))
        self._save_state()

    def _finish(self, summary: dict[str, Any]) -> None:
        while True:  # what was queued before the end
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if item[0] != "finish":
                self._handle(item)
        self._log(self.steps.release(None))
        if not self.backends:
            return
        with tempfile.TemporaryDirectory(prefix="elastic-train-plots-") as tmp:
            try:
                files = report_plots(self.folder, Path(tmp))
            except Exception as exc:  # the figures are in the run folder; the report draws them
                self.warn(f"tracking: the report's plots failed ({type(exc).__name__}: {exc})")
                files = []
            for backend in list(self.backends):
                self._call(backend, lambda b=backend: b.finish(summary, files))

    def _call(self, backend: Backend, fn: Callable[[], Any]) -> Any:
        """`fn()`, or None with one warning and the backend dropped if it raises."""
        try:
            result = fn()
            return True if result is None else result
        except Exception as exc:
            if backend in self.backends:
                self.backends.remove(backend)
            self.warn(f"tracking to {backend.name} ({backend.target}) failed, so the run goes on "
                      f"without it (its figures are in the run folder): {type(exc).__name__}: "
                      f"{str(exc)[:300]}")
            return None

    def _load_state(self) -> dict[str, Any]:
        path = self.folder / STATE_FILE
        try:
            return json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError):
            return {}

    def _save_state(self) -> None:
        self.state["released"] = dict(self.steps.released)
        path = self.folder / STATE_FILE
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, path)
