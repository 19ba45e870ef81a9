"""The RunLog's state under the calls of a threaded actor: several at once, in no fixed order.

Ray runs a threaded actor's calls (RunLog: max_concurrency=4) on a pool of threads and keeps no
order between them, even between two calls of one caller. These tests drive the real RunLog class
in this process from threads of their own, the way its actor's threads drive it; the run folder
is a real one (a local folder, or pyarrow's in-memory `mock://` filesystem standing in for a
remote store), and nothing of the RunLog is replaced.
"""

import json
import sys
import tempfile
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


def test_a_remote_run_folder_is_uploaded_by_one_call_at_a_time_and_a_failed_upload_is_retried(tmp_path,
                                                                                                  monkeypatch):
    """Remote storage: while one upload runs, the calls that come (four threads logging steps)
    start none of their own; the upload that fails is a warning, the step's call goes on (its Ray
    metrics too), and a later upload takes every line."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the staging copy: the test's
    log = RunLogClass("mock:///runs/remote", flush_interval_s=0.0)
    log.begin_attempt(2)
    upload = log.folder.sync
    lock, running, most, calls = threading.Lock(), [0], [0], [0]

    def slow_upload(pace_s: float = 0.0):  # a remote store's upload takes a while
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            calls[0] += 1
            first = calls[0] == 1
        try:
            time.sleep(0.05)
            if first:
                raise OSError("connection reset by peer")
            upload(pace_s)
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
    running when the failure was seen (in place of the resize its end was taken for), makes
    the new one a restart, and leaves it running."""
    log = RunLogClass(str(tmp_path / "run"))
    log.begin_attempt(2)
    log.log_step(step_record(7))
    seen = time.time()
    time.sleep(0.01)
    log.begin_attempt(1)  # the restart began before the record came
    log.record_failure({"time": seen, "kind": "died", "cause": "its process died", "rank": 1})

    attempts = json.loads((tmp_path / "run" / "attempts.json").read_text())
    assert attempts[0]["end"]["cause"] == "its process died" and attempts[0]["end"]["rank"] == 1
    assert attempts[0]["end"]["step"] == 7
    assert "end" not in attempts[1] and attempts[1]["cause"] == "restart"  # not a resize
    event = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()][-1]
    assert (event["event"], event["attempt"]) == ("failure", 0)


def test_a_group_replaced_with_no_failure_is_a_resize_with_an_end(tmp_path):
    """Ray Train's scaling policy replaces a group no failure ended (a grow): the attempt it
    ended gets its `end` (cause resize, the step it reached: it had none), the next one begins
    as a resize, which summary.json counts among its restarts and apart as a resize. A failure
    later still ends its own attempt as one."""
    from elastic_train.observe.summary import attempt_counts

    log = RunLogClass(str(tmp_path / "run"))
    log.begin_attempt(1)
    log.log_step(step_record(5))
    log.begin_attempt(2)  # the grow
    log.log_step(step_record(9, attempt=1))
    seen = time.time()
    log.record_failure({"time": seen, "kind": "died", "cause": "its process died", "rank": 0})
    log.begin_attempt(1)
    attempts = json.loads((tmp_path / "run" / "attempts.json").read_text())
    assert [a["cause"] for a in attempts] == ["start", "resize", "restart"]
    assert (attempts[0]["end"]["cause"], attempts[0]["end"]["step"]) == ("resize", 5)
    assert (attempts[1]["end"]["cause"], attempts[1]["end"]["step"]) == ("its process died", 9)
    assert attempt_counts(attempts) == {"restarts": 2, "resumes": 0, "resizes": 1}


def test_a_grow_whose_group_never_starts_is_waited_for_aloud_and_bounded(tmp_path):
    """Ray Train shut a group down for a bigger one that does not start (its node went, and the
    cluster is below scaling.min_workers: Ray's elastic policy waits, raising nothing): the
    failure policy's start failure ends the replaced group's attempt as a resize, so the driver
    says what it waits for and gives up after scaling.start_timeout_s; it said nothing, for ever,
    taking the old group for running. A grow that starts at a later try is still a resize. In
    place, a replacement's start failure ends nothing: the survivors train on."""
    import io

    from elastic_train.cluster.runwatch import FIRST_WAIT_LINE_S, RunWatch
    from elastic_train.config import load_config
    from elastic_train.observe.summary import attempt_counts

    log = RunLogClass(str(tmp_path / "run"))
    log.begin_attempt(1)
    log.log_step(step_record(5))
    log.record_failure({"kind": "start_timeout", "cause": "no room for 2 workers yet",
                        "in_place": False})
    attempts = json.loads((tmp_path / "run" / "attempts.json").read_text())
    assert (attempts[0]["end"]["cause"], attempts[0]["end"]["step"]) == ("resize", 5)

    stream, aborted = io.StringIO(), []
    watch = RunWatch(load_config(None, ["scaling.start_timeout_s=100"]), None,
                     abort=lambda: aborted.append(True), describe_wait=lambda: "1 CPU free of 2",
                     stream=stream)
    since = attempts[0]["end"]["time"]
    watch._watch_start(attempts, since + FIRST_WAIT_LINE_S + 1)
    assert stream.getvalue().startswith("waiting for workers (46 s of scaling.start_timeout_s=100)")
    assert not aborted
    watch._watch_start(attempts, since + 101)
    assert aborted and "giving up: no room for the run's workers" in stream.getvalue()

    log.begin_attempt(2)  # the grow, at a later try
    attempts = json.loads((tmp_path / "run" / "attempts.json").read_text())
    assert [a["cause"] for a in attempts] == ["start", "resize"] and "end" not in attempts[1]
    assert attempt_counts(attempts) == {"restarts": 1, "resumes": 0, "resizes": 1}

    in_place = RunLogClass(str(tmp_path / "in_place"))
    in_place.begin_attempt(2)
    in_place.record_failure({"kind": "start", "cause": "a worker did not start", "in_place": True})
    assert "end" not in json.loads((tmp_path / "in_place" / "attempts.json").read_text())[0]


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


def metrics_lines(run) -> list[tuple]:
    """metrics.jsonl's records in file order: ("step", n) or ("eval", n)."""
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [("eval" if "eval_loss" in r else "step", r["step"]) for r in records]


def test_a_workers_records_are_written_in_the_order_it_sent_them(tmp_path):
    """Rank 0's calls taken in another order than it sent them (step 2's and the evaluation's
    before step 1's, as the actor's threads may): metrics.jsonl has them in the order sent."""
    log = RunLogClass(str(tmp_path / "run"))
    log.begin_attempt(2)
    log.log_step(step_record(2), ("rank0", 1))
    log.log_eval({"step": 2, "attempt": 0, "eval_loss": 0.5}, ("rank0", 2))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # held for step 1's
    log.log_step(step_record(1), ("rank0", 0))
    log.log_step(step_record(3), ("rank0", 3))
    assert metrics_lines(tmp_path / "run") == [("step", 1), ("step", 2), ("eval", 2), ("step", 3)]
    assert log.run_state()["latest"] == (0, 3) and log.latest_eval["step"] == 2


def test_in_place_the_first_record_of_each_step_comes_in_step_order(tmp_path):
    """In place, every replica sends each committed step; the first of each is kept. Replica a's
    step 2 taken before anyone's step 1 waits for a's step 1, which by then is a duplicate of
    b's: the file holds step 1, then step 2, each once, with their consumed-ids lines."""
    log = RunLogClass(str(tmp_path / "run"))
    log.begin_group_attempt("group", 2)

    def committed(step, sender, number):
        line = {"attempt": 0, "step": step, "epoch": 0, "participants": 2, "ids": [step]}
        log.log_committed(step_record(step), line, (sender, number))

    committed(2, "a", 1)
    committed(1, "b", 0)
    committed(1, "a", 0)
    committed(2, "b", 1)
    assert metrics_lines(tmp_path / "run") == [("step", 1), ("step", 2)]
    consumed = (tmp_path / "run" / "consumed" / "attempt000-steps.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in consumed] == [1, 2]


def test_a_record_whose_predecessor_never_comes_is_written_after_the_hold(tmp_path, monkeypatch):
    """A call lost with its sender: the records after it wait HOLD_S at most (the driver's poll
    takes them), and the lost one, should it come after all, is written then."""
    import elastic_train.cluster.runlog as runlog_module

    monkeypatch.setattr(runlog_module, "HOLD_S", 0.2)
    log = RunLogClass(str(tmp_path / "run"))
    log.begin_attempt(1)
    came = time.monotonic()
    log.log_step(step_record(2), ("rank0", 1))
    log.log_step(step_record(3), ("rank0", 2))
    log.progress()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    deadline = time.monotonic() + 30
    while not (tmp_path / "run" / "metrics.jsonl").exists():  # the driver's polls
        assert time.monotonic() < deadline, "held past the hold"
        time.sleep(0.05)
        log.progress()
    assert time.monotonic() - came >= 0.2
    assert metrics_lines(tmp_path / "run") == [("step", 2), ("step", 3)]
    log.log_step(step_record(1), ("rank0", 0))
    log.log_step(step_record(4), ("rank0", 3))
    assert metrics_lines(tmp_path / "run") == [("step", 2), ("step", 3), ("step", 1), ("step", 4)]
    assert log.run_state()["latest"] == (0, 4)



def test_a_remote_resume_uploads_only_its_own_files_not_the_workers_it_found(monkeypatch, tmp_path):
    """A resume on remote storage: the RunLog's staging copy is taken when the fit begins and
    uploaded every few seconds, so it must leave alone what the workers write. In the store: a
    best checkpoint (step 40) with its pointer, an in-place pointer, a compile cache; then the
    workers write a better best (step 80: commit_best deletes step 40's folder), a new in-place
    pointer and cache. After the RunLog's uploads each is the workers' latest, step 40's best
    folder stays gone, and the RunLog's own files carry both fits' lines."""
    import pyarrow.fs as pafs

    from elastic_train.observe import runfolder
    from elastic_train.recovery.checkpoints import POINTER, read_pointer
    from elastic_train.training.checkpoint import MANIFEST, commit_best, read_best_pointer
    from elastic_train.training.compile import CACHE_SUBFOLDER

    store, run = pafs.FileSystem.from_uri("mock:///runs/r")  # one store for driver and workers
    monkeypatch.setattr(runfolder, "split_uri", lambda uri: (store, run, False))

    def put(name: str, text: str) -> None:
        store.create_dir(f"{run}/{name}".rsplit("/", 1)[0], recursive=True)
        with store.open_output_stream(f"{run}/{name}") as f:
            f.write(text.encode())

    def get(name: str) -> str:
        with store.open_input_stream(f"{run}/{name}") as f:
            return f.read().decode()

    put("config.yaml", "run: {}\n")  # the first fit's files
    put("metrics.jsonl", json.dumps(step_record(40)) + "\n")
    put(f"best_checkpoint_000000040/{MANIFEST}", "{}")
    commit_best(store, run, "best_checkpoint_000000040", 40, 2.0)
    put(POINTER, json.dumps({"checkpoint": "checkpoint_000000040", "step": 40, "written": []}))
    put(f"{CACHE_SUBFOLDER}/torch-x/rank-0.bin", "first fit")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the staging copy: the test's
    log = RunLogClass("mock:///runs/r", flush_interval_s=0.0)  # the resume's RunLog
    log.begin_attempt(2)
    put(f"best_checkpoint_000000080/{MANIFEST}", "{}")  # the workers, meanwhile
    commit_best(store, run, "best_checkpoint_000000080", 80, 1.0)
    put(POINTER, json.dumps({"checkpoint": "checkpoint_000000080", "step": 80, "written": []}))
    put(f"{CACHE_SUBFOLDER}/torch-x/rank-0.bin", "second fit")
    log.log_step(step_record(81))
    log.flush()

    assert read_best_pointer(store, run)["step"] == 80
    assert store.get_file_info(f"{run}/best_checkpoint_000000040").type == pafs.FileType.NotFound
    assert read_pointer(store, run)["step"] == 80
    assert get(f"{CACHE_SUBFOLDER}/torch-x/rank-0.bin") == "second fit"
    assert [json.loads(x)["step"] for x in get("metrics.jsonl").splitlines()] == [40, 81]


def test_an_in_place_attempt_the_group_did_not_outlive_ends_with_its_failure(tmp_path):
    """In place a failure leaves the attempt running (a replacement joins it); when Ray then
    begins another group, the attempt ends with that failure and the next is a restart, not a
    resize."""
    log = RunLogClass(str(tmp_path / "run"))
    log.begin_group_attempt("a", 2)
    log.log_step(step_record(4))
    log.record_failure({"time": time.time(), "kind": "died", "cause": "its process died",
                        "rank": 1, "in_place": True})
    assert "end" not in json.loads((tmp_path / "run" / "attempts.json").read_text())[0]
    log.begin_group_attempt("b", 2)
    attempts = json.loads((tmp_path / "run" / "attempts.json").read_text())
    assert [a["cause"] for a in attempts] == ["start", "restart"]
    assert (attempts[0]["end"]["cause"], attempts[0]["end"]["step"]) == ("its process died", 4)
