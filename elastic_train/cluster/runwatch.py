"""The driver's watch over a fit: one console line per failure, the wait for workers shown and
bounded, and what a run holds in Ray released when it ends, however it ends.

`RunWatch` is a thread that polls the RunLog (what the failure policy recorded, the attempts):

- one line per failure: which rank on which node, the cause, the step it got to, and the
  checkpoint the next attempt resumes from at which size (printed once that attempt begins; a
  failure that ends the run says so at once). Ray's own tracebacks go to ray.log (console.py).
- while no worker group of this fit runs (before the first, after a failure), what it waits for,
  every `WAIT_LINE_EVERY_S`; after `scaling.start_timeout_s` it ends the run, naming the shortfall.
  Ray Train's elastic policy waits for its minimum without raising anything, and its fixed-size
  policy retries start-up timeouts forever: this is the one bound over both.

`release` is what a run holds beyond its processes: Ray Train's controller (aborted: its worker
group and placement group go with it) and the controller's resource request to Ray's autoscaling
coordinator, a detached actor that outlives the run. Left there, that request reserved the
cluster's CPUs for a run that was gone: an elastic run started next on a 2-CPU head saw "ready
resources for 0 workers" for 136-158 s (the request expires 180 s after its last renewal, Ray
2.60's AUTOSCALING_REQUESTS_EXPIRE_TIME_S). Requester id and coordinator are read from Ray 2.60
(`train-<run_id>`, scaling_policy.py; nodewatch.COORDINATOR); tests/test_runend.py fails if they
move.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from elastic_train.cluster.nodewatch import COORDINATOR
from elastic_train.config import Config, redact

logger = logging.getLogger("elastic_train")

WAIT_LINE_EVERY_S = 30.0
FIRST_WAIT_LINE_S = 45.0  # a worker group's normal start (~15 s cold, on 2 cores) says nothing
RESUME_LINE_WAIT_S = 30.0  # a failure line waits this long for the next attempt's size
RAY_CALL_TIMEOUT_S = 10.0


def failure_line(failure: dict[str, Any], next_attempt: dict[str, Any] | None,
                 fatal: str | None = None) -> str:
    """One line for a failure the RunLog recorded (failures.py), and what came of it (`fatal`:
    the reason the run stops, when a worker found one that a restart would meet again)."""
    who = f"rank {failure['rank']}" if failure.get("rank") is not None else "the worker group"
    where = f" on node {failure['node']}" if failure.get("node") else ""
    at = f" at step {failure['step']}" if failure.get("step") is not None else ""
    attempt = f"attempt {failure['attempt']}: " if failure.get("attempt") is not None else ""
    line = f"{attempt}{who}{where} failed{at}: {failure['cause']}"
    committed = failure.get("committed_step")
    start = f"the checkpoint of step {committed}" if committed is not None else "the start (no checkpoint)"
    if fatal and fatal[:80] in failure["cause"]:
        return f"{line}; stopping: a restart would fail the same way"
    if failure.get("decision") == "give_up":
        repeats, budget = failure.get("repeats", 1), failure.get("max_failures")
        why = (f" ({repeats} times in a row without a step)" if repeats > 1
               else f" (no restart left: scaling.max_failures={budget})" if budget is not None
               and budget >= 0 else "")
        return f"{line}{why}; giving up"
    if failure.get("in_place"):
        return f"{line}; the others train on, a replacement joins in place"
    if next_attempt is not None:
        return f"{line}; resumed from {start} with {next_attempt['world_size']} workers"
    return f"{line}; restarting from {start}"


class RunWatch:
    """See the module docstring. `describe_wait()` says what the run waits for (capacity.py);
    `abort()` ends the fit."""

    def __init__(self, cfg: Config, runlog, abort: Callable[[], None],
                 describe_wait: Callable[[], str], stream=None, interval_s: float = 0.5,
                 clock: Callable[[], float] = time.time) -> None:
        self.cfg, self.runlog, self.abort, self.describe_wait = cfg, runlog, abort, describe_wait
        self.stream = stream or sys.stderr
        self.interval_s, self.clock = interval_s, clock
        self.reason: str | None = None  # set if it ended the run
        self.printed: set[int] = set()
        self._fit_start = clock()
        self._last_wait_line = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="run-watch")
        # stop()'s final poll and a poll of the thread still waiting on the RunLog (its join
        # gives up after 5 s): one prints a failure's line, never both
        self._poll_lock = threading.Lock()

    def start(self) -> RunWatch:
        self._fit_start = self.clock()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.poll(final=True)  # the lines of failures recorded since the last poll

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def _print(self, line: str) -> None:
        # One write: print() writes the line and its newline apart, and sys.stderr is unbuffered,
        # so a progress line (stdout, another thread) could land between them on a shared pipe.
        self.stream.write(redact.shown(line) + "\n")
        self.stream.flush()

    def announced(self, failures: list[dict], attempts: list[dict], latest: dict) -> bool:
        """Whether every failure before the attempt of the step record `latest` has had its
        line (the progress display holds that attempt's lines back until then, so a failure's
        line comes before the lines of the attempt it caused)."""
        start = next((a["start_time"] for a in attempts if a.get("attempt") == latest.get("attempt")),
                     None)
        if start is None or self._stop.is_set():
            return True
        return all(i in self.printed for i, failure in enumerate(failures)
                   if failure["kind"] != "start_timeout" and failure["time"] < start)

    def poll(self, final: bool = False) -> None:
        try:
            state = ray.get(self.runlog.progress.remote(), timeout=RAY_CALL_TIMEOUT_S)
        except Exception:  # the RunLog is gone at the end
            return
        with self._poll_lock:
            now = self.clock()
            attempts = [a for a in state["attempts"] if a["start_time"] >= self._fit_start]
            failures = state.get("failures", [])
            for i, failure in enumerate(failures):
                if i in self.printed or failure["kind"] == "start_timeout":
                    continue
                later = [a for a in attempts if a["start_time"] > failure["time"]]
                if not (later or final or i < len(failures) - 1 or failure.get("decision") == "give_up"
                        or failure.get("in_place") or now - failure["time"] > RESUME_LINE_WAIT_S):
                    break  # its line waits for the next attempt's size; the lines keep their order
                self.printed.add(i)
                self._print(failure_line(failure, later[0] if later else None, state.get("fatal")))
            if not final and not self._stop.is_set():
                self._watch_start(attempts, now, state.get("worker_started"))

    def _watch_start(self, attempts: list[dict], now: float, worker_started: float | None = None) -> None:
        """While no worker group runs: show the wait, end it after scaling.start_timeout_s. A
        worker that started since then builds its model (a large one takes minutes): no wait,
        and the resources it holds are the run's own, not "other runs or tasks"."""
        if attempts and "end" not in attempts[-1]:
            return
        since = attempts[-1]["end"]["time"] if attempts else self._fit_start
        if worker_started is not None and worker_started > since:
            return
        waited = now - since
        timeout = self.cfg.scaling.start_timeout_s
        if waited >= timeout and self.reason is None:
            self.reason = (f"no room for the run's workers within scaling.start_timeout_s="
                           f"{timeout:g}: {self.describe_wait()}")
            self._print(f"giving up: {self.reason}")
            self.abort()
        elif waited >= FIRST_WAIT_LINE_S and now - self._last_wait_line >= WAIT_LINE_EVERY_S:
            self._last_wait_line = now
            self._print(f"waiting for workers ({waited:.0f} s of scaling.start_timeout_s="
                        f"{timeout:g}): {self.describe_wait()}")


def abort_controller(controller) -> None:
    """Abort Ray Train's controller (its worker group, placement group and resource request go
    with it); nothing if it has ended already."""
    if controller is None:
        return
    try:
        ray.get(controller.abort.remote(), timeout=RAY_CALL_TIMEOUT_S)
    except Exception:  # abort ends the actor: its own call may see it die; or it was gone
        pass


def cancel_resource_request(run_id: str | None) -> bool:
    """Withdraw the run's request from Ray's autoscaling coordinator (Ray Train's controller
    does on a graceful end; a driver killed by `ray job stop` gives it no chance). True if a
    coordinator answered."""
    if run_id is None:
        return False
    try:
        coordinator = ray.get_actor(COORDINATOR[0], namespace=COORDINATOR[1])
        ray.get(coordinator.cancel_request.remote(requester_id=f"train-{run_id}"),
                timeout=RAY_CALL_TIMEOUT_S)
        return True
    except Exception as exc:  # no coordinator (never started) or the cluster is going
        logger.info("could not withdraw the run's resource request: %s", exc)
        return False


def open_requests() -> list[str]:
    """The requester ids with a live request at Ray's autoscaling coordinator (for tests and
    the operations page)."""
    try:
        coordinator = ray.get_actor(COORDINATOR[0], namespace=COORDINATOR[1])
    except ValueError:
        return []
    return ray.get(coordinator.__ray_call__.remote(lambda self: sorted(self._ongoing_reqs)),
                   timeout=RAY_CALL_TIMEOUT_S)


class RunStopped(KeyboardInterrupt):
    """The driver got SIGINT or SIGTERM (`ray job stop` sends SIGTERM) while a run was on."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


def cluster_processes() -> list:
    """The processes of the local Ray cluster this driver started (its children: the GCS
    server, the raylet, the dashboard, the log monitor, ...), as psutil.Process objects."""
    import psutil

    try:
        return [p for p in psutil.Process().children() if p.status() != psutil.STATUS_ZOMBIE]
    except psutil.Error:
        return []


def local_cluster_went_down(processes: list, wait_s: float = 2.0) -> bool:
    """Whether the local Ray cluster this driver started (`processes`: `cluster_processes()`
    taken before) went down with the SIGTERM that stopped the driver: sent to the driver's
    whole process group or control group (`timeout`, systemd, Slurm's scancel, `kill --
    -PGID`), it reaches the cluster's processes too. Some exit at once (the dashboard, the log
    monitor); the GCS server stops serving but lingers, and the driver's next call to Ray
    waits 60 s, then the process dies. (SIGINT, Ctrl-C in a terminal, never does: Ray's
    processes block it.) True when one of `processes` exits within `wait_s` of the signal."""
    import psutil

    deadline = time.monotonic() + wait_s
    while True:
        for p in processes:
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    return True
            except psutil.NoSuchProcess:
                return True
            except psutil.Error:
                continue
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)  # the raylet's end follows soon, and with it the core worker's exit


class SignalWatch:
    """Once started (in the main thread, on a local cluster) until closed: a thread that wakes the moment
    a SIGTERM arrives (`signal.set_wakeup_fd`: the C-level handler writes to a pipe), whatever
    the main thread is blocked in. When the signal went to the driver's whole group or control
    group, the local cluster's processes got it too, and the driver's core worker may end the
    process (exit 1, nothing said) as soon as its raylet is gone, before the main thread runs
    any Python: so `on_stop(signal)` runs at once (the driver writes a "stopped" summary from
    the run folder, which the ordinary stop path replaces with the RunLog's), and if the cluster
    went down (`local_cluster_went_down`), `on_down(signal, what on_stop returned)`, which
    does not return."""

    def __init__(self, processes: list, on_stop: Callable[[str], str],
                 on_down: Callable[[str, str], None]) -> None:
        self.processes, self.on_stop, self.on_down = processes, on_stop, on_down
        self._pipe: tuple[int, int] | None = None
        self._previous = -1
        self._thread: threading.Thread | None = None

    def start(self) -> SignalWatch:
        import os
        import signal

        if not self.processes or threading.current_thread() is not threading.main_thread():
            return self
        read, write = os.pipe()
        os.set_blocking(write, False)
        self._previous = signal.set_wakeup_fd(write)
        self._pipe = (read, write)
        self._thread = threading.Thread(target=self._run, name="signal-watch", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        import os
        import signal

        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._previous)
        os.close(self._pipe[1])  # the thread's read returns b"": it ends
        self._thread.join(timeout=5)
        os.close(self._pipe[0])
        self._pipe = None

    def _run(self) -> None:
        import os
        import signal

        while True:
            data = os.read(self._pipe[0], 64)
            if not data:
                return
            if signal.SIGTERM in data:
                written = self.on_stop("SIGTERM")
                if local_cluster_went_down(self.processes):
                    self.on_down("SIGTERM", written)
                return


class StopSignals:
    """While entered (in the main thread): SIGINT and SIGTERM raise RunStopped in the main
    thread while `armed`, so the driver ends the run itself: summary.json says "stopped" and what
    the run holds is released. Once disarmed (the fit is over) a signal is only noted
    (`received`): the summary and the release are not cut short. A third signal exits at once,
    as Ray's own SIGINT handler does. Elsewhere (not the main thread) it does nothing."""

    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self) -> None:
        self.armed = True
        self.received: list[str] = []
        self._saved: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        import signal

        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                number = getattr(signal, name)
                self._saved[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        import signal

        for number, handler in self._saved.items():
            # None: a handler installed outside Python (Ray's core): the default comes back
            signal.signal(number, signal.SIG_DFL if handler is None else handler)

    def disarm(self) -> None:
        self.armed = False

    def _handle(self, number: int, frame) -> None:
        import signal

        name = signal.Signals(number).name
        self.received.append(name)
        if len(self.received) >= 3:
            sys.exit(128 + number)
        if self.armed and len(self.received) == 1:
            self.armed = False
            raise RunStopped(name)
