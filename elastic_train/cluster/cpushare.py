"""On a local cluster, training first for CPU: Ray's daemons and helper actors yield to it.

Ray starts its daemons (GCS, raylet, dashboard, agents, log monitor) at nice 0 and every worker
process at nice 15 (`RAY_worker_niceness`), training workers and Ray's helper actors alike
(TrainController, PreemptionWatcher, PlacementGroupCleaner, our RunLog, ...). On a machine whose
cores the training processes fill, the daemons therefore win every contest for a core, and the
helpers tie with training. Raising every worker's priority (`RAY_worker_niceness=0`) measured
worse here: the helpers gained as much as training did (BENCHMARKS.md).

`TrainFirst` is a driver thread for a cluster this process started (`run.address` unset): every
`interval_s` it sets Ray's daemons (its own programs: GCS, dashboard, monitors) and Ray Train's
helper actors (and ours, the RunLog) to `HELPER_NICE`, and lifts training workers to nice 0 where
the user may (root, CAP_SYS_NICE; otherwise they stay at Ray's 15, still ahead of the helpers).
Linux keeps a nice value per thread, and `setpriority` on a process id changes only its main
thread: every thread is set, the ones a process started before the sweep too (Ray's daemons run
tens of them; a training worker's training and gloo threads start beside its main thread).
Everything else keeps its niceness: the raylet (the parent of every worker process, which inherit
the niceness of the thread that starts them: at 19 it would start training workers at 19),
idle pool workers (which may become training workers), Ray Data's tasks (they feed training with
`data.reader=ray_data`), a user's own processes. Processes are told apart by their command lines
(Ray's process titles, such as `ray::RayTrainWorker.run`, and the paths of Ray's programs); a Ray
that renames them makes this a no-op, never a failure. Never on a cluster the run joined: its
other jobs' processes are not ours to reprioritise.
"""

from __future__ import annotations

import logging
import os
import threading

import psutil
import ray

logger = logging.getLogger("elastic_train")

HELPER_NICE = 19  # the lowest priority: a helper runs when a core would otherwise idle
TRAINING_NICE = 0  # where permitted; else Ray's worker niceness (15) stays
TRAINING_TITLE = "RayTrainWorker"
# the actors of Ray Train 2.60 and Ray's node agents (ray::<class>.<method> while one runs), and ours
HELPER_TITLES = tuple(f"ray::{name}" for name in (
    "TrainController", "PreemptionWatcher", "PlacementGroupCleaner", "SynchronizationActor",
    "TrainStateActor", "DatasetManager", "_AutoscalingCoordinatorActor", "DashboardAgent",
    "RuntimeEnvAgent", "RunLog"))
RAY_DIR = os.path.dirname(ray.__file__)  # Ray's daemons run programs from its package
RAYLET = os.path.join(RAY_DIR, "core", "src", "ray", "raylet", "raylet")


def is_helper(cmdline: list[str]) -> bool:
    """Ray's daemons and helper actors: not training, not data, not idle, not the user's, not the
    raylet (whose niceness the worker processes it starts inherit)."""
    args = " ".join(cmdline).split()[:3]  # a process title is one argument with spaces
    if not args or args[0] == RAYLET:
        return False
    if args[0].startswith(HELPER_TITLES):
        return True
    # gcs_server; python [-u] .../log_monitor.py, .../autoscaler/_private/monitor.py, dashboard.py
    return any(arg.startswith(RAY_DIR) for arg in args)


def set_nice(proc: psutil.Process, nice: int) -> bool:
    """Every thread of `proc` at `nice`; True if one changed. PermissionError where lowering a
    niceness is not permitted."""
    changed = False
    for tid in map(int, os.listdir(f"/proc/{proc.pid}/task")):  # psutil's threads() reads each stat
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) != nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                changed = True
        except ProcessLookupError:
            pass  # a thread that ended between the listing and the call
    return changed


class TrainFirst:
    """See the module docstring; `sweep()` is one pass, `start()`/`stop()` the thread."""

    def __init__(self, root_pid: int | None = None, interval_s: float = 2.0) -> None:
        self.root = psutil.Process(root_pid or os.getpid())
        self.interval_s = interval_s
        self.can_raise = True  # False after the first refusal to lift a training worker
        self._seen: dict[str, set[int]] = {"helpers": set(), "training": set()}  # pids changed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="train-first")

    @property
    def changed(self) -> dict[str, int]:
        """Processes reprioritised over all sweeps, each counted once (a thread a process starts
        during a sweep may need the next one too)."""
        return {kind: len(pids) for kind, pids in self._seen.items()}

    def start(self) -> TrainFirst:
        self.sweep()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sweep()

    def sweep(self) -> dict[str, int]:
        """One pass over the cluster's processes; how many of each kind were changed."""
        changed = {"helpers": 0, "training": 0}
        try:
            procs = self.root.children(recursive=True)
        except psutil.Error:
            return changed
        for proc in procs:
            try:
                cmdline = proc.cmdline()
                kind = None
                if cmdline and cmdline[0].startswith(f"ray::{TRAINING_TITLE}"):
                    if self.can_raise and self._lift(proc):
                        kind = "training"
                elif is_helper(cmdline) and set_nice(proc, HELPER_NICE):
                    kind = "helpers"
                if kind is not None:
                    changed[kind] += 1
                    self._seen[kind].add(proc.pid)
            except (psutil.Error, ProcessLookupError, FileNotFoundError):
                pass  # a process that ended between the listing and the call
        return changed

    def _lift(self, proc: psutil.Process) -> bool:
        try:
            return set_nice(proc, TRAINING_NICE)
        except PermissionError:
            self.can_raise = False  # not permitted here: training stays at Ray's niceness
            return False
