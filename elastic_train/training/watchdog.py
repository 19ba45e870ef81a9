"""The step watchdog: a thread on every worker that watches the step in progress.

A rank whose step runs far longer than the recent ones (`scaling.slow_step_factor` x their median)
is reported once per step; a step that runs past `scaling.collective_timeout_s` ends the process,
so that Ray restarts the group from the last checkpoint. Killing the process is the one remedy that
always works: a rank stuck in a live process (a wedged kernel, a deadlocked data thread, a blocked
gloo or NCCL call that may never return) cannot be made to raise from another thread.

The decision (`StepWatchdog.check`) is a plain function of the clock, so it is tested without
threads; `start` runs it every `POLL_S` on a daemon thread and hands each verdict to `act`.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

POLL_S = 0.5  # how often the thread looks: the resolution of both the report and the timeout
WINDOW_STEPS = 20  # the recent steps whose median is "normal"
# The timeout counts this many median steps more than the collectives' own, so that a rank
# waiting in a collective (which began up to about one normal step after its step did) sees that
# collective time out first: gloo then raises an error naming it, and NCCL dumps its flight recorder.
COLLECTIVES_FIRST_STEPS = 2.0


@dataclass(frozen=True)
class Verdict:
    """What the watchdog decided about the step in progress."""

    kind: str  # "slow": report it; "timeout": end the process
    step: int
    elapsed_s: float
    median_s: float  # of the recent steps


class StepWatchdog:
    """Call `begin_step` when a step starts and `end_step` when it is done."""

    def __init__(self, timeout_s: float, slow_factor: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s, self.slow_factor, self.clock = timeout_s, slow_factor, clock
        self._recent: deque[float] = deque(maxlen=WINDOW_STEPS)
        self._step: int | None = None  # the step in progress (None between steps)
        self._began = 0.0
        self._reported: int | None = None  # the step already reported slow
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def begin_step(self, step: int) -> None:
        with self._lock:
            self._step, self._began = step, self.clock()

    def end_step(self, step_time_s: float | None) -> None:
        """The step is done; `step_time_s` joins the recent ones (None: an iteration that trained
        nothing, e.g. the one that finds the epoch over, is no measure of a step)."""
        with self._lock:
            self._step = None
            if step_time_s is not None:
                self._recent.append(step_time_s)

    def check(self) -> Verdict | None:
        """The verdict on the step in progress now, or None (a slow step is reported once).

        A process's first step is left alone: it may compile the model or warm up for minutes,
        and it has no median to compare with. Its collectives still time out."""
        with self._lock:
            if self._step is None or not self._recent:
                return None
            elapsed = self.clock() - self._began
            median = statistics.median(self._recent)
            if elapsed > self.timeout_s + COLLECTIVES_FIRST_STEPS * median:
                return Verdict("timeout", self._step, elapsed, median)
            if elapsed > self.slow_factor * median and self._reported != self._step:
                self._reported = self._step
                return Verdict("slow", self._step, elapsed, median)
            return None

    def start(self, act: Callable[[Verdict], None]) -> StepWatchdog:
        """Check every POLL_S on a daemon thread (it never keeps the process alive)."""
        def run() -> None:
            while not self._stop.wait(POLL_S):
                verdict = self.check()
                if verdict is not None:
                    act(verdict)

        threading.Thread(target=run, name="step-watchdog", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
