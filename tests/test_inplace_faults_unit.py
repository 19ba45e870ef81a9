"""The parts of in place under repeated faults that need no Ray (issue 32): checkpoints written
outside Ray's report barrier (recovery/checkpoints.py), the fault schedule that kills the youngest
worker (recovery/chaos.py, on real child processes), and the process group's two timeouts (real
gloo between two processes)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pyarrow.fs as pafs
import pytest
import torch

from elastic_train.recovery import checkpoints
from elastic_train.recovery.chaos import FaultSchedule
from elastic_train.training.checkpoint import MANIFEST

pytestmark = pytest.mark.unit


def _snap(step: int) -> dict:
    return {"model": {"w": torch.full((3,), float(step))}, "optimizer": {"state": {}},
            "extra": {"rng": None}, "state": {"train_state": {"step": step}}, "shard": 0, "shards": 1}


def test_a_checkpoint_in_place_is_pointed_to_once_whole_and_the_oldest_are_pruned(tmp_path):
    fs = pafs.LocalFileSystem()
    run = str(tmp_path)
    assert checkpoints.read_pointer(fs, run) is None
    for step in (10, 20, 30):
        checkpoints.write_in_place(_snap(step), fs, run, step, keep=2, protected=lambda: None)
        pointer = checkpoints.read_pointer(fs, run)
        assert (pointer["checkpoint"], pointer["step"]) == (f"checkpoint_{step:09d}", step)
        assert (tmp_path / pointer["checkpoint"] / MANIFEST).is_file()
    assert sorted(p.name for p in tmp_path.glob("checkpoint_*")) == [
        "checkpoint_000000020", "checkpoint_000000030"]
    # Ray's latest is never deleted by the writer's retention
    checkpoints.write_in_place(_snap(40), fs, run, 40, keep=1, protected=lambda: "checkpoint_000000030")
    assert sorted(p.name for p in tmp_path.glob("checkpoint_*")) == [
        "checkpoint_000000030", "checkpoint_000000040"]


def test_a_late_writer_of_an_earlier_step_leaves_the_pointer_and_the_later_checkpoint(tmp_path):
    """A writer that finishes step 20 after another wrote step 30 (it was slowed down, or is no
    longer the quorum's first): the pointer stays on 30, checkpoint 30 is kept (keep=1 would
    have pruned it), and the late folder is removed; its write is not reported committed."""
    fs = pafs.LocalFileSystem()
    run = str(tmp_path)
    checkpoints.write_in_place(_snap(10), fs, run, 10, keep=1, protected=lambda: None)
    assert checkpoints.write_in_place(_snap(30), fs, run, 30, keep=1, protected=lambda: None)
    assert checkpoints.write_in_place(_snap(20), fs, run, 20, keep=1, protected=lambda: None) is None
    pointer = checkpoints.read_pointer(fs, run)
    assert (pointer["checkpoint"], pointer["step"]) == ("checkpoint_000000030", 30)
    assert sorted(p.name for p in tmp_path.glob("checkpoint_*")) == ["checkpoint_000000030"]
    assert (tmp_path / "checkpoint_000000030" / MANIFEST).is_file()
    # the same step again (a writer that died in it, replaced): written and pointed to as before
    assert checkpoints.write_in_place(_snap(30), fs, run, 30, keep=1, protected=lambda: None)
    assert checkpoints.read_pointer(fs, run)["step"] == 30


def test_a_writer_killed_mid_write_leaves_the_pointer_on_the_one_before(tmp_path):
    """The real thing: a child process writes step 20 with crash_midway (it ends itself after
    the first file); the pointer still names step 10, complete."""
    fs = pafs.LocalFileSystem()
    checkpoints.write_in_place(_snap(10), fs, str(tmp_path), 10, keep=2, protected=lambda: None)
    code = ("import sys, torch, pyarrow.fs as pafs\n"
            "from elastic_train.recovery import checkpoints\n"
            "snap = {'model': {'w': torch.ones(3)}, 'optimizer': {'state': {}}, 'extra': {},\n"
            "        'state': {'train_state': {'step': 20}}, 'shard': 0, 'shards': 1}\n"
            "checkpoints.write_in_place(snap, pafs.LocalFileSystem(), sys.argv[1], 20, 2,\n"
            "                           lambda: None, crash_midway=True)\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True)
    assert done.returncode == 1, done.stderr
    assert (tmp_path / "checkpoint_000000020").is_dir()  # half written ...
    assert not (tmp_path / "checkpoint_000000020" / MANIFEST).exists()
    assert checkpoints.read_pointer(fs, str(tmp_path))["step"] == 10  # ... and never pointed to


def test_a_restore_takes_the_newer_of_rays_checkpoint_and_the_pointers():
    pointer = {"checkpoint": "checkpoint_000000030", "step": 30}
    assert checkpoints.newest("checkpoint_000000020", 20, pointer) == ("checkpoint_000000030", 30)
    assert checkpoints.newest("checkpoint_000000030", 30, pointer) == ("checkpoint_000000030", 30)
    assert checkpoints.newest("checkpoint_000000040", 40, pointer) == ("checkpoint_000000040", 40)
    assert checkpoints.newest(None, None, pointer) == ("checkpoint_000000030", 30)
    assert checkpoints.newest(None, None, None) is None


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def _started(run_dir: Path, rank: int, child: subprocess.Popen) -> None:
    record = {"event": "worker_started", "time": time.time(), "rank": rank, "pid": child.pid,
              "process_start": psutil.Process(child.pid).create_time()}
    with open(run_dir / "events.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def test_the_schedule_kills_the_youngest_and_waits_for_its_replacement(tmp_path):
    """Two 'workers' (real processes); the schedule kills the younger, then waits while its
    replacement has not started (it never kills the survivor instead), then kills the
    replacement as soon as it has."""
    old, young = _sleeper(), None
    time.sleep(0.05)  # distinct start times
    young = _sleeper()
    children = [old, young]
    try:
        _started(tmp_path, 0, old)
        _started(tmp_path, 1, young)
        (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
        schedule = FaultSchedule(tmp_path, every_s=0.3, poll_s=0.02)
        thread = threading.Thread(target=schedule.run, daemon=True)
        thread.start()
        assert young.wait(timeout=30) == -9
        assert schedule.kills[0].pid == young.pid and schedule.kills[0].rank == 1
        time.sleep(1.0)  # three periods: no replacement yet, so no kill
        assert len(schedule.kills) == 1 and old.poll() is None
        replacement = _sleeper()
        children.append(replacement)
        _started(tmp_path, 1, replacement)
        assert replacement.wait(timeout=30) == -9
        schedule.stop()
        thread.join()
        assert [k.pid for k in schedule.kills] == [young.pid, replacement.pid]
        assert old.poll() is None  # the oldest, never the youngest, lived on
    finally:
        for child in children:
            child.kill()
            child.wait()


PG_SCRIPT = """
import sys, time
from datetime import timedelta
import torch
from torch.distributed import TCPStore
from torch.distributed.distributed_c10d import AllreduceOptions
from elastic_train.recovery.replica import build_process_group

rank, port, late = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
# both up before the rendezvous (their imports take seconds apart on a loaded machine)
store = TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False,
                 timeout=timedelta(seconds=300))
store.set(f"up{rank}", "1")
store.wait([f"up{1 - rank}"])
pg = build_process_group(torch.device("cpu"), timedelta(seconds=1), timedelta(seconds=20))
if late < 0 and rank == 1:
    try:  # a member of the quorum that never comes to the rendezvous (killed), until rank 0 gave up
        store.wait(["gave_up"])
    except Exception:  # rank 0 (the store's server) has ended
        pass
    sys.exit(0)
t0 = time.monotonic()
try:
    pg.configure(f"127.0.0.1:{port}/q", "r", rank, 2)
except Exception as e:
    print("configure failed", round(time.monotonic() - t0, 2), flush=True)
    store.set("gave_up", "1")
    sys.exit(0)
time.sleep(late if rank == 1 else 0)
t = torch.ones(2)
pg.allreduce([t], AllreduceOptions()).wait()
print("allreduce", t.tolist(), flush=True)
"""


@pytest.mark.parametrize("late", [-1.0, 3.0])
def test_the_rendezvous_waits_on_a_peer_briefly_and_an_all_reduce_on_its_work_long(tmp_path, late):
    """fault.in_place_timeout_s (1 s here) bounds the rendezvous with a quorum member that never
    comes; scaling.collective_timeout_s (20 s) an all-reduce with a peer 3 s late, which
    succeeds (a group made with one timeout for both failed it after 1 s)."""
    script = tmp_path / "pg.py"
    script.write_text(PG_SCRIPT)
    port = 29600 + int(time.time() * 1000) % 300
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port), str(late)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    out = [p.communicate(timeout=120)[0] for p in procs]
    if late < 0:
        words = out[0].split()
        assert words[:2] == ["configure", "failed"], out
        assert float(words[2]) < 10, out  # the 1 s timeout, with start-up noise under load
    else:
        assert out == ["allreduce [2.0, 2.0]\n"] * 2, out
