"""The RunLog's state under the calls of a threaded actor: several at once, in no fixed order.

Ray runs a threaded actor's calls (RunLog: max_concurrency=4) on a pool of threads and keeps no
order between them, even between two calls of one caller. These tests drive the real RunLog class
in this process from threads of their own, the way its actor's threads drive it; the run folder
is a real one (a local folder, or pyarrow's in-memory `mock://` filesystem standing in for a
remote store), and nothing of the RunLog is replaced.
"""

import json
import sys
import threading
import time

import pytest

from elastic_train.cluster.runlog import WINDOW_STEPS, RunLog

pytestmark = pytest.mark.unit

RunLogClass = RunLog.__ray_actor_class__


def step_record(step: int, attempt: int = 0, tokens: int = 100, seconds: float = 1.0) -> dict:
    """A step record with metrics.jsonl's fields the RunLog reads."""
    return {"step": step, "attempt": attempt, "epoch": 0, "loss": 1.0, "real_tokens": tokens,
            "padded_tokens": tokens, "step_time_s": seconds, "data_wait_s": 0.0,
            "tokens_per_s": tokens / seconds, "mfu": 0.0, "world_size": 2, "time": time.time()}


def test_the_latest_step_only_moves_forward_whatever_order_the_records_come_in(tmp_path):
    """A record that comes after a later one's (its call overtaken on another thread) is written
    to metrics.jsonl, but neither sets the latest step back nor empties the tokens/s window as if
    a restart had gone back; a restart (a new attempt) does both."""
    log = RunLogClass(str(tmp_path / "run"))
    log.begin_attempt(2)
    for step in range(1, 13):
        log.log_step(step_record(step, tokens=step * 10))
    window = log.run_state()["latest"], log.latest["window_tokens_per_s"]
    log.log_step(step_record(11, tokens=11 * 10))  # step 11's call, overtaken by step 12's

    assert log.run_state()["latest"] == (0, 12)
    assert (log.run_state()["latest"], log.latest["window_tokens_per_s"]) == window
    last = range(13 - WINDOW_STEPS, 13)
    assert window[1] == pytest.approx(sum(s * 10 for s in last) / len(last))
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [*range(1, 13), 11]

    log.begin_attempt(1)  # a restart from the checkpoint of step 8
    log.log_step(step_record(9, attempt=1, tokens=7))
    assert log.run_state()["latest"] == (1, 9)
    assert log.latest["window_tokens_per_s"] == pytest.approx(7.0)


def test_a_remote_run_folder_is_uploaded_by_one_call_at_a_time_and_a_failed_upload_is_retried(tmp_path):
    """Remote storage: while one upload runs, the calls that come (four threads logging steps)
    start none of their own; the upload that fails is a warning, the step's call goes on (its Ray
    metrics too), and a later upload takes every line."""
    log = RunLogClass("mock:///runs/remote", flush_interval_s=0.0)
    log.begin_attempt(2)
    upload = log.folder.sync
    lock, running, most, calls = threading.Lock(), [0], [0], [0]

    def slow_upload():  # a remote store's upload takes a while
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            calls[0] += 1
            first = calls[0] == 1
        try:
            time.sleep(0.05)
            if first:
                raise OSError("connection reset by peer")
            upload()
        finally:
            with lock:
                running[0] -= 1

    log.folder.sync = slow_upload
    steps = iter(range(1, 81))
    steps_lock = threading.Lock()

    def caller():
        while True:
            with steps_lock:
                step = next(steps, None)
            if step is None:
                return
            log.log_step(step_record(step))

    threads = [threading.Thread(target=caller) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.flush()

    assert calls[0] >= 2 and most[0] == 1, (calls[0], most[0])
    assert log.metrics.goodput.productive_s == pytest.approx(80.0)  # every step's Ray metrics
    with log.folder.fs.open_input_stream(f"{log.folder.remote_path}/metrics.jsonl") as f:
        uploaded = [json.loads(x)["step"] for x in f.read().decode().splitlines()]
    assert sorted(uploaded) == list(range(1, 81))
    with log.folder.fs.open_input_stream(f"{log.folder.remote_path}/events.jsonl") as f:
        events = [json.loads(x) for x in f.read().decode().splitlines()]
    assert [e["error"] for e in events if e["event"] == "upload_failed"] == ["connection reset by peer"]


def test_a_failure_recorded_late_ends_the_attempt_it_ended_not_the_restart(tmp_path):
    """The failure policy waits 5 s for record_failure, then the controller restarts the group
    anyway: a record that comes after the restart's attempt began ends the attempt that was
    running when the failure was seen, and leaves the new one running."""
    log = RunLogClass(str(tmp_path / "run"))
    log.begin_attempt(2)
    log.log_step(step_record(7))
    seen = time.time()
    time.sleep(0.01)
    log.begin_attempt(1)  # the restart began before the record came
    log.record_failure({"time": seen, "kind": "died", "cause": "its process died", "rank": 1})

    attempts = json.loads((tmp_path / "run" / "attempts.json").read_text())
    assert attempts[0]["end"]["cause"] == "its process died" and attempts[0]["end"]["rank"] == 1
    assert "end" not in attempts[1]
    event = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()][-1]
    assert (event["event"], event["attempt"]) == ("failure", 0)


def test_a_fault_is_claimed_once_by_callers_at_once(tmp_path):
    """claim_fault from four threads at once, for 400 keys: exactly one gets each fault (a fault
    fires once per run). The threads change places as often as they can; without the lock over
    the check and the claim about one key in 300 went to two callers here."""
    log = RunLogClass(str(tmp_path / "run"))
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for key in range(400):
            barrier, got = threading.Barrier(4), []

            def claim(key=key, barrier=barrier, got=got):
                barrier.wait()
                got.append(log.claim_fault(f"crash@{key}"))

            threads = [threading.Thread(target=claim) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert sorted(got) == [False, False, False, True], (key, got)
    finally:
        sys.setswitchinterval(switch)
    assert len(json.loads((tmp_path / "run" / "faults.json").read_text())) == 400
