"""A run that cannot start says so, one line per failure, resumes counted apart (no cluster).

The Ray side of the same (the real console of a crashed run, a stopped run's release, the
bound on repeated failures, a finished run left alone) is tests/test_runend.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from ray.exceptions import RayActorError
from ray.train.v2._internal.exceptions import (
    WorkerGroupStartupFailedError,
    WorkerGroupStartupTimeoutError,
    WorkerHealthCheckFailedError,
)
from ray.train.v2.api.exceptions import ControllerError, WorkerGroupError

from elastic_train.cli import main
from elastic_train.cluster.capacity import shortfall, workers_that_fit
from elastic_train.cluster.console import FailureReports, is_ray_chatter
from elastic_train.cluster.failures import describe_failure
from elastic_train.cluster.runwatch import failure_line
from elastic_train.config import Config, ConfigError, load_config
from elastic_train.observe.summary import attempt_counts
from elastic_train.preflight.packages import check_packages

pytestmark = pytest.mark.unit


def test_a_missing_optional_package_is_one_error_naming_its_extra(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "torchft", None)  # what a missing package looks like to import
    with pytest.raises(ConfigError, match=r"fault.recovery=in_place needs the package 'torchft'.*"
                                          r"pip install -e '\.\[ft\]'"):
        check_packages(load_config(None, ["fault.recovery=in_place"]))
    code = main(["train", "fault.recovery=in_place", "scaling.min_workers=2",
                 f"run.storage_path={tmp_path}"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "torchft" in errors[0], errors
    assert list(tmp_path.iterdir()) == []  # refused before anything was written
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ConfigError, match=r"model.name=hf needs the package 'transformers'"):
        check_packages(load_config(None, ["model.name=hf", "model.path=/nowhere"]))
    check_packages(Config())  # the default needs nothing optional


def test_room_for_workers_counts_per_node_and_names_the_shortfall():
    cfg = load_config(None, ["scaling.min_workers=4", "scaling.max_workers=4"])
    assert workers_that_fit({"CPU": 1.0}, [{"CPU": 2.0}]) == 2
    assert workers_that_fit({"CPU": 2.0, "GPU": 1.0}, [{"CPU": 3.0, "GPU": 2.0}, {"CPU": 8.0}]) == 1
    assert shortfall(cfg, [{"CPU": 2.0}]) == ("scaling.min_workers=4 needs 4 workers x 1 CPU; the "
                                              "cluster has 2 CPU on 1 node, room for 2")
    assert shortfall(cfg, [{"CPU": 2.0}, {"CPU": 2.0}]) is None
    slots = load_config(None, ["scaling.min_workers=2", "scaling.max_workers=2",
                               "scaling.resources_per_worker={slot: 1}"])
    assert "room for 0" in shortfall(slots, [{"CPU": 16.0}])  # no node has the slot


def _died(rank_ip: str) -> RayActorError:
    return RayActorError(actor_id="ab", error_msg=(
        "The actor died unexpectedly before finishing this task.\n\tclass_name: RayTrainWorker\n"
        f"\tpid: 4242\n\tip: {rank_ip}\nThe actor is dead because its worker process has died. "
        "Worker exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a "
        "connection error code 2. End of file. Some common causes include: (1) the OOM killer"))


def test_a_dead_process_is_the_cause_not_the_peer_that_lost_it():
    peer = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:23725. GLHF!")
    error = WorkerGroupError("[Rank 0 Error Snippet]:\nTraceback...\nRuntimeError: Connection "
                             "closed by peer\n[Rank 1 Error Snippet]:\nA worker health check failed.",
                             {0: peer, 1: WorkerHealthCheckFailedError("health check", _died("10.0.0.7"))})
    failure = describe_failure(error)
    assert (failure.kind, failure.rank, failure.node) == ("worker", 1, "10.0.0.7")
    assert failure.cause == ("its process died (SYSTEM_ERROR: Worker unexpectedly exits with a "
                             "connection error code 2. End of file.)")


def test_a_workers_own_error_comes_with_its_traceback():
    snippet = 'Traceback (most recent call last):\n  File "m.py", line 3\nValueError: no such layer'
    error = WorkerGroupError(f"[Rank 0,1 Error Snippet]:\n{snippet}\n",
                             {0: ValueError("no such layer"), 1: ValueError("no such layer")})
    failure = describe_failure(error)
    assert (failure.rank, failure.cause, failure.traceback) == (0, "ValueError: no such layer", snippet)
    again = describe_failure(WorkerGroupError("", {0: ValueError("no such layer"), 1: ValueError("x")}))
    assert again.signature == failure.signature  # the same failure, counted as a repeat


def test_start_failures_are_told_apart_from_start_timeouts():
    timeout = describe_failure(ControllerError(WorkerGroupStartupTimeoutError(4)))
    assert (timeout.kind, timeout.cause) == ("start_timeout", "no room for 4 workers yet")
    try:
        try:
            raise _died("10.0.0.9")
        except RayActorError as actor_error:
            raise WorkerGroupStartupFailedError("a worker failed to start") from actor_error
    except WorkerGroupStartupFailedError as exc:
        failed = describe_failure(ControllerError(exc))
    assert failed.kind == "start" and failed.node == "10.0.0.9" and "did not start" in failed.cause


class _Policy:
    """BoundedFailurePolicy (Ray's default policy beneath it) with the RunLog's answer given:
    the latest step and a worker's fatal reason. No Ray session."""

    @staticmethod
    def make(max_failures: int, state: dict):
        from ray.train.v2.api.config import FailureConfig

        from elastic_train.cluster.failures import BoundedFailurePolicy

        class Policy(BoundedFailurePolicy):
            def _run_state(self) -> dict:
                return state

        return Policy(FailureConfig(max_failures=max_failures), runlog=None)


def test_a_start_timeout_between_repeats_of_a_failure_does_not_reset_their_count():
    """X, timeout, X, timeout, X without a step: X three times in a row gives up (the timeouts
    reset the count, so a failure that alternated with them was retried forever with
    scaling.max_failures=-1); a worker's fatal reason gives up at the first failure."""
    from ray.train.v2._internal.execution.failure_handling.failure_policy import FailureDecision

    def start_failure():
        return ControllerError(WorkerGroupStartupFailedError("a worker failed to start"))

    policy = _Policy.make(-1, {"latest": (0, 7)})
    decisions = []
    for error in (start_failure(), ControllerError(WorkerGroupStartupTimeoutError(2)),
                  start_failure(), ControllerError(WorkerGroupStartupTimeoutError(2)),
                  start_failure()):
        decisions.append(policy.make_decision(error))
    assert decisions == [FailureDecision.RETRY] * 4 + [FailureDecision.RAISE]
    fatal = _Policy.make(-1, {"latest": (0, 7), "fatal": "DataError: checkpoint ..."})
    assert fatal.make_decision(start_failure()) == FailureDecision.RAISE


def test_one_failure_line_says_who_where_what_and_how_it_goes_on():
    failure = {"attempt": 0, "rank": 1, "node": "10.0.0.7", "step": 15, "committed_step": 10,
               "cause": "its process died (SYSTEM_ERROR)", "decision": "retry", "repeats": 1}
    assert failure_line(failure, {"world_size": 2}) == (
        "attempt 0: rank 1 on node 10.0.0.7 failed at step 15: its process died (SYSTEM_ERROR); "
        "resumed from the checkpoint of step 10 with 2 workers")
    final = {**failure, "decision": "give_up", "repeats": 3, "committed_step": None}
    assert failure_line(final, None).endswith("(3 times in a row without a step); giving up")
    spent = {**failure, "decision": "give_up", "max_failures": 1}  # the restart budget used up
    assert failure_line(spent, None).endswith(
        "(no restart left: scaling.max_failures=1); giving up")
    assert "restarting from the start (no checkpoint)" in failure_line({**failure, "committed_step":
                                                                        None}, None)
    refused = {**failure, "cause": "DataError: checkpoint checkpoint_000000044: data partition 0 is "
               "at [0, 2] (window, micro-batch), not at [1, 0]"}
    assert failure_line(refused, {"world_size": 2}, fatal=refused["cause"][11:]).endswith(
        "not at [1, 0]; stopping: a restart would fail the same way")


CRASH_CONSOLE = Path(__file__).parent / "data" / "crash_console.txt"


def test_rays_failure_reports_stay_off_the_screen():
    """The forwarded lines a worker's hard crash put on the console (recorded from a real run,
    Ray 2.60): none is shown, while a worker's own print and warning are."""
    reports = FailureReports()
    shown = []
    for raw in CRASH_CONSOLE.read_text().splitlines():
        match = re.match(r"^(?:\x1b\[\d+m)?\((\w+)(?: pid=(\d+))?\)(?:\x1b\[0m)? ?(.*)$", raw)
        if match is None:
            continue  # our own lines (progress): not forwarded
        source, line = (match.group(1), match.group(2)), match.group(3)
        if not (reports.hides(source, line) or is_ray_chatter(line)):
            shown.append(line)
    assert shown == ["my model says hello", "UserWarning: the user's own warning"]


def test_resumes_are_counted_apart_from_restarts():
    assert attempt_counts([{"cause": "start"}, {"cause": "restart"}, {"cause": "resume"},
                           {"cause": "restart"}]) == {"restarts": 2, "resumes": 1, "resizes": 0}
    assert attempt_counts([{}, {}, {}]) == {"restarts": 2, "resumes": 0, "resizes": 0}  # no causes kept
    assert attempt_counts([]) == {"restarts": 0, "resumes": 0, "resizes": 0}


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _earlier_run(root: Path) -> Path:
    folder = root / "run"
    folder.mkdir()
    for name, text in [("config.yaml", "train: {max_steps: 10}\n"), ("dataset.json", "{}"),
                       ("summary.json", '{"status": "finished"}'), ("events.jsonl", '{"a": 1}\n'),
                       ("attempts.json", "[]")]:
        (folder / name).write_text(text)
    return folder


def test_a_resume_that_never_began_leaves_the_folder_as_it_was(tmp_path):
    """Staged files are removed, appended ones cut back, rewritten ones put back, new ones
    removed; nothing written after the discard lands (a worker's late event)."""
    from elastic_train.observe.runfolder import RunFolder

    folder = _earlier_run(tmp_path)
    before = _files(folder)
    run = RunFolder(str(folder))
    assert run.resuming and not run.accepted
    run.stage("config.yaml", "train: {max_steps: 20}\n")
    run.stage("config.20261205-070000.yaml", "train: {max_steps: 10}\n")
    assert (folder / "config.yaml.pending").is_file()
    assert (folder / "config.yaml").read_text() == "train: {max_steps: 10}\n"  # export reads this
    run.append("events.jsonl", ['{"event": "worker_started"}'])
    run.write("attempts.json", '[{"attempt": 0}]')
    run.write("faults.json", "{}")
    run.discard()
    run.append("events.jsonl", ['{"event": "fatal"}'])
    run.write("summary.json", '{"status": "failed"}')
    run.accept()  # too late: a discarded fit stays discarded
    assert _files(folder) == before


def test_an_accepted_resume_promotes_its_config_and_keeps_what_it_wrote(tmp_path):
    from elastic_train.observe.runfolder import RunFolder

    folder = _earlier_run(tmp_path)
    run = RunFolder(str(folder))
    run.stage("config.20261205-070000.yaml", "train: {max_steps: 10}\n")
    run.stage("config.yaml", "train: {max_steps: 15}\n")
    run.stage("config.yaml", "train: {max_steps: 20}\n")  # staged again: the last one counts
    run.append("events.jsonl", ['{"event": "worker_started"}'])
    run.accept()
    run.discard()  # too late: an accepted run keeps its files
    assert (folder / "config.yaml").read_text() == "train: {max_steps: 20}\n"
    assert (folder / "config.20261205-070000.yaml").read_text() == "train: {max_steps: 10}\n"
    assert not list(folder.glob("*.pending"))
    assert (folder / "events.jsonl").read_text().count("\n") == 2
    run.stage("provenance.json", "{}")  # after acceptance a staged file is written at once
    assert (folder / "provenance.json").is_file()


def test_stale_pending_files_are_removed_and_a_new_run_is_not_resuming(tmp_path):
    """A driver killed before acceptance left its staged files: the next fit removes them. A
    folder without config.yaml holds no earlier run: nothing is journaled there."""
    from elastic_train.observe.runfolder import RunFolder

    folder = _earlier_run(tmp_path)
    (folder / "config.yaml.pending").write_text("stale")
    assert RunFolder(str(folder)).resuming and not (folder / "config.yaml.pending").exists()
    fresh = RunFolder(str(tmp_path / "new"))
    assert not fresh.resuming
    fresh.append("events.jsonl", ["{}"])
    fresh.discard()  # nothing journaled: settle() keeps a new run's folder (its failure's record)
    assert (tmp_path / "new" / "events.jsonl").is_file()


def test_ray_log_discard_cuts_the_file_back_and_drops_later_lines(tmp_path):
    from elastic_train.cluster.console import RayLog

    path = tmp_path / "ray.log"
    path.write_text("an earlier fit's line\n")
    log = RayLog()
    log.write(["held before the folder was known"])
    log.open(path)
    log.write(["this fit's line"])
    log.discard()
    log.write(["a line after the discard"])
    assert path.read_text() == "an earlier fit's line\n"
    new = RayLog()
    new.open(tmp_path / "new.log")
    new.discard()
    assert not (tmp_path / "new.log").exists()
    log.close()
    new.close()


@pytest.mark.unit
def test_in_place_steps_trained_again_after_the_last_replica_was_lost_count_as_replayed():
    """In place, one attempt: steps 1-6 logged, the last replica lost after step 6, the fresh
    replacements (two of them, the same loss) restore step 4's checkpoint and train 5-8; the run
    log kept the first records of 5 and 6. A restore with a live peer about (a late heal) costs
    nothing again."""
    from elastic_train.observe.summary import LOST_STATE, retrained_in_place

    records = [{"attempt": 0, "step": s, "time": 100.0 + s} for s in range(1, 9)]
    records[6:] = [{"attempt": 0, "step": s, "time": 120.0 + s} for s in (7, 8)]
    events = [{"event": "restored_instead_of_healing", "step": 4, "reason": LOST_STATE, "time": 110.0},
              {"event": "restored_instead_of_healing", "step": 4, "reason": LOST_STATE, "time": 111.0},
              {"event": "restored_instead_of_healing", "step": 6, "reason": "no heal within its deadline",
               "time": 130.0}]
    assert retrained_in_place(records, events) == 2
    assert retrained_in_place(records, events[2:]) == 0


def test_a_second_run_in_a_held_run_folder_is_one_error_naming_the_first(tmp_path, capsys):
    """Another driver holds the run folder (here: a process of its own that takes the lock and
    waits): `elastic-train train` of the same folder is refused before Ray starts, with one
    line naming the holder's pid, and writes nothing; once that driver is killed (SIGKILL: no
    chance to clean up) the folder is free at once."""
    import signal
    import subprocess

    from elastic_train.preflight.runlock import RunLock

    overrides = [f"run.storage_path={tmp_path}", "run.name=shared"]
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "from elastic_train import load_config\n"
         "from elastic_train.preflight.runlock import RunLock\n"
         f"with RunLock(load_config(None, {overrides!r})):\n"
         "    print('held', flush=True); time.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        code = main(["train", *overrides])
        errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert code == 2 and len(errors) == 1, errors
        assert re.fullmatch(rf"error: run folder {re.escape(str(tmp_path))}/shared is in use by "
                            rf"another run \(pid {holder.pid} on \S+, started [0-9: -]+\): wait "
                            r"for it to end or stop it, or give this one another run\.name",
                            errors[0]), errors[0]
        assert not (tmp_path / "shared").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with RunLock(load_config(None, overrides)):  # a killed holder leaves no stale lock
        with pytest.raises(ConfigError, match=rf"pid {os.getpid()} on"):
            with RunLock(load_config(None, overrides)):  # two in one process: refused as well
                pass


@pytest.fixture
def remote_lease(monkeypatch):
    """RunLock on a remote store (pyarrow's in-memory `mock://`, one store for every driver of
    the test), its lease intervals short: (config overrides, the store, the lease's path)."""
    from elastic_train.preflight import runlock

    store, _ = pafs.FileSystem.from_uri("mock:///runs")
    store.create_dir("runs")
    monkeypatch.setattr(runlock, "split_uri", lambda uri: (store, "runs/shared", False))
    monkeypatch.setattr(runlock, "LEASE_RENEW_S", 0.1)
    monkeypatch.setattr(runlock, "LEASE_SILENT_S", 1.0)
    monkeypatch.setattr(runlock, "LEASE_SETTLE_S", 0.2)
    return ["run.storage_path=mock:///runs", "run.name=shared"], store, "runs/.shared.lease"


def _lease(store, path):
    with store.open_input_stream(path) as f:
        return json.loads(f.read())


def test_a_remote_run_folder_is_held_by_a_lease_another_cluster_sees(remote_lease, caplog):
    """Drivers on two clusters share nothing but the store: while one renews its lease, a
    second is refused naming it; released, the lease is gone and the next driver takes the
    folder at once (no watch)."""
    from elastic_train.preflight.runlock import RunLock

    overrides, store, path = remote_lease
    with RunLock(load_config(None, overrides)):
        held = _lease(store, path)
        assert held["pid"] == os.getpid()
        with pytest.raises(ConfigError, match=rf"run folder mock:///runs/shared is in use by "
                                              rf"another run \(pid {os.getpid()} on .*\): wait"):
            with RunLock(load_config(None, overrides)):
                pass
        assert _lease(store, path)["lease"] == held["lease"]  # the refused one left it alone
    assert store.get_file_info(path).type == pafs.FileType.NotFound
    caplog.clear()
    with RunLock(load_config(None, overrides)):
        assert "watching it" not in caplog.text
        assert _lease(store, path)["lease"] != held["lease"]


def test_a_lease_its_driver_stopped_renewing_is_taken_after_the_silent_interval(remote_lease,
                                                                              caplog):
    """A driver killed (or its head node lost) leaves its lease: the next driver says so,
    watches it `LEASE_SILENT_S`, and takes it."""
    from elastic_train.preflight.runlock import RunLock

    overrides, store, path = remote_lease
    with store.open_output_stream(path) as f:
        f.write(json.dumps({"host": "lost-head", "pid": 4242, "started": 1.0e9,
                            "lease": "dead"}).encode())
    with RunLock(load_config(None, overrides)):
        assert _lease(store, path)["pid"] == os.getpid()
    assert re.search(r"has a lease \(pid 4242 on lost-head, started 2001-09-\d\d [0-9:]+\): "
                     r"watching it up to 1 s", caplog.text), caplog.text


def test_of_two_drivers_that_write_a_lease_at_once_only_the_later_goes_on(remote_lease,
                                                                          monkeypatch):
    """Both found no lease: the one whose lease is overwritten before it reads it back is
    refused, naming the other. The other driver's write comes right after this one's (in its
    settle time, whatever the machine's load: no race with a thread)."""
    from elastic_train.preflight import runlock

    overrides, store, path = remote_lease
    write = runlock._Lease._write

    def then_the_other_drivers(lease) -> None:
        write(lease)
        with store.open_output_stream(path) as f:
            f.write(json.dumps({"host": "other-head", "pid": 77, "started": time.time(),
                                "lease": "other"}).encode())

    monkeypatch.setattr(runlock._Lease, "_write", then_the_other_drivers)
    with pytest.raises(ConfigError, match=r"\(pid 77 on other-head, started"):
        with runlock.RunLock(load_config(None, overrides)):
            pass
    assert _lease(store, path)["lease"] == "other"  # the refused one deleted nothing



def test_a_file_uri_run_folder_is_locked_like_a_local_path(tmp_path):
    """`file://` storage is a local folder to pyarrow: the same flock, beside the folder."""
    from elastic_train.preflight.runlock import RunLock

    as_uri = load_config(None, [f"run.storage_path=file://{tmp_path}", "run.name=r"])
    with RunLock(load_config(None, [f"run.storage_path={tmp_path}", "run.name=r"])):
        with pytest.raises(ConfigError, match=rf"pid {os.getpid()} on"):
            with RunLock(as_uri):
                pass
    assert (tmp_path / ".r.lock").is_file() and not (tmp_path / "r").exists()


def test_a_remote_runs_stopped_summary_is_written_to_its_staging_copy_and_uploaded(tmp_path,
                                                                                  monkeypatch):
    """SIGTERM to a local run's whole group with an `s3://` run folder: the RunLog that uploads
    the staging copy went down with the cluster, so the driver writes the stopped summary and
    the attempt's end into that copy, and uploads it as it exits (here to pyarrow's mock://
    store; the exit is a process of its own)."""
    import functools
    import subprocess

    from elastic_train import api
    from elastic_train.observe import runfolder

    store, _ = pafs.FileSystem.from_uri("mock:///runs")
    monkeypatch.setattr(runfolder, "split_uri", lambda uri: (store, "runs/r", False))
    cfg = load_config(None, ["run.storage_path=mock:///runs", "run.name=r"])
    staging, start = tmp_path / "staging", time.time()
    staging.mkdir()
    (staging / "config.yaml").write_text(cfg.to_yaml())
    (staging / "attempts.json").write_text(json.dumps([{"attempt": 0, "world_size": 2,
                                                        "start_time": start + 1}]))
    (staging / "metrics.jsonl").write_text(json.dumps(
        {"step": 1, "epoch": 0, "time": start + 2, "attempt": 0, "world_size": 2, "loss": 5.0,
         "lr": 1e-3, "real_tokens": 100, "padded_tokens": 120, "step_time_s": 0.5,
         "data_wait_s": 0.01, "tokens_per_s": 200.0, "skipped_steps": 0}) + "\n")
    written = api._stopped_summary(cfg, str(staging), start, {}, "SIGTERM")
    assert written == f": summary.json written from the run folder's staging copy {staging}"
    functools.partial(runfolder.upload_staging, str(staging), runfolder.run_uri(cfg))()
    assert not staging.exists()  # uploaded, the copy is removed
    with store.open_input_stream("runs/r/summary.json") as f:
        summary = json.loads(f.read())
    with store.open_input_stream("runs/r/attempts.json") as f:
        attempts = json.loads(f.read())
    assert (summary["status"], summary["reason"], summary["steps"]) == ("stopped",
                                                                       "stopped by SIGTERM", 1)
    # stopped in epoch 0 of train.epochs=1: no limit ended it, no epoch is counted done (every
    # one was, as if train.epochs had ended it)
    assert "ended_by" not in summary and summary["epochs_completed"] == 0
    assert attempts[-1]["end"]["cause"] == "stopped"

    exiting = subprocess.run(  # the driver's exit: the upload, then the line, then 143
        [sys.executable, "-c",
         "from elastic_train import api\n"
         "def upload(): print('uploading', flush=True)\n"
         "api._end_without_cluster('SIGTERM', ': summary.json written', upload=upload)\n"],
        capture_output=True, text=True, timeout=120)
    assert exiting.returncode == 143, exiting.stderr
    assert exiting.stdout == "uploading\n"
    assert exiting.stderr.strip() == ("stopped by SIGTERM; the local Ray cluster went down with "
                                      "the driver: summary.json written and uploaded")


def test_a_run_that_ended_its_epochs_on_a_periodic_checkpoint_is_finished(tmp_path):
    """train.epochs ended the run right after a periodic checkpoint of the epoch's last step:
    that checkpoint says epoch 1 (the loop found the epoch over only after it), and summary.json
    says the run ended by train.epochs after 2: the run is finished (it started Ray again,
    replayed the final evaluation and rewrote summary.json)."""
    import torch

    from elastic_train.preflight.finished import finished_run
    from elastic_train.training.checkpoint import snapshot, write_checkpoint

    cfg = load_config(None, [f"run.storage_path={tmp_path}", "run.name=r", "train.epochs=2",
                             "train.max_steps=1000"])
    model = torch.nn.Linear(2, 2)
    snap = snapshot(model, torch.optim.SGD(model.parameters(), lr=0.1), None,
                    {"step": 44, "epoch": 1, "step_in_epoch": 22}, cfg.to_dict(), world_size=1)
    write_checkpoint(snap, tmp_path / "r" / "checkpoint_000000044")
    summary = {"status": "finished", "steps": 44, "ended_by": "train.epochs", "epochs_completed": 2}
    (tmp_path / "r" / "summary.json").write_text(json.dumps(summary))
    done = finished_run(cfg)
    assert done is not None and done["checkpoint"] == "checkpoint_000000044"
    assert done["checkpoint_epoch"] == 2
    more = load_config(None, [f"run.storage_path={tmp_path}", "run.name=r", "train.epochs=3",
                              "train.max_steps=1000"])
    assert finished_run(more) is None  # a third epoch trains on


def test_ctrl_c_before_a_run_begins_is_one_line_and_130():
    """Ctrl-C while train's checks run (a long lease watch, a slow store, a first prepare of the
    default corpus): one line and 130, as a stop during the run (a traceback and 1 before, the
    status of a failed run)."""
    import subprocess

    code = ("import os, signal, time\n"
            "from elastic_train import api, cli\n"
            # as in a terminal: a background job (CI's runner) inherits SIGINT ignored
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "def interrupted(*args, **kwargs):\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(60)  # a slow check: the KeyboardInterrupt comes here\n"
            "api.check_inputs = interrupted\n"
            "raise SystemExit(cli.main(['train', 'train.max_steps=1']))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "stopped: stopped by SIGINT during train"
    assert "Traceback" not in done.stderr


def test_a_remote_run_folder_gets_whole_files_only_and_its_summary_last(tmp_path):
    """The staging copy's upload: no `*.tmp` (a file being written, renamed when whole: it left
    stray objects or failed the sync when renamed mid-copy), no staged `*.pending`, no link
    (W&B's latest-run: its run was uploaded twice), and summary.json after the logs it sums up
    (report takes a summary older than metrics.jsonl for a stale one)."""
    from elastic_train.observe.runfolder import upload_copy

    store, _ = pafs.FileSystem.from_uri("mock:///runs")
    staging = tmp_path / "staging"
    (staging / "wandb" / "offline-run-1").mkdir(parents=True)
    (staging / "wandb" / "offline-run-1" / "run-1.wandb").write_text("w")
    (staging / "wandb" / "latest-run").symlink_to(staging / "wandb" / "offline-run-1")
    for name in ("summary.json", "metrics.jsonl", "attempts.json", "attempts.json.tmp",
                 "config.yaml.pending"):
        (staging / name).write_text(name)
    upload_copy(str(staging), store, "runs/r")
    listed = {i.path: i for i in store.get_file_info(pafs.FileSelector("runs/r", recursive=True))
              if i.type == pafs.FileType.File}
    assert sorted(listed) == ["runs/r/attempts.json", "runs/r/metrics.jsonl", "runs/r/summary.json",
                              "runs/r/wandb/offline-run-1/run-1.wandb"]
    assert all(listed["runs/r/summary.json"].mtime >= info.mtime for info in listed.values())


def test_a_uri_run_folder_keeps_the_stores_options_after_the_run_name(tmp_path):
    """An S3-compatible store named with its options (MinIO: endpoint_override, scheme, region):
    the run folder, and what lies in it, go before them; they were put after the options
    (`...&scheme=http/r`), where pyarrow took them for an option and the folder for the bucket's
    root on AWS."""
    from elastic_train.observe.runfolder import join_uri, run_uri

    store = "s3://bucket/runs?endpoint_override=minio:9000&scheme=http"
    cfg = load_config(None, [f"run.storage_path={store}", "run.name=r"])
    assert run_uri(cfg) == "s3://bucket/runs/r?endpoint_override=minio:9000&scheme=http"
    assert join_uri(run_uri(cfg), "compile_cache", "x") == (
        "s3://bucket/runs/r/compile_cache/x?endpoint_override=minio:9000&scheme=http")
    assert join_uri("s3://bucket/runs/", "r") == "s3://bucket/runs/r"
    assert join_uri("/data/runs?odd", "r") == "/data/runs?odd/r"  # a local name may hold a '?'
    local = load_config(None, [f"run.storage_path={tmp_path}/", "run.name=r"])
    assert run_uri(local) == f"{tmp_path}/r"


def test_a_remote_run_folders_uploads_send_only_the_files_that_changed(tmp_path, monkeypatch):
    """Every upload of the staging copy (every 10 s while a run trains) sent every file again:
    ray.log, the config, the consumed ids of attempts long over. Now a file goes up when it was
    appended to, replaced or written since its last upload, or since a resume downloaded it;
    the others are left as the store has them (here, the store's copy of an unchanged file is
    deleted behind the RunFolder's back, so that a re-upload would show)."""
    from elastic_train.observe import runfolder

    store, _ = pafs.FileSystem.from_uri("mock:///runs")
    monkeypatch.setattr(runfolder, "split_uri", lambda uri: (store, "runs/r", False))
    store.create_dir("runs/r/consumed")
    for name, text in (("config.yaml", "run: {}\n"), ("metrics.jsonl", "{\"step\": 1}\n"),
                       ("consumed/rank0_attempt0.jsonl", "{}\n")):
        with store.open_output_stream(f"runs/r/{name}") as f:
            f.write(text.encode())

    def remote(name: str) -> str | None:
        if store.get_file_info(f"runs/r/{name}").type != pafs.FileType.File:
            return None
        with store.open_input_stream(f"runs/r/{name}") as f:
            return f.read().decode()

    folder = runfolder.RunFolder("mock:///runs/r")  # a resume: the folder is downloaded
    try:
        assert folder.resuming and (folder.local / "consumed" / "rank0_attempt0.jsonl").is_file()
        store.delete_file("runs/r/config.yaml")
        store.delete_file("runs/r/consumed/rank0_attempt0.jsonl")
        folder.accept()
        folder.append("metrics.jsonl", ['{"step": 2}'])
        folder.write("attempts.json", "[]")
        folder.sync()
        assert remote("metrics.jsonl") == '{"step": 1}\n{"step": 2}\n'
        assert remote("attempts.json") == "[]"
        assert remote("config.yaml") is None  # unchanged since the download: not sent again
        assert remote("consumed/rank0_attempt0.jsonl") is None
        store.delete_file("runs/r/attempts.json")
        folder.sync()
        assert remote("attempts.json") is None  # unchanged since its upload
        folder.write("attempts.json", "[1]")  # the same size, another file (os.replace)
        folder.write("config.yaml", "run: {name: r}\n")
        folder.sync()
        assert (remote("attempts.json"), remote("config.yaml")) == ("[1]", "run: {name: r}\n")
    finally:
        shutil.rmtree(folder.local, ignore_errors=True)


def test_a_large_growing_file_is_uploaded_less_often_while_the_run_trains(tmp_path, monkeypatch):
    """A store has no append: each upload sent metrics.jsonl whole (70 MB over a run of 100k
    steps, every 10 s). While the run trains, a file over PACED_BYTES waits the interval per
    PACED_BYTES it holds since its last upload; small files go as before, and the run's last
    upload (no pace) takes everything."""
    from elastic_train.observe import runfolder

    store, _ = pafs.FileSystem.from_uri("mock:///runs")
    monkeypatch.setattr(runfolder, "split_uri", lambda uri: (store, "runs/r", False))

    def remote_size(name: str) -> int:
        return store.get_file_info(f"runs/r/{name}").size

    folder = runfolder.RunFolder("mock:///runs/r")
    try:
        folder.accept()
        line = json.dumps({"step": 0, "loss": 1.0, "pad": "x" * 1000})
        folder.append("metrics.jsonl", [line] * (2 * runfolder.PACED_BYTES // len(line)))
        folder.write("attempts.json", "[]")
        folder.sync(pace_s=10)  # never uploaded: goes at once
        big = (folder.local / "metrics.jsonl").stat().st_size
        assert big > runfolder.PACED_BYTES and remote_size("metrics.jsonl") == big
        folder.append("metrics.jsonl", [line])
        folder.write("attempts.json", "[1]")
        folder.sync(pace_s=10)  # within 20 s of its upload: metrics.jsonl waits, the rest goes
        assert (remote_size("metrics.jsonl"), remote_size("attempts.json")) == (big, 3)
        folder._uploaded_at["metrics.jsonl"] -= 21  # as if 21 s had passed since
        folder.sync(pace_s=10)
        assert remote_size("metrics.jsonl") == big + len(line) + 1
        folder.append("metrics.jsonl", [line])
        folder.sync()  # the run's end
        assert remote_size("metrics.jsonl") == big + 2 * (len(line) + 1)
    finally:
        shutil.rmtree(folder.local, ignore_errors=True)
