"""The driver's console: our progress, warnings and errors on the screen; Ray's INFO chatter in
the run folder's `ray.log` (all of it on the screen too with `verbose`).

Ray's output reaches a driver three ways:

- Ray Train's controller and workers log through `ray.train` loggers whose console handler prints
  the bare message, without its level, to their stderr, which Ray forwards to the driver
  (log_to_driver). The driver cannot tell INFO from ERROR there, so `ray_train_logging` asks Ray
  Train itself (RunConfig's documented `LoggingConfig`) to keep its INFO off their console:
  "Reporting training result...", "Checkpoint successfully created at...", "[FailurePolicy]
  RETRY". Errors still come, among them the worker's full traceback ("Error in training
  function:"). Ray Train keeps every level in its own files,
  `<ray session>/logs/train/ray-train-sys-*.log`.
- The driver's own Ray loggers (`ray`, `ray.data`), e.g. "Started a local Ray instance": their
  console handlers are raised to WARNING; `RayLog` writes their INFO and up to ray.log.
- Every line forwarded from Ray's processes goes to ray.log; on the screen go those that are not
  Ray chatter (`is_ray_chatter`): lines in Ray's log formats below WARNING (Ray Core, Ray's
  Python loggers), the few INFO lines that escape or lose their level (Ray Train's per-report
  line, Ray Data's per-dataset lines in workers), and one ERROR that is Ray's own and harmless.
- Nor do Ray's reports of a failure (`FailureReports`): tracebacks of the controller and the
  workers, the raylet's "A worker died or was killed" with its advice on the OOM killer. A killed
  worker put ~50 such lines on the screen, and no line said what happened: runwatch.py prints
  one line per failure instead, and a run that fails for good shows the failing worker's
  traceback (api.py).
- Nor do libraries' notices in the workers (`LibraryNoise`): bitsandbytes' missing CPU kernel,
  c10d's and NCCL's start-up notices, progress bars (transformers' "Loading weights"), future
  and deprecation warnings with their source line.
- Two WARNINGs of Ray's that say nothing to a user of a run (`RAY_NOISE`): token authentication
  being on, and "Found multiple active Ray instances" (40 of 57 lines of one job's log), from
  the driver's loggers or forwarded.

The forwarded lines are taken from Ray's private dispatcher, and the errors Ray publishes to the
driver (the raylet's word on a dead worker) from the function that prints them,
`ray._private.worker.print_to_stdstream`: the reaches into Ray's internals here, read from Ray
2.60 (`ray/_private/ray_logging/__init__.py`, `ray/_private/worker.py`: `listen_error_messages`).
If a later Ray moves them, `route_forwarded_lines` raises and tests/test_console.py fails.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from elastic_train.config import redact

RAY_LOG = "ray.log"  # in the run folder
DRIVER_RAY_LOGGERS = ("ray", "ray.data")  # the driver's Ray loggers with console handlers of their own
_RAY_PRINT_HANDLER = "ray_print_logs"  # the name ray.init gives its forwarded-line printer

# Ray's Python log format, "2026-11-30 22:09:30,474\tINFO worker.py:2029 -- ..."
_RAY_PY_BELOW_WARNING = re.compile(r"\b(TRACE|DEBUG|INFO) [\w.-]+\.py:\d+ -- ")
# Ray Core's C++ log format, "[2026-11-30 22:09:47,462 I 14213 14245] core_worker.cc:2465: ..."
_RAY_CC_BELOW_WARNING = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,.]+ [DI] \d+ \d+\] ")
# Ray Train logs this INFO through `logging.getLogger(__file__)` (execution/context.py): a logger
# named by a file path, outside `ray.train`, so its LoggingConfig does not reach it.
_REPORT_INFO = "Reporting training result "
# Ray Data's INFO lines on a dataset's start and end (Ray 2.60 streaming_executor.py), printed bare in
# a worker process (data.reader=ray_data): its console handler drops the level there.
_RAY_DATA_INFO = re.compile(r"^Starting execution of Dataset \S+\.|^Execution plan of Dataset \S+: "
                            r"|Dataset \S+ execution finished in [\d.]+ seconds$")
# Ray Train's PreemptionCallback passes the workers' actor handles to its PreemptionWatcher actor
# (max_restarts=-1), so Ray Core logs at ERROR, on every worker-group start, that the actor's
# constructor arguments live in the object store (ray-project/ray#53727). It is Ray's call, not
# ours (we construct nothing of the kind) and harmless here: a watcher that cannot restart costs
# only the early warning of a drain, and the next worker group gets a new one.
_PREEMPTION_WATCHER_ARGS = ("'PreemptionWatcher'", "constructor arguments in the object store")


RAY_NOISE = ("Found multiple active Ray instances", "Token authentication is enabled for this Ray",
             "Token authentication is disabled for this Ray",
             # the GCS at shutdown, ending an actor whose process is gone already
             "KillActor RPC failed for actor")
# The first line of a report of Ray's on a failure: a traceback, Ray Train's worker error and its
# controller's failed shutdown, the raylet's word on a dead worker.
_FAILURE_REPORT = re.compile(r"^(Traceback \(most recent call last\):|Error in training function:|"
                             r"Graceful shutdown of backend failed|Error in control loop iteration|"
                             r"A worker died or was killed while executing)")
# ... and the lines that go on one: indented (frames, Ray's actor fields), carets, exception lines,
# chained-exception headers, blank lines.
_REPORT_GOES_ON = re.compile(r"^(\s|$|\^|[\w.]+(Error|Exception|Interrupt|Exit)\b|During handling|"
                             r"The above exception|The actor is dead because|Traceback )")


# Libraries' notices in the workers that say nothing to a user of a run (issue 38): bitsandbytes'
# failed optional CPU kernel (printed on every import), c10d's hostname notice on GPU workers, Ray
# Train's NCCL flight recorder on CPU workers. They stay in ray.log.
LIBRARY_NOISE = ("Failed to load CPU gemm_4bit_forward", "Skipping publisher trust check for "
                 "'kernels-community/", "The hostname of the client socket cannot be retrieved",
                 "Unable to reset NCCL flight recorder")
# A progress bar (tqdm's format: transformers' "Loading weights", safetensors' writes ...):
# "Loading weights: 100%|██████████| 3/3 [00:00<00:00, 120.5it/s]"
_PROGRESS_BAR = re.compile(r"\d+%\|[^|]*\|\s*[\d.]+[kMG]?/[\d.?]+[kMG]?\s*\[")
# A Python warning's first line, "path.py:12: FutureWarning: ...", of the kinds libraries emit
# about their own future; its next line is the source line (indented)
_LIBRARY_WARNING = re.compile(r"\.py:\d+: (FutureWarning|DeprecationWarning|PendingDeprecationWarning)"
                              r": ")


class LibraryNoise:
    """Which forwarded lines are libraries' notices (`LIBRARY_NOISE`, progress bars, future and
    deprecation warnings with their source line), per process."""

    def __init__(self) -> None:
        self._in_warning: dict[Any, bool] = {}

    def hides(self, source: Any, line: str) -> bool:
        if _LIBRARY_WARNING.search(line):
            self._in_warning[source] = True
            return True
        if self._in_warning.pop(source, False) and line[:1].isspace():
            return True  # the warning's source line
        return bool(_PROGRESS_BAR.search(line) or any(noise in line for noise in LIBRARY_NOISE))


class LibraryNoiseFilter(logging.Filter):
    """Keeps libraries' notices (`LIBRARY_NOISE`; future and deprecation warnings, which
    `quiet_library_notices` routes through logging) off the driver's console handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.name == "py.warnings" and _LIBRARY_WARNING.search(message):
            return False
        return not any(noise in message for noise in LIBRARY_NOISE)


def quiet_library_notices() -> None:
    """The command line's console: Python's warnings through logging (`py.warnings`), and
    libraries' notices (bitsandbytes' CPU kernel as the driver imports peft, transformers'
    future warnings as it builds the meta model) kept off the root logger's handlers."""
    logging.captureWarnings(True)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, LibraryNoiseFilter) for f in handler.filters):
            handler.addFilter(LibraryNoiseFilter())


class FailureReports:
    """Which forwarded lines belong to a report of Ray's on a failure (see the module
    docstring), per process: a report starts at a line of `_FAILURE_REPORT` and goes on while the
    lines look like a traceback's."""

    def __init__(self) -> None:
        self._in_report: dict[Any, bool] = {}

    def hides(self, source: Any, line: str) -> bool:
        if _FAILURE_REPORT.match(line):
            self._in_report[source] = True
        elif self._in_report.get(source) and not _REPORT_GOES_ON.match(line):
            self._in_report[source] = False
        return self._in_report.get(source, False)


class _NoiseFilter(logging.Filter):
    """Keeps RAY_NOISE off a console handler of the driver's Ray loggers."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(noise in message for noise in RAY_NOISE)


def is_ray_chatter(line: str) -> bool:
    """A forwarded line that belongs in ray.log only: Ray's INFO (or DEBUG) log lines, in its
    Python or C++ format, the INFO lines of Ray Train and Ray Data that reach the driver without
    their level, and the harmless PreemptionWatcher error."""
    return bool(_RAY_PY_BELOW_WARNING.search(line) or _RAY_CC_BELOW_WARNING.match(line)
                or line.startswith(_REPORT_INFO) or _RAY_DATA_INFO.search(line)
                or all(part in line for part in _PREEMPTION_WATCHER_ARGS)
                or any(noise in line for noise in RAY_NOISE))


def ray_train_logging(verbose: bool):
    """Ray Train's LoggingConfig for RunConfig: INFO with `verbose`, else WARNING."""
    from ray.train import LoggingConfig

    return LoggingConfig(log_level="INFO" if verbose else "WARNING")


class RayLog(logging.Handler):
    """ray.log: records of the driver's Ray loggers and lines forwarded from Ray's processes.
    Held in memory until `open` names the file (the run folder is known only once Ray runs)."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        # Ray's own format: ray.init sets it on every handler of the `ray` logger anyway.
        self.setFormatter(logging.Formatter(
            "%(asctime)s\t%(levelname)s %(filename)s:%(lineno)s -- %(message)s"))
        self._pending: list[str] = []
        self._file = None
        self._size_before: int | None = None  # the file's size when opened (None: it was not there)
        self._dropping = False  # discarded: later lines go nowhere

    def open(self, path: str | Path) -> None:
        """Append to `path` from now on, starting with what was held."""
        with self.lock:
            self._size_before = os.path.getsize(path) if os.path.isfile(path) else None
            self._file = open(path, "a", encoding="utf-8")  # closed by close()
            self._write_now(self._pending)
            self._pending = []

    def discard(self) -> None:
        """Take back what this fit wrote (one that ended before it began leaves an earlier run's
        folder as it was: runfolder.py); later lines are dropped."""
        with self.lock:
            self._dropping, self._pending = True, []
            if self._file is None:
                return
            path = self._file.name
            self._file.close()
            self._file = None
            if self._size_before is None:
                os.remove(path)
            else:
                os.truncate(path, self._size_before)

    def emit(self, record: logging.LogRecord) -> None:
        self.write([self.format(record)])

    def write(self, lines: list[str]) -> None:
        with self.lock:
            if self._dropping:
                return
            if self._file is None:
                self._pending.extend(lines)
            else:
                self._write_now(lines)

    def _write_now(self, lines: list[str]) -> None:
        self._file.write("".join(redact.shown(line) + "\n" for line in lines))
        self._file.flush()  # a crash of the driver must not lose what Ray said last

    def close(self) -> None:
        with self.lock:
            if self._file is not None:
                self._file.close()
                self._file = None
        super().close()


def forwarded_lines(data: dict[str, Any]) -> list[str]:
    """A batch of forwarded output as ray.log lines: time, process (as Ray prefixes it on the
    screen), line."""
    name = data.get("actor_name") or data.get("task_name") or ""
    source = f"({name} pid={data.get('pid')})".replace("( ", "(")
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    return [f"{stamp} {source} {line}" for line in data.get("lines", [])]


def _masked(data: dict[str, Any]) -> dict[str, Any]:
    """Forwarded output with the secrets of its URIs masked (config/redact.py): a worker's
    traceback may name the store it failed to read."""
    return {**data, "lines": [redact.shown(line) for line in data.get("lines", [])]}


def _dispatcher():
    from ray._private.ray_logging import global_worker_stdstream_dispatcher

    return global_worker_stdstream_dispatcher


def route_forwarded_lines(log: RayLog, verbose: bool) -> Callable[[], None]:
    """Wrap the printer that ray.init (log_to_driver) installed: every forwarded line to `log`,
    only the lines that are not Ray chatter (all of them with `verbose`) on to Ray's printer.
    Returns the undo. Without log_to_driver there is nothing to wrap."""
    dispatcher = _dispatcher()
    with dispatcher._lock:
        handlers = dispatcher.handlers
        index = next((i for i, (name, _) in enumerate(handlers) if name == _RAY_PRINT_HANDLER), None)
        if index is None:
            return lambda: None
        ray_print = handlers[index][1]
        reports, noise = FailureReports(), LibraryNoise()

        def route(data: dict[str, Any]) -> None:
            data = _masked(data)
            if data.get("pid") == "autoscaler":
                # Its whole log, every 5 s, of which Ray's printer shows only the events.
                ray_print(data)
                return
            log.write(forwarded_lines(data))
            source = (data.get("ip"), data.get("pid"))
            shown = [line for line in data.get("lines", []) if verbose or not (
                reports.hides(source, line) or noise.hides(source, line) or is_ray_chatter(line))]
            if shown:
                ray_print({**data, "lines": shown})

        # Replaced under Ray's own name: ray.shutdown removes it by that name as it would Ray's.
        dispatcher.handlers = [*handlers[:index], (_RAY_PRINT_HANDLER, route), *handlers[index + 1:]]

    import ray._private.worker as ray_worker

    print_error = ray_worker.print_to_stdstream

    def route_error(data: dict[str, Any], ignore_prefix: bool) -> None:
        """Errors Ray publishes to the driver (`listen_error_messages`): to ray.log, and to the
        screen unless they are a report of a failure (runwatch.py prints its own line)."""
        data = _masked(data)
        log.write(forwarded_lines(data))
        shown = [line for line in data.get("lines", []) if verbose or not (
            reports.hides("published", line) or is_ray_chatter(line))]
        if shown:
            print_error({**data, "lines": shown}, ignore_prefix=ignore_prefix)

    ray_worker.print_to_stdstream = route_error

    def undo() -> None:
        with dispatcher._lock:
            dispatcher.handlers = [(name, ray_print if handler is route else handler)
                                   for name, handler in dispatcher.handlers]
        if ray_worker.print_to_stdstream is route_error:
            ray_worker.print_to_stdstream = print_error

    return undo


def _is_console(handler: logging.Handler) -> bool:
    """A handler that writes to the screen (Ray's PlainRayHandler is one), not to a file."""
    return isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)


@contextmanager
def ray_console(verbose: bool) -> Iterator[RayLog]:
    """While open: the driver's Ray loggers write INFO and up to the RayLog it yields and, unless
    `verbose`, only WARNING and up to the screen. Restored on exit, so that a Python driver that
    calls `train` keeps its own logging as it was."""
    import ray  # noqa: F401 (importing ray installs the handlers quieted here)
    import ray.data  # noqa: F401

    log = RayLog()
    saved: list[tuple[logging.Handler, int]] = []
    noise = _NoiseFilter()
    loggers = [logging.getLogger(name) for name in DRIVER_RAY_LOGGERS]
    for logger in loggers:
        if not verbose:
            for handler in filter(_is_console, logger.handlers):
                if any(handler is h for h, _ in saved):
                    continue  # one handler on both loggers (after a ray.init): its level once
                saved.append((handler, handler.level))
                handler.setLevel(max(handler.level, logging.WARNING))
                handler.addFilter(noise)
        logger.addHandler(log)
    try:
        yield log
    finally:
        for logger in loggers:
            logger.removeHandler(log)
        for handler, level in saved:
            handler.setLevel(level)
            handler.removeFilter(noise)
        log.close()
