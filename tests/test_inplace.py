"""In-place recovery (`fault.recovery=in_place`, torchft) on a real local Ray cluster: a run trains
every sample once per epoch at two workers; a replacement that starts after the last step joins the
final report; a frozen worker is left behind and fenced; and the run is the same to the bit as one
never interrupted. A worker that dies while the survivor trains on alone and Ray's replacement
heals from it (and the last replica lost, the checkpoint restored at once) is in
tests/test_repeated_faults.py's seeded in-place schedule."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
from test_hangs import MARGIN_S, SLOW_TEST_S, Freezer
from test_train_ray import assert_same_training, effective_ids, metrics, read_events, run

pytest.importorskip("torchft")
pytestmark = pytest.mark.ray

IN_PLACE = ["fault.recovery=in_place", "train.epochs=2", "train.max_steps=1000",
            "eval.fraction=0.1", "eval.every_steps=10"]


def steps(result) -> list[dict]:
    """The step records of metrics.jsonl (not the evaluations'), by step."""
    return sorted((r for r in metrics(result) if "eval_loss" not in r), key=lambda r: r["step"])


TIMEOUT_S = 15  # scaling.collective_timeout_s of the frozen run
FENCE_S = 5  # its fault.fence_after_s


@pytest.fixture(scope="module")
def reference(ray_cluster, held_out_dataset, tmp_path_factory):
    """2 workers in place, 2 epochs, never interrupted."""
    return run(tmp_path_factory.mktemp("ref"), held_out_dataset, "ref", *IN_PLACE)


def test_in_place_run_trains_every_id_once_at_two_workers(reference):
    s = reference.summary
    assert s["status"] == "finished" and s["restarts"] == 0 and s["replayed_steps"] == 0
    assert s["grad_reduce_reason"] == "fault.recovery=in_place"
    recs = steps(reference)
    assert {r["world_size"] for r in recs} == {2}
    assert sorted(r["step"] for r in recs) == list(range(1, len(recs) + 1))  # each step once
    assert {r["epoch"] for r in recs} == {0, 1} and s["final_loss"] < 0.8 * s["first_loss"]
    ids = [i for f in (Path(reference.run_dir) / "consumed").glob("*.jsonl")
           for line in f.read_text().splitlines() for i in json.loads(line)["ids"]]
    assert set(Counter(ids).values()) == {2}  # each id once in each of the 2 epochs
    # every replica sends each step's and evaluation's record; the run log keeps one of each
    eval_steps = [r["step"] for r in metrics(reference) if "eval_loss" in r]
    assert len(eval_steps) == len(set(eval_steps)) >= 4, eval_steps
    assert {r["logged_by"] for r in recs} <= {0, 1}


@pytest.mark.timeout(SLOW_TEST_S)
@pytest.mark.parametrize("lost", [1, 0])
def test_a_replacement_that_starts_after_the_last_step_joins_the_final_report(reference, held_out_dataset,
                                                                             tmp_path, lost):
    """Rank 1 dies after the last step (20, a checkpoint step). The survivor writes that step's
    checkpoint, marks the run finished and waits in Ray's final report, a barrier of every worker;
    Ray's replacement of rank 1 finds the run over, restores that very checkpoint and must still
    join the report without a share. Two hangs it guards against: the replacement took the
    restored step for saved and skipped its report (found by killing replacements as they
    started); and Ray's replacement reset the barrier the survivor was waiting in, so that
    `ray.train.report` returned without reporting and the survivor ended, leaving the replacement
    in the barrier for ever (found by this test; worker.save_checkpoint reports again).
    The steps are the uninterrupted run's first 20: the same ids, and to the bit while the
    learning rate is the same (the reference decays towards a later max_steps). Rank 0 lost
    instead: the step's first participant, which writes the periodic checkpoints, so step 20's is
    not written and the replacement restores the one before; the final checkpoint, which it also
    wrote alone, is now the first live replica's to claim (it was not written at all)."""
    last = 20
    result = run(tmp_path, held_out_dataset, "late", *IN_PLACE, f"train.max_steps={last}",
                 f"fault.crash_at_step={last}", f"fault.crash_rank={lost}")
    s = result.summary
    assert s["status"] == "finished" and s["steps"] == last and s["replayed_steps"] == 0, s
    final = json.loads((Path(result.checkpoint_path) / "state.json").read_text())  # written whole
    assert final["train_state"]["step"] == last, final["train_state"]
    events = read_events(result)
    recs = steps(result)
    assert [r["step"] for r in recs] == list(range(1, last + 1))
    late = [e for e in events if e["event"] == "worker_started" and e.get("joining")]
    assert len(late) == 1 and late[0]["time"] > recs[-1]["time"], late
    restored = [e for e in events if e["event"] == "restore" and e.get("pid") == late[0]["pid"]]
    every = 4  # test_train_ray.run's checkpoint.every_steps
    assert restored and restored[0]["checkpoint"].endswith(f"{last - every * (lost == 0):09d}"), restored
    ref = {r["step"]: r for r in steps(reference)}
    same_lr = [r for r in recs if r["lr"] == ref[r["step"]]["lr"]]
    assert len(same_lr) >= last // 2, same_lr
    assert [(r["loss"], r["grad_norm"]) for r in same_lr] == \
        [(ref[r["step"]]["loss"], ref[r["step"]]["grad_norm"]) for r in same_lr]
    ids, ref_ids = effective_ids(result), effective_ids(reference)
    assert [ids[k] for k in sorted(ids)] == [ref_ids[k] for k in sorted(ref_ids)][:last]


@pytest.mark.timeout(SLOW_TEST_S)
def test_a_frozen_worker_is_left_behind_after_the_timeout_and_replaced(reference, held_out_dataset,
                                                                       tmp_path):
    """Rank 1 SIGSTOPped at step 8 or a little later (a slowed rank 1 gives the test time): the
    survivor's all-reduce gives up after scaling.collective_timeout_s, that step is trained again
    alone, and the frozen process, missing from every step for fault.fence_after_s (5 s here, well
    before Ray's health check fails it after the collective timeout), is fenced: the survivor has a
    task on its node end it. Ray sees the actor die, replaces it, and the replacement heals and
    joins (rank 0 waits for it after step 16). The test would reclaim the process itself (as a
    cloud reclaims a dead machine) only if that failed, and then fails. No checkpoint until step
    20: a checkpoint is reported to Ray by every worker (a barrier), which would hold the survivor
    until Ray has replaced the frozen worker (docs/in_place_recovery.md)."""
    freezer = Freezer(tmp_path / "frozen", step=8, reclaim_after_s=FENCE_S + MARGIN_S + 60)
    watcher = threading.Thread(target=freezer.watch, daemon=True)
    watcher.start()
    try:
        result = run(tmp_path, held_out_dataset, "frozen", *IN_PLACE,
                     f"scaling.collective_timeout_s={TIMEOUT_S}",
                     "fault.slow_rank=1", "fault.slow_step_s=0.3", f"fault.fence_after_s={FENCE_S}",
                     "fault.wait_for_replacement_at_step=16", "checkpoint.every_steps=20")
    finally:
        leaked = freezer.release()
        watcher.join()
    assert freezer.stopped_at is not None, "the run ended before the test could freeze rank 1"
    assert not leaked, "Ray left the frozen worker process behind"
    assert not freezer.reclaimed, "the survivor did not fence the frozen worker"
    s = result.summary
    assert s["status"] == "finished" and s["restarts"] == 0 and s["replayed_steps"] == 0
    events = read_events(result)
    fenced = [e for e in events if e["event"] == "fenced"]
    assert len(fenced) == 1 and fenced[0]["outcome"] == "killed", fenced
    assert (fenced[0]["rank"], fenced[0]["pid"]) == (1, freezer.process.pid), fenced
    survivor = {e["pid"] for e in events if e.get("rank") == 0 and "pid" in e}
    assert len(survivor) == 1, survivor
    recs = steps(result)
    assert sorted(r["step"] for r in recs) == list(range(1, len(recs) + 1))  # each step once
    alone = [r for r in recs if r["world_size"] == 1]
    assert alone and max(recs, key=lambda r: r["step"])["world_size"] == 2
    alone = sorted(alone, key=lambda r: r["step"])
    detected_s = alone[0]["time"] - freezer.stopped_at
    replaced_s = freezer.ended_at - freezer.stopped_at
    print(f"\nSIGSTOP of rank 1 (collective_timeout_s={TIMEOUT_S}): the survivor's next committed "
          f"step after {detected_s:.1f} s, the frozen process ended after {replaced_s:.1f} s "
          f"(fenced by the survivor, fault.fence_after_s={FENCE_S})")
    assert detected_s < TIMEOUT_S + MARGIN_S
    # missing from the first step the survivor committed alone, plus the fence's poll and task
    assert replaced_s < detected_s + FENCE_S + MARGIN_S
    assert_same_training(result, reference)


def test_the_run_log_fences_a_registered_process_on_its_node(ray_cluster, tmp_path):
    """RunLog.fence: a stopped child process registered as rank 1's is ended by a task on its
    node, the outcome in the events; a process never registered, or registered on a node that is
    gone, is not touched."""
    import ray

    from elastic_train.cluster.runlog import RunLog

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        child.send_signal(signal.SIGSTOP)
        runlog = RunLog.remote(str(tmp_path / "run"))
        node_id = ray.get_runtime_context().get_node_id()
        ray.get(runlog.register_replica.remote(1, child.pid, node_id,
                                               psutil.Process(child.pid).create_time()))
        ray.get(runlog.register_replica.remote(2, child.pid, "f" * 56, 0.0))  # a lost node's
        ray.get(runlog.fence.remote(0, child.pid, 60.0))  # not registered as rank 0's
        ray.get(runlog.fence.remote(2, child.pid, 60.0))
        assert child.poll() is None
        ray.get(runlog.fence.remote(1, child.pid, 61.0))
        assert child.wait(timeout=120) == -signal.SIGKILL
        path = tmp_path / "run" / "events.jsonl"
        wait_for = time.monotonic() + 60
        while len(fenced := [json.loads(x) for x in path.read_text().splitlines()]) < 3:
            assert time.monotonic() < wait_for, fenced
            time.sleep(0.1)
        outcomes = {e["rank"]: e["outcome"] for e in fenced if e["event"] == "fenced"}
        assert outcomes == {0: "not fenced: unknown process", 2: "gone with its node", 1: "killed"}, fenced
    finally:
        child.kill()
        child.wait()


def test_every_worker_of_a_group_start_gets_the_attempt_its_first_began(ray_cluster, tmp_path):
    """RunLog.begin_group_attempt, called by a group start's workers at once (the RunLog runs
    calls on several threads): the first begins the attempt, and every other gets that attempt's
    index, never the one before it. Seen under load: rank 1 took -1 (the attempt not yet
    begun), its step records were never merged with rank 0's and the summary counted every step
    replayed. Here the run's acceptance is slow (0.5 s: staged files renamed on a remote store, a
    tracked run opened), which holds the first caller inside the attempt's start while the others
    ask; then more group starts, each with as many callers as the RunLog has threads."""
    import ray

    from elastic_train.cluster.runlog import RunLog

    class SlowAcceptRunLog(RunLog.__ray_actor_class__):
        def accept(self) -> None:
            time.sleep(0.5)
            super().accept()

    runlog = ray.remote(num_cpus=0, max_concurrency=4)(SlowAcceptRunLog).remote(str(tmp_path / "run"))
    for start in range(4):
        got = ray.get([runlog.begin_group_attempt.remote(f"group-{start}", 4) for _ in range(4)])
        assert got == [start] * 4, (start, got)
        assert ray.get(runlog.join_attempt.remote()) == start
    attempts = json.loads((tmp_path / "run" / "attempts.json").read_text())
    assert [a["attempt"] for a in attempts] == list(range(4))
    ray.kill(runlog)
