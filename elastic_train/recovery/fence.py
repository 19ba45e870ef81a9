"""Fencing in place (`fault.recovery=in_place`): end the process of a replica that no step has seen.

A replica whose process cannot run at all (SIGSTOP, a machine stalled in swap) misses every step
from then on, and its own step watchdog cannot end it. Ray's health check should: it declares the
worker dead after scaling.collective_timeout_s and kills it, and only then places the replacement
in the slot it held. Ray 2.60 did not, once in three tries here: the frozen process lived on, held
its slot, and Ray's controller waited for that slot forever, so the run could never end (its final
report waits for every worker). So the survivors fence it themselves: each step's all-reduce carries
the pid of every participant, and a replica missing for longer than its own watchdog would have let
it live (plus the time its last event takes to be written) is ended by a task on its node, if the
process there is still the one that went missing (its pid and start time: never a reused pid, never
the replacement). Ray then sees the actor die, as it would any crash.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import psutil


class MissingReplicas:
    """Which replica processes have been missing from the committed steps for `after_s` or more.

    `observe` is called after every committed step with the participants' {world rank: pid};
    `due` returns each (rank, pid, missing seconds) once, when that process's absence reaches
    `after_s`, counted from the first committed step it missed. A rank never seen (a replacement
    not yet joined) is not tracked; a rank seen again (the process came back, or its replacement
    joined) starts over. Thread-safe: `Fencer` asks from its own thread."""

    def __init__(self, after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.after_s, self.clock = after_s, clock
        self.last_pid: dict[int, int] = {}
        self.missing_since: dict[int, float] = {}
        self.fenced: set[tuple[int, int]] = set()
        self.lock = threading.Lock()

    def observe(self, present: dict[int, int]) -> None:
        now = self.clock()
        with self.lock:
            for rank, pid in present.items():
                self.last_pid[rank] = pid
                self.missing_since.pop(rank, None)
            for rank in self.last_pid.keys() - present.keys():
                self.missing_since.setdefault(rank, now)

    def due(self) -> list[tuple[int, int, float]]:
        now = self.clock()
        with self.lock:
            due = [(rank, self.last_pid[rank], now - since) for rank, since in self.missing_since.items()
                   if now - since >= self.after_s and (rank, self.last_pid[rank]) not in self.fenced]
            self.fenced.update((rank, pid) for rank, pid, _ in due)
        return due


class Fencer:
    """`MissingReplicas` asked once a second by a thread, which calls `act(rank, pid, missing_s)`
    for what is due while this replica is the one to act (the quorum's first participant): the
    survivors may be waiting rather than stepping when it comes due (the final checkpoint's report
    waits for every worker, the frozen one too)."""

    def __init__(self, after_s: float, act: Callable[[int, int, float], None], poll_s: float = 1.0) -> None:
        self.missing, self.act, self.poll_s = MissingReplicas(after_s), act, poll_s
        self.acting = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastic-train-fence", daemon=True)
        self._thread.start()

    def observe(self, present: dict[int, int], acting: bool) -> None:
        self.acting = acting
        self.missing.observe(present)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            for rank, pid, missing_s in self.missing.due():
                if self.acting:  # every replica counts, one acts
                    self.act(rank, pid, missing_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def end_process(pid: int, process_start: float) -> str:
    """SIGKILL the process `pid` of this node if it started at `process_start` (psutil's
    create_time); what was done, in words."""
    try:
        process = psutil.Process(pid)
        if abs(process.create_time() - process_start) > 0.01:
            return "gone (its pid is another process's now)"
        os.kill(pid, signal.SIGKILL)  # also ends a stopped process
    except (psutil.NoSuchProcess, ProcessLookupError):
        return "gone"
    return "killed"


