"""run.train_first: a local cluster's helpers yield the CPU to the training processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest

from elastic_train.cpushare import HELPER_NICE, TRAINING_NICE, TrainFirst

pytestmark = pytest.mark.unit

# A stand-in for the driver of a local cluster: it starts children whose command lines carry Ray's
# process titles, at Ray's niceness (daemons 0, workers 15), prints their pids, and waits.
PARENT = """
import json, os, subprocess, sys
titles = {"ray::TrainController.run": 15, "ray::IDLE": 15, "ray::RayTrainWorker._run_train_fn": 15,
          "gcs_server": 0}
kids = {t: subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", t],
                            stdin=subprocess.PIPE, preexec_fn=lambda n=n: os.nice(n)).pid
        for t, n in titles.items()}
print(json.dumps(kids), flush=True)
sys.stdin.read()
for pid in kids.values():
    os.kill(pid, 9)
"""


def test_helpers_yield_idle_workers_wait_training_goes_first_where_permitted():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(parent.stdout.readline())
        keeper = TrainFirst(root_pid=parent.pid)
        first = keeper.sweep()
        nice = {t: psutil.Process(pid).nice() for t, pid in pids.items()}
        assert nice["ray::TrainController.run"] == nice["gcs_server"] == HELPER_NICE
        assert nice["ray::IDLE"] == 15  # may become a training worker: left as Ray set it
        lifted = os.geteuid() == 0  # lowering a niceness needs privilege
        assert nice["ray::RayTrainWorker._run_train_fn"] == (TRAINING_NICE if lifted else 15)
        assert keeper.can_raise == lifted
        assert first == {"helpers": 2, "training": int(lifted)}
        assert keeper.sweep() == {"helpers": 0, "training": 0}  # settled: nothing to change
        assert keeper.changed == first
    finally:
        parent.communicate("", timeout=30)
