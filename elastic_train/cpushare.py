"""On a local cluster, training first for CPU: Ray's daemons and helper actors yield to it.

Ray starts its daemons (GCS, raylet, dashboard, agents, log monitor) at nice 0 and every worker
process at nice 15 (`RAY_worker_niceness`), training workers and Ray's helper actors alike
(TrainController, PreemptionWatcher, PlacementGroupCleaner, our RunLog, ...). On a machine whose
cores the training processes fill, the daemons therefore win every contest for a core, and the
helpers tie with training. Raising every worker's priority (`RAY_worker_niceness=0`) measured
worse here: the helpers gained as much as training did (BENCHMARKS.md).

`TrainFirst` is a driver thread for a cluster this process started (`run.address` unset): every
`interval_s` it sets Ray's daemons (its own programs: GCS, raylet, dashboard, monitors) and Ray
Train's helper actors (and ours, the RunLog) to `HELPER_NICE`, and lifts training workers to nice 0
where the user may (root, CAP_SYS_NICE; otherwise they stay at Ray's 15, still ahead of the
helpers). Everything else keeps its niceness: idle pool workers (which may become training
workers), Ray Data's tasks (they feed training with `data.reader=ray_data`), a user's own
processes. Processes are told apart by their command lines (Ray's process titles, such as
`ray::RayTrainWorker.run`, and the paths of Ray's programs); a Ray that renames them makes this a
no-op, never a failure. Never on a cluster the run joined: its other jobs' processes are not ours
to reprioritise.
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


def is_helper(cmdline: list[str]) -> bool:
    """Ray's daemons and helper actors: not training, not data, not idle, not the user's."""
    if not cmdline:
        return False
    if cmdline[0].startswith(HELPER_TITLES):
        return True
    return any(arg.startswith(RAY_DIR) for arg in cmdline[:2])  # gcs_server, raylet, python x.py


class TrainFirst:
    """See the module docstring; `sweep()` is one pass, `start()`/`stop()` the thread."""

    def __init__(self, root_pid: int | None = None, interval_s: float = 2.0) -> None:
        self.root = psutil.Process(root_pid or os.getpid())
        self.interval_s = interval_s
        self.can_raise = True  # False after the first refusal to lift a training worker
        self.changed = {"helpers": 0, "training": 0}  # processes reprioritised, all sweeps
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="train-first")

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
            cmdline: list[str] = []
            try:
                cmdline = proc.cmdline()
                nice = proc.nice()
                if cmdline and cmdline[0].startswith(f"ray::{TRAINING_TITLE}"):
                    if self.can_raise and nice > TRAINING_NICE:
                        proc.nice(TRAINING_NICE)
                        changed["training"] += 1
                elif is_helper(cmdline) and nice < HELPER_NICE:
                    proc.nice(HELPER_NICE)
                    changed["helpers"] += 1
            except psutil.AccessDenied:
                if cmdline and TRAINING_TITLE in cmdline[0]:
                    self.can_raise = False  # not permitted here: training stays at Ray's niceness
            except psutil.Error:
                pass  # a process that ended between the listing and the call
        for kind, n in changed.items():
            self.changed[kind] += n
        return changed
