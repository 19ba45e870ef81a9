"""How runs end, on real Ray: a run that cannot start says so in bounded time, a failure that
repeats without progress ends the run, a crash is one line of ours on the console and an `end` in
attempts.json, a finished run re-run changes no file, a stopped run releases what it held.

One local cluster for the module's in-process runs; the console tests run the installed command
in a subprocess (its own cluster, or this one by RAY_ADDRESS) to see what a user sees."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TINY
from test_bad_input import other_cluster  # noqa: F401 - fixture
from test_console import ray_info_lines

from elastic_train import load_config
from elastic_train.api import TrainingFailed, train
from elastic_train.cli import main
from elastic_train.cluster.console import RAY_LOG

pytestmark = pytest.mark.ray

BIN = Path(sys.executable).parent
DRIVER_PID = os.getpid()
OURS = re.compile(r"^(attempt \d+: )?(rank \d+|the worker group)( on node \S+)? failed")  # runwatch


def snapshot_files(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def events(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]


def wait_for(what: str, condition, timeout_s: float = 120.0, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)


def test_a_cluster_without_room_fails_at_once_naming_the_shortfall(ray_cluster, small_dataset,
                                                                   tmp_path, capsys):
    """8 workers x 1 CPU on the module's 4-CPU cluster, which cannot grow: one error, before
    any worker or run folder, where Ray Train would wait forever."""
    started = time.monotonic()
    code = main(["train", *TINY, f"data.path={small_dataset}", f"run.storage_path={tmp_path}",
                 "run.name=big", "scaling.min_workers=8", "scaling.max_workers=8",
                 "data.global_batch_tokens=8192"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1, errors
    assert "needs 8 workers x 1 CPU; the cluster has 4 CPU on 1 node, room for 4" in errors[0]
    assert time.monotonic() - started < 60
    assert not (tmp_path / "big").exists()


def test_a_run_folder_another_driver_runs_on_this_cluster_is_refused(ray_cluster, small_dataset,
                                                                     tmp_path, capsys, monkeypatch):
    """A remote store has no file locks: there the RunLog actor, named after the run folder,
    is what a second driver of the folder on the same cluster meets. Another driver's RunLog
    of the folder is alive: this run is one error naming the folder, and writes nothing."""
    import ray

    from elastic_train.cluster import driver

    overrides = [*TINY, f"data.path={small_dataset}", f"run.storage_path={tmp_path}",
                 "run.name=twice"]
    monkeypatch.setattr(driver, "RUNLOG_NAME_WAIT_S", 1.0)
    first = driver.start_runlog(load_config(None, overrides))  # the other driver's
    try:
        ray.get(first.run_state.remote())
        code = main(["train", *overrides])
    finally:
        ray.kill(first)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1, errors
    assert errors[0] == (f"error: run folder {tmp_path}/twice is in use by another run on this "
                         "Ray cluster (its RunLog actor is alive): wait for it to end or stop it, "
                         "or give this one another run.name")
    assert sorted(p.name for p in (tmp_path / "twice").iterdir()) == []  # the other's RunLog made it


def fails_on_workers(vocab_size: int, max_seq_len: int, **kwargs):
    """A model that builds on the driver (its checks pass) and fails on every worker, the same
    way every time: what an import error on the workers looks like to Ray Train."""
    if os.getpid() != DRIVER_PID:
        raise ValueError("cannot load the layer library on this node")
    from elastic_train.config import ModelConfig
    from elastic_train.training.model import GPT

    return GPT(ModelConfig(n_layer=1, n_head=2, d_model=32), max_seq_len, vocab_size)


def test_the_same_failure_three_times_ends_the_run(ray_cluster, small_dataset, tmp_path, capsys):
    """Unlimited restarts (max_failures=-1): the same failure 3 times in a row without a step
    ends the run with that failure and the worker's traceback, instead of retrying forever."""
    cfg = load_config(None, [*TINY, f"data.path={small_dataset}", f"run.storage_path={tmp_path}",
                             "run.name=same", "scaling.max_failures=-1"])
    with pytest.raises(TrainingFailed, match="cannot load the layer library") as info:
        train(cfg, model_fn=fails_on_workers)
    assert info.value.summary["status"] == "failed"
    assert re.match(r"rank \d: FactoryError: model: model_fn fails_on_workers\(vocab_size, "
                    r"max_seq_len\) raised ValueError: cannot load the layer library",
                    info.value.summary["reason"])
    failures = [e for e in events(tmp_path / "same") if e["event"] == "failure"]
    assert [f["decision"] for f in failures] == ["retry", "retry", "give_up"]
    assert [f["repeats"] for f in failures] == [1, 2, 3]
    err = capsys.readouterr().err
    ours = [line for line in err.splitlines() if OURS.match(line)]
    assert len(ours) == 3 and ours[-1].endswith("(3 times in a row without a step); giving up"), err
    assert re.search(r"the failing worker's error \(rank \d\):\nTraceback", err), err[-3000:]


def _console(*args: str, cwd: Path, env: dict | None = None) -> subprocess.Popen:
    env = env or {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.Popen([str(BIN / "elastic-train"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env)


@pytest.mark.timeout(500)
def test_a_crash_is_one_line_of_ours_and_a_rerun_changes_nothing(other_cluster, small_dataset,  # noqa: F811
                                                                tmp_path, capsys, request):
    """The real console of the command a user runs, with another Ray cluster on the machine
    (`other_cluster`: the run starts its own local cluster and no process of it looks the other
    one up), whose rank 1 dies hard at step 8: progress lines and one line of ours naming rank,
    node, cause, step and the checkpoint it resumed from, with none of Ray's INFO lines or
    tracebacks (kept in the run folder's ray.log); attempts.json ends attempt 0 with the same.
    Then the same command again: the run is finished, it says how to go on, and no file of the
    run folder changes. Then a resume for more steps from a checkpoint whose data cursors were
    edited by hand, which only the workers can refuse (they read the data): one `error:` line
    naming the checkpoint, and again no file changes (the new config.yaml waits, pending, until
    an attempt begins; summary.json stays "finished")."""
    argv = ["train", *TINY, f"data.path={small_dataset}", f"run.storage_path={tmp_path}",
            "run.name=crash", "train.max_steps=14", "checkpoint.every_steps=4",
            "fault.crash_at_step=8", "fault.crash_rank=1", "log.progress=lines",
            "log.print_every_steps=5",
            "scaling.worker_group_start_timeout_s=300"]  # on a busy machine a slow start is no failure
    proc = _console(*argv, cwd=tmp_path)
    out, _ = proc.communicate(timeout=360)
    assert proc.returncode == 0, out[-4000:]
    ours = [line for line in out.splitlines() if OURS.match(line)]
    assert len(ours) == 1, out[-4000:]
    assert ours[0].startswith("attempt 0: rank 1 on node ") and "its process died" in ours[0]
    # the line waits up to RESUME_LINE_WAIT_S for the next attempt's size (a loaded machine
    # restarts slower): then it says where it restarts from instead
    assert re.search(r"; (resumed from the checkpoint of step \d+ with 2 workers|restarting from "
                     r"the checkpoint of step \d+)$", ours[0]), ours[0]
    for noise in ("Traceback", "A worker died or was killed", "Token authentication",
                  "Found multiple active Ray instances", "Failed to register placement group"):
        assert noise not in out, out[-4000:]
    assert ray_info_lines(out) == [], out
    # progress lines (polled: which steps they show depends on timing), then the end line
    assert re.search(r"^step \d+/14 epoch 0 loss [\d.]+ .* workers 2 ", out, re.M), out
    assert "finished: 14 steps" in out
    folder = tmp_path / "crash"
    end = json.loads((folder / "attempts.json").read_text())[0]["end"]
    assert end["rank"] == 1 and end["node"] and end["step"] == 8 and end["committed_step"] <= 8
    ray_log = (folder / RAY_LOG).read_text()
    assert "Traceback" in ray_log  # Ray's reports are kept there
    assert "Started a local Ray instance" in ray_log and "Reporting training result" in ray_log
    # the local cluster runs without the dashboard, so without Ray's placement-group cleaner,
    # which would warn every second that it cannot reach the state API
    assert "Failed to query Ray Train Controller" not in out + ray_log
    summary = json.loads((folder / "summary.json").read_text())
    assert (summary["restarts"], summary["resumes"]) == (1, 0)
    # run.train_first: the RunLog, Ray's controller and daemons yielded the CPU (cpushare.py)
    events = [json.loads(x) for x in (folder / "events.jsonl").read_text().splitlines()]
    share = [e for e in events if e["event"] == "cpu_share"][0]
    assert share["helpers"] >= 5, share  # GCS, raylet, dashboard, agents, controller, RunLog...
    # both workers of each attempt (raised only where the user may: root)
    assert share["training"] == (2 * (1 + summary["restarts"]) if os.geteuid() == 0 else 0), share

    before = snapshot_files(folder)
    again = _console(*argv, cwd=tmp_path)
    out, _ = again.communicate(timeout=120)
    assert again.returncode == 0, out[-3000:]
    assert "run crash already finished at step 14" in out and "train.max_steps=28" in out
    assert snapshot_files(folder) == before

    checkpoint = max(p for p in folder.glob("checkpoint_0*") if p.is_dir())
    edit_cursor(checkpoint)
    before = snapshot_files(folder)
    request.getfixturevalue("ray_cluster")  # the module's, now: no start of its own
    capsys.readouterr()
    code = main([*argv, "train.max_steps=28"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1, errors
    assert f"checkpoint {checkpoint.name}: data partition" in errors[0], errors
    changed = {k for k in before.keys() | snapshot_files(folder).keys()
               if before.get(k) != snapshot_files(folder).get(k)}
    assert not changed, sorted(changed)


def edit_cursor(checkpoint: Path) -> None:
    """Move one data cursor of a checkpoint by one micro-batch, as a hand edit would (its
    manifest follows, so the checkpoint still counts as complete)."""
    state_file = checkpoint / "state.json"
    state = json.loads(state_file.read_text())
    cursors = state["train_state"]["cursors"]
    assert cursors, "the checkpoint is at an epoch's end: nothing to edit"
    cursors[min(cursors)][1] += 1
    state_file.write_text(json.dumps(state))
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"]["state.json"] = state_file.stat().st_size
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def _held(run_ids_before: set[str]) -> tuple[list[str], list[str]]:
    """Requests at Ray's autoscaling coordinator and placement groups not removed, beyond those
    held before."""
    import ray.util

    from elastic_train.cluster.runwatch import open_requests

    requests = [r for r in open_requests() if r not in run_ids_before]
    groups = [pg_id for pg_id, pg in ray.util.placement_group_table().items()
              if pg["state"] != "REMOVED" and pg_id not in run_ids_before]
    return requests, groups


@pytest.mark.timeout(300)
def test_sigterm_to_the_drivers_whole_group_ends_a_local_run_stopped_at_once(small_dataset, tmp_path):
    """`timeout`, systemd, Slurm and `kill -- -PGID` send SIGTERM to every process of the
    driver's group, its local Ray cluster's too, which goes down at once: the driver (which
    waited 60 s for a GCS that was gone, then died with no summary) ends the run itself from
    the run folder: summary.json "stopped" with its steps, the attempt ended, exit 143, and none
    of the cluster's processes left."""
    import psutil

    proc = subprocess.Popen(
        [str(BIN / "elastic-train"), "train", *TINY, f"data.path={small_dataset}",
         f"run.storage_path={tmp_path}", "run.name=group", "train.max_steps=100000",
         "train.epochs=1000", "checkpoint.every_steps=20"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, start_new_session=True)
    metrics = tmp_path / "group" / "metrics.jsonl"
    try:
        wait_for("the first steps", lambda: metrics.is_file() and metrics.read_text().count("\n") >= 3)
        group = [p for p in psutil.process_iter() if _in_group(p, proc.pid)]
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=45)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert out.strip().splitlines()[-1] == ("stopped by SIGTERM; the local Ray cluster went down "
                                            "with the driver: summary.json written from the run folder")
    summary = json.loads((tmp_path / "group" / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["steps"] >= 3, summary
    attempts = json.loads((tmp_path / "group" / "attempts.json").read_text())
    assert attempts[-1]["end"]["cause"] == "stopped"
    _, alive = psutil.wait_procs(group, timeout=30)
    assert not alive, [p.name() for p in alive]


def _in_group(process, pgid: int) -> bool:
    try:
        return os.getpgid(process.pid) == pgid
    except (ProcessLookupError, PermissionError):
        return False


@pytest.mark.timeout(300)
def test_a_stopped_run_writes_its_summary_and_releases_what_it_held(ray_cluster, small_dataset,
                                                                    tmp_path):
    """SIGTERM (what `ray job stop` sends) to a driver on this cluster, mid-run: summary.json says
    "stopped" with the steps so far, and neither its placement group nor its resource request
    at Ray's autoscaling coordinator outlives it (left there, that request kept the next run on a
    2-CPU head waiting 136-158 s)."""
    import ray

    requests, groups = _held(set())
    held_before = set(requests) | set(groups)
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    proc = _console("train", *TINY, f"data.path={small_dataset}", f"run.storage_path={tmp_path}",
                    "run.name=stop", "train.max_steps=100000", "train.epochs=1000",
                    "checkpoint.every_steps=20", cwd=tmp_path, env=env)
    metrics = tmp_path / "stop" / "metrics.jsonl"
    try:
        wait_for("the first step", lambda: metrics.is_file() and metrics.read_text().strip())
        assert _held(held_before) != ([], []), "the running run holds nothing?"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    summary = json.loads((tmp_path / "stop" / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["steps"] >= 1
    assert json.loads((tmp_path / "stop" / "attempts.json").read_text())[-1]["end"]["cause"] == "stopped"
    # the workers stopped before the summary was taken: no step trained after it
    trained = [r["step"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    assert max(trained) == summary["steps"], (max(trained), summary["steps"])
    wait_for("the run's placement group and resource request gone",
             lambda: _held(held_before) == ([], []), timeout_s=30)


def test_a_lost_controller_fails_the_run_with_its_summary(ray_cluster, small_dataset, tmp_path):
    """Ray Train's controller process killed mid-run (an OOM killer, a raylet restart): the fit
    raised Ray's ActorDiedError through the API as a traceback, and summary.json was never
    written. Now the run fails as any other, with its reason and summary.json "failed"."""
    import threading

    import psutil

    cfg = load_config(None, [*TINY, f"data.path={small_dataset}", f"run.storage_path={tmp_path}",
                             "run.name=lost", "train.max_steps=300", "checkpoint.every_steps=1"])
    run = tmp_path / "lost"

    import ray

    # this cluster's raylet: its worker processes are its children (another test module's
    # cluster, on the other pytest worker, runs controllers of its own)
    raylet = ray._private.worker._global_node.all_processes["raylet"][0].process.pid

    def kill_the_controller() -> None:
        deadline = time.monotonic() + 600
        while not list(run.glob("checkpoint_*")) and time.monotonic() < deadline:
            time.sleep(0.2)  # polls for the event: the first checkpoint written
        for process in psutil.Process(raylet).children(recursive=True):
            if any("ray::TrainController" in part for part in process.cmdline()):
                process.kill()

    killer = threading.Thread(target=kill_the_controller, daemon=True)
    killer.start()
    with pytest.raises(TrainingFailed, match="Ray Train's controller was lost") as info:
        train(cfg)
    killer.join()
    assert info.value.summary["status"] == "failed"
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"


def test_a_failed_last_upload_of_a_remote_run_folder_is_one_error_naming_its_staging_copy(
        ray_cluster, tmp_path, capsys, monkeypatch):
    """The run's end: its remote run folder's last upload fails (the store has a file where the
    folder goes). The fit raises UploadFailed, one line naming the folder, the store's error and
    the staging copy, which holds every file (summary.json too); the command line prints it as
    one `error:` line, exit status 1. It was a traceback of Ray's."""
    import ray

    from elastic_train import cli
    from elastic_train.api import UploadFailed, _settle
    from elastic_train.cluster.runlog import RunLog

    uri = "mock:///runs/upload"  # pyarrow's in-memory store, in the RunLog's own process
    runlog = RunLog.remote(uri)
    try:
        ray.get(runlog.begin_attempt.remote(2))
        staging = ray.get(runlog.local_folder.remote())

        def refuse(self) -> None:  # a file where the run folder goes: every upload fails
            fs = self.folder.fs
            fs.delete_dir_contents("/runs", missing_dir_ok=True)
            fs.create_dir("/runs")
            with fs.open_output_stream(self.folder.remote_path) as f:
                f.write(b"not a folder")

        ray.get(runlog.__ray_call__.remote(refuse))
        summary = {"status": "finished", "steps": 3}
        with pytest.raises(UploadFailed) as raised:
            _settle(runlog, None, summary)
    finally:
        ray.kill(runlog)
    message = str(raised.value)
    assert message.startswith(f"uploading run folder {uri} failed (") and "\n" not in message
    assert message.endswith(f"every file is in its staging copy {staging}: copy them there once "
                            "the store answers")
    assert json.loads((Path(staging) / "summary.json").read_text()) == summary
    shutil.rmtree(staging)  # what a user copies to the store once it answers

    def train_that_ends_so(args) -> int:  # the command's train, ending as the fit above did
        raise raised.value

    monkeypatch.setattr(cli, "_train", train_that_ends_so)
    assert cli.main(["train"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: the run finished, but {message}"]
