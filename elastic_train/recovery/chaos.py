"""Faults from outside, on a schedule: SIGKILL a run's training worker processes, as a flaky node
does (tests/test_inplace_chaos.py, benchmarks/recovery.py --goodput).

The processes are found in the run folder's `events.jsonl`: every worker logs `worker_started`
(rank, pid, the process's start time) as its train function starts, before it builds, restores or
heals, so a replacement can be killed while it still starts. A pid is killed only while it is
still the process that logged it (its start time), never a pid reused since. "youngest": the
most recently started live worker; after the first kill that is the replacement, which is what a
crash-looping node does. If the replacement of the last one killed has not started yet when a
kill is due, the schedule waits for it and kills it as soon as it has (a death while starting).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

STARTED = ("worker_started", "start")  # events a worker logs with its pid as it starts


@dataclass
class Kill:
    time: float  # time.time() of the SIGKILL
    pid: int
    rank: int
    age_s: float  # how long the process had lived


@dataclass
class FaultSchedule:
    """Kill the youngest live worker of the run in `run_dir` every `every_s` seconds, counted
    from its first committed step (metrics.jsonl), for `for_s` seconds (None: until stopped).
    `run()` is a thread's body; `stop()` ends it."""

    run_dir: Path
    every_s: float
    for_s: float | None = None
    poll_s: float = 0.1
    kills: list[Kill] = field(default_factory=list)
    _workers: dict[int, tuple[int, float]] = field(default_factory=dict)  # pid: (rank, start)
    _offset: int = 0
    _done: threading.Event = field(default_factory=threading.Event)

    def stop(self) -> None:
        self._done.set()

    def run(self) -> None:
        metrics = Path(self.run_dir) / "metrics.jsonl"
        while not metrics.is_file() or not metrics.stat().st_size:
            if self._done.wait(self.poll_s):
                return
        began = time.time()
        next_kill = began + self.every_s
        while not self._done.wait(self.poll_s):
            now = time.time()
            if self.for_s is not None and now - began > self.for_s:
                return
            if now < next_kill:
                continue
            victim = self._youngest()
            if victim is None:
                continue  # the last one's replacement has not started yet: wait for it
            pid, rank, start = victim
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            self.kills.append(Kill(time.time(), pid, rank, time.time() - start))
            next_kill = time.time() + self.every_s

    def _youngest(self) -> tuple[int, int, float] | None:
        """(pid, rank, start) of the most recently started live worker, once the last one
        killed has a replacement (None before)."""
        self._read_events()
        alive = []
        for pid, (rank, start) in self._workers.items():
            try:
                if abs(psutil.Process(pid).create_time() - start) < 0.01:
                    alive.append((start, pid, rank))
            except psutil.NoSuchProcess:
                continue
        if self.kills:
            last = self.kills[-1]
            if not any(rank == last.rank and start > last.time - 1 for start, _, rank in alive):
                return None
        if not alive:
            return None
        start, pid, rank = max(alive)
        return pid, rank, start

    def _read_events(self) -> None:
        path = Path(self.run_dir) / "events.jsonl"
        if not path.is_file():
            return
        with open(path, "rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1  # a line still being written is read next time
        self._offset += end
        for line in chunk[:end].splitlines():
            event = json.loads(line)
            if event.get("event") in STARTED and isinstance(event.get("pid"), int) \
                    and event["pid"] not in self._workers:
                try:
                    start = event.get("process_start") or psutil.Process(event["pid"]).create_time()
                except psutil.NoSuchProcess:
                    continue
                self._workers[event["pid"]] = (event.get("rank", -1), start)


def draw_fault_schedule(seed: int, steps: int, kinds: tuple[str, ...], world_size: int,
                        faults: int = 3, every_steps: int = 4) -> list[str]:
    """A seeded draw of `faults` faults for `fault.schedule` in a run of `steps` steps: kinds from
    `kinds`, ranks below `world_size`, steps at least two checkpoints apart (so each recovery
    resumes from a checkpoint written after the one before) and clear of the run's first and
    last checkpoint intervals. The same seed gives the same schedule."""
    import numpy as np

    rng = np.random.default_rng([seed, 0xFA17])
    gap = 2 * every_steps
    room = steps - 2 * every_steps - gap * (faults - 1)
    if room < 1:
        raise ValueError(f"{faults} faults {gap} steps apart do not fit in a run of {steps} steps")
    offsets = np.sort(rng.choice(room, size=faults, replace=faults > room))
    at = [every_steps + 1 + int(o) + gap * i for i, o in enumerate(offsets)]
    return [f"{s}:{kinds[int(rng.integers(len(kinds)))]}:{int(rng.integers(world_size))}" for s in at]
