"""run.train_first: a local cluster's helpers yield the CPU to the training processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from elastic_train.cluster.cpushare import HELPER_NICE, RAY_DIR, RAYLET, TRAINING_NICE, TrainFirst

pytestmark = pytest.mark.unit

# A stand-in for the driver of a local cluster: it starts children whose command lines carry Ray's
# process titles, at Ray's niceness (daemons 0, workers 15), each with a second thread started
# before its title (as Ray's processes start theirs), prints their pids, and waits.
PARENT = """
import json, os, subprocess, sys
ray_dir, raylet = sys.argv[1:3]
titles = {"ray::TrainController.run": 15, "ray::IDLE": 15, "ray::RayTrainWorker": 15,
          "ray::ReadParquet": 15, "python my_script.py": 0,
          ray_dir + "/core/src/ray/gcs/gcs_server --log_dir=/tmp": 0,
          raylet + " --raylet_socket_name=/tmp/raylet": 0,
          sys.executable + " -u " + ray_dir + "/_private/log_monitor.py --logs-dir=/tmp": 0}
code = ("import sys, threading, ray._raylet; threading.Thread(target=threading.Event().wait, "
        "daemon=True).start(); ray._raylet.setproctitle(sys.argv[1]); sys.stdin.read()")
def at(n):  # Ray's niceness where this process may set it (under a niced pytest, maybe not)
    return lambda: os.setpriority(os.PRIO_PROCESS, 0, n) if os.geteuid() == 0 else os.nice(n)
kids = {t: subprocess.Popen([sys.executable, "-c", code, t], stdin=subprocess.PIPE,
                            preexec_fn=at(n)).pid for t, n in titles.items()}
print(json.dumps(kids), flush=True)
sys.stdin.read()
for pid in kids.values():
    os.kill(pid, 9)
"""


def _titled(pids: dict[str, int]) -> None:
    """Until every child shows its title (it sets it after importing Ray)."""
    deadline = time.monotonic() + 60
    while not all(" ".join(psutil.Process(pid).cmdline()).startswith(title)
                  for title, pid in pids.items()):
        assert time.monotonic() < deadline, {t: psutil.Process(p).cmdline() for t, p in pids.items()}
        time.sleep(0.05)


def thread_nices(pid: int) -> list[int]:
    """The niceness of each of the process's threads (Linux keeps one per thread)."""
    return sorted(os.getpriority(os.PRIO_PROCESS, t.id) for t in psutil.Process(pid).threads())


def test_helpers_yield_idle_workers_wait_training_goes_first_where_permitted():
    parent = subprocess.Popen([sys.executable, "-c", PARENT, RAY_DIR, RAYLET], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(parent.stdout.readline())
        _titled(pids)
        before = {t: psutil.Process(pid).nice() for t, pid in pids.items()}
        assert all(len(set(thread_nices(pid))) == 1 and len(thread_nices(pid)) >= 2
                   for pid in pids.values())
        keeper = TrainFirst(root_pid=parent.pid)
        first = keeper.sweep()
        nice = {t: thread_nices(pid) for t, pid in pids.items()}  # every thread, not just the main
        gcs = next(t for t in pids if t.startswith(RAY_DIR))
        monitor = next(t for t in pids if "log_monitor.py" in t)
        helpers = ("ray::TrainController.run", gcs, monitor)
        assert all(set(nice[t]) == {HELPER_NICE} for t in helpers), nice
        # left as they were: the raylet (the workers it starts inherit its niceness), an idle
        # worker may become a training worker, Ray Data's tasks feed training, a user's processes
        # are not ours
        raylet = next(t for t in pids if t.startswith(RAYLET))
        for title in (raylet, "ray::IDLE", "ray::ReadParquet", "python my_script.py"):
            assert set(nice[title]) == {before[title]}, title
        lifted = os.geteuid() == 0  # lowering a niceness needs privilege
        assert keeper.can_raise == lifted
        training = TRAINING_NICE if lifted else before["ray::RayTrainWorker"]
        assert set(nice["ray::RayTrainWorker"]) == {training}
        assert first == {"helpers": sum(before[t] < HELPER_NICE for t in helpers),
                         "training": int(lifted and before["ray::RayTrainWorker"] > TRAINING_NICE)}
        assert keeper.sweep() == {"helpers": 0, "training": 0}  # settled: nothing to change
        assert keeper.changed == first
    finally:
        parent.communicate("", timeout=30)
