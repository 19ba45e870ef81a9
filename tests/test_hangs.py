"""Hangs and stragglers on a real local Ray cluster: a rank stuck in a live process, a frozen
worker (SIGSTOP), a rank slowed on purpose. Each hang fails its attempt within
scaling.collective_timeout_s plus a margin, and the run ends as one never interrupted does."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import PROCESS_GROUP_SHUTDOWN_S
from test_train_ray import assert_same_training, metrics, run

from elastic_train.observe.stragglers import STRAGGLER_RATIO

pytestmark = pytest.mark.ray

TIMEOUT_S = 20  # scaling.collective_timeout_s of the hung runs: small, yet far above a tiny step
# Ray's own shutdown of a failed group with a frozen worker in it: it waits for every worker to
# leave the process group (TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S: 30 s by default, the shared
# cluster's PROCESS_GROUP_SHUTDOWN_S), then 5 s more, then kills
RAY_SHUTDOWN_S = PROCESS_GROUP_SHUTDOWN_S + 5
MARGIN_S = 30  # from the timeout to the decision to restart: a few seconds, more under load
RESTART_S = 150  # starting the next worker group: ~15 s idle, up to 120 s seen on a loaded 2 cores
SLOW_TEST_S = 1200  # the reference run, a hung attempt and a restart: each minutes when loaded
LONG = ["train.max_steps=24", "scaling.max_failures=1"]
SLOWED = ["fault.slow_rank=1", "fault.slow_step_s=0.5"]


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def first_step_begin(result, attempt: int) -> float:
    """When `attempt` began its first step (wall time)."""
    rec = min((r for r in metrics(result) if r["attempt"] == attempt), key=lambda r: r["step"])
    return rec["time"] - rec["step_time_s"]


@pytest.fixture(scope="module")
def reference(ray_cluster, small_dataset, tmp_path_factory):
    """2 workers, never interrupted (the epoch ends before max_steps, at step 22); rank 1 sleeps
    0.5 s in every step (a straggler: it changes when steps end, not what they compute)."""
    return run(tmp_path_factory.mktemp("ref"), small_dataset, "ref", *LONG, *SLOWED)


class Freezer:
    """Watches a running fit's files: SIGSTOPs rank 1 of `attempt` once that attempt logged
    `step`, then watches that process until Ray ends it."""

    def __init__(self, run_dir: Path, step: int, reclaim_after_s: float | None = None,
                 attempt: int = 0) -> None:
        self.run_dir, self.step, self.attempt = run_dir, step, attempt
        # as a cloud reclaims a dead machine: SIGKILL the frozen process if Ray has not ended it
        # this long after the freeze
        self.reclaim_after_s = reclaim_after_s
        self.reclaimed = False
        self.process: psutil.Process | None = None
        self.stopped_at: float | None = None
        self.ended_at: float | None = None  # when the frozen process was gone
        self.done = threading.Event()

    def watch(self) -> None:
        self._freeze()
        while self.process is not None and not self.done.wait(0.1):
            if not self._alive():
                self.ended_at = time.time()
                return
            if self.reclaim_after_s is not None and time.time() - self.stopped_at > self.reclaim_after_s:
                self.reclaimed = True
                self.process.kill()

    def _alive(self) -> bool:
        try:
            return self.process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:  # gone (psutil also checks that the pid was not reused)
            return False

    def _freeze(self) -> None:
        while not self.done.wait(0.1):
            start = [e for e in events(self.run_dir) if e["event"] == "start"
                     and e["attempt"] == self.attempt and e["rank"] == 1]
            path = self.run_dir / "metrics.jsonl"
            records = [json.loads(line) for line in path.read_text().splitlines()
                       if line.endswith("}")] if path.is_file() else []
            steps = [r["step"] for r in records if r["attempt"] == self.attempt]
            if start and steps and max(steps) >= self.step:
                self.process = psutil.Process(start[0]["pid"])
                self.stopped_at = time.time()
                self.process.send_signal(signal.SIGSTOP)
                return

    def release(self) -> bool:
        """Stop watching; True if the frozen process was still there (then it is killed)."""
        self.done.set()
        if self.process is None or not self._alive():
            return False
        self.process.send_signal(signal.SIGCONT)
        self.process.kill()
        return True


@pytest.mark.timeout(SLOW_TEST_S)
def test_a_stuck_rank_then_a_frozen_worker_each_fail_their_attempt_within_the_timeout(
        reference, small_dataset, tmp_path):
    """Two hangs in one run, the second in the attempt that recovered from the first.

    Attempt 0: rank 1 stuck at the end of step 8, a checkpoint step, in a live process that
    answers Ray's health checks. Two deadlines of the same length race: rank 0 waits for it in the
    all-gather of the data cursors before the checkpoint (the collective timeout), and rank 1's
    step watchdog ends its own process (the timeout plus two median steps); whichever fires first
    fails the attempt and Ray restarts the group. (Stuck at another step, rank 0's next all-reduce
    times out the same way.)

    Attempt 1: rank 1 SIGSTOPped once the attempt logged step 14 (a slowed rank 1 gives the test
    time): a frozen process answers nothing, so Ray's health check (the same timeout) ends the
    attempt, and Ray's shutdown of the group must not leave the frozen process behind."""
    freezer = Freezer(tmp_path / "hangs", step=14, attempt=1)
    watcher = threading.Thread(target=freezer.watch, daemon=True)
    watcher.start()
    try:
        result = run(tmp_path, small_dataset, "hangs", *LONG, "scaling.max_failures=2",
                     f"scaling.collective_timeout_s={TIMEOUT_S}", "fault.hang_at_step=8",
                     "fault.hang_rank=1", "fault.slow_rank=1", "fault.slow_step_s=0.3")
    finally:
        leaked = freezer.release()
        watcher.join()
    s = result.summary
    assert s["status"] == "finished" and s["restarts"] == 2 and s["world_sizes"] == [2, 2, 2]
    # the stuck rank
    found = events(Path(result.run_dir))
    hang = next(e for e in found if e["event"] == "hang_injected")
    assert (hang["rank"], hang["step"]) == (1, 8)
    # the watchdog said so well before any deadline
    slow = [e for e in found if e["event"] == "slow_step" and (e["rank"], e["step"]) == (1, 8)]
    assert len(slow) == 1 and slow[0]["time"] < hang["time"] + TIMEOUT_S
    stuck_s = first_step_begin(result, 1) - hang["time"]
    timeouts = [e for e in found if e["event"] == "step_timeout"  # attempt 0's
                and e["time"] < first_step_begin(result, 1)]
    if timeouts:  # the watchdog's deadline came first (else rank 0's collective timed out)
        assert (timeouts[0]["rank"], timeouts[0]["step"], timeouts[0]["pid"]) == (1, 8, hang["pid"])
        assert TIMEOUT_S <= timeouts[0]["elapsed_s"] < TIMEOUT_S + 5
        assert timeouts[0]["time"] - hang["time"] < TIMEOUT_S + MARGIN_S
    # the frozen worker
    assert freezer.stopped_at is not None, "the run ended before the test could freeze rank 1"
    assert freezer.stopped_at > first_step_begin(result, 1)
    assert not leaked, "Ray left the frozen worker process behind"
    ended_s = freezer.ended_at - freezer.stopped_at
    frozen_s = first_step_begin(result, 2) - freezer.stopped_at
    print(f"\nhang at step 8: {'step_timeout' if timeouts else 'collective timeout'}, next "
          f"attempt's first step after {stuck_s:.1f} s; SIGSTOP of rank 1 in attempt 1: the "
          f"frozen process ended after {ended_s:.1f} s, the next attempt's first step after "
          f"{frozen_s:.1f} s (collective_timeout_s={TIMEOUT_S}; 455 s before)")
    assert stuck_s < TIMEOUT_S + MARGIN_S + RESTART_S
    assert ended_s < TIMEOUT_S + MARGIN_S + RAY_SHUTDOWN_S
    assert frozen_s < TIMEOUT_S + MARGIN_S + RAY_SHUTDOWN_S + RESTART_S
    assert_same_training(result, reference)


def test_a_slowed_rank_is_named_the_slowest(reference):
    """Rank 1 of the reference run sleeps 0.5 s in every step, far more than a tiny step's work
    even on a busy machine."""
    result = reference
    s = result.summary
    assert s["slowest_rank"] == 1 and s["slowest_ratio"] > STRAGGLER_RATIO, s["per_rank"]
    ranks = {r["rank"]: r for r in s["per_rank"]}
    assert ranks[1]["busy"]["p50_s"] >= 0.5 and ranks[1]["steps"] == s["steps"] - 1  # none on the first
    assert s["slowest_node"] == ranks[1]["node"] is not None
    rec = metrics(result)[-1]
    assert len(rec["rank_busy_s"]) == len(rec["rank_data_wait_s"]) == 2
