"""Tracked runs without Ray: the effective-step rule, and the Tracker against a real MLflow file
store, a real W&B offline run and a tracking server that refuses connections."""

from __future__ import annotations

import functools
import json
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from elastic_train import load_config
from elastic_train.cli import main
from elastic_train.config import ConfigError
from elastic_train.observe.tracking import EffectiveSteps, Tracker, build_backends, flatten
from elastic_train.preflight.packages import check_packages, needed_packages

pytestmark = pytest.mark.unit


def rec(attempt: int, step: int, loss: float, **more: Any) -> dict[str, Any]:
    return {"attempt": attempt, "step": step, "loss": loss, "world_size": 2, "time": 1.0, **more}


def test_a_step_is_held_until_a_checkpoint_covers_it_then_logged_once():
    steps = EffectiveSteps()
    for s in range(1, 6):
        steps.add("step", rec(0, s, 10.0 - s))
    assert steps.release(3) == [(s, {"attempt": 0.0, "loss": 10.0 - s, "world_size": 2.0})
                                                   for s in (1, 2, 3)]
    assert steps.release(3) == []  # nothing twice
    steps.add("step", rec(0, 2, 99.0))  # late: step 2 was logged, a tracker cannot take it back
    assert [s for s, _ in steps.release(None)] == [4, 5]


def test_a_replayed_step_is_the_latest_attempts_and_the_crashed_attempts_later_steps_are_dropped():
    steps = EffectiveSteps()
    for s in range(1, 11):  # attempt 0 crashes after step 10; the checkpoint of step 8 is committed
        steps.add("step", rec(0, s, 100.0 + s))
    steps.add("eval", {"attempt": 0, "step": 10, "eval_loss": 7.0, "time": 1.0})
    assert [s for s, _ in steps.release(8)] == list(range(1, 9))
    steps.add("step", rec(1, 9, 200.0 + 9))  # attempt 1 resumes from 8
    released = dict(steps.release(None))
    assert released == {9: {"attempt": 1.0, "loss": 209.0, "world_size": 2.0}}  # 10 and its eval: gone
    steps.add("step", rec(1, 10, 210.0))
    steps.add("eval", {"attempt": 1, "step": 10, "eval_loss": 6.0, "time": 2.0})
    assert dict(steps.release(None)) == {10: {"attempt": 1.0, "loss": 210.0, "world_size": 2.0,
                                              "eval_loss": 6.0}}


def test_a_record_of_an_older_attempt_that_arrives_late_never_replaces_the_newer_one():
    steps = EffectiveSteps()
    steps.add("step", rec(1, 5, 1.0))
    steps.add("step", rec(0, 5, 2.0))
    steps.add("step", rec(0, 6, 3.0))  # attempt 0 went further, but attempt 1 began at 5
    assert dict(steps.release(None)) == {5: {"attempt": 1.0, "loss": 1.0, "world_size": 2.0}}


def test_released_steps_survive_a_new_driver():
    steps = EffectiveSteps({"step": 4, "eval": -1})
    steps.add("step", rec(2, 4, 1.0))
    steps.add("step", rec(2, 5, 1.0))
    assert [s for s, _ in steps.release(None)] == [5]


class FakeBackend:
    """A tracking service that keeps what it was sent."""

    name, target = "fake", "memory"

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    def open(self, run_id: str | None, run_name: str, params: dict[str, Any]) -> str:
        return "run1"

    def log(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        self.rows += rows

    def tag(self, tags: dict[str, str]) -> None:
        pass

    def finish(self, summary: dict[str, Any], files: list[Path]) -> None:
        pass


def fake_tracker(folder: Path, committed: Any) -> tuple[Tracker, FakeBackend]:
    backend = FakeBackend()
    return Tracker(lambda: [backend], folder, "run1", {}, committed, lambda m: None, poll_s=0.01), backend


def unreadable() -> int:
    raise RuntimeError("checkpoint_manager_snapshot.json: not valid JSON after 50 reads")


@pytest.mark.parametrize("committed", [lambda: None, unreadable], ids=["none_yet", "unreadable"])
def test_nothing_is_released_before_a_commit_or_when_the_snapshot_cannot_be_read(tmp_path, committed):
    # attempt 0 logs 1..5 and crashes with nothing committed (or in place: Ray commits nothing
    # until the end); attempt 1 replays from the start. Polls in between release nothing.
    tracker, backend = fake_tracker(tmp_path, committed)
    for s in range(1, 6):
        tracker.add("step", rec(0, s, 100.0 + s))
    time.sleep(0.3)  # many polls
    assert backend.rows == []
    for s in range(1, 8):
        tracker.add("step", rec(1, s, 200.0 + s))
    assert tracker.finish({"status": "finished", "steps": 7}, timeout_s=10)
    assert [(s, f["attempt"], f["loss"]) for s, f in backend.rows] == [
        (s, 1.0, 200.0 + s) for s in range(1, 8)]


def test_an_evaluation_after_its_step_joins_the_steps_row(tmp_path):
    tracker, backend = fake_tracker(tmp_path, lambda: None)
    tracker.add("step", rec(0, 10, 1.5, epoch=0))
    time.sleep(0.3)  # the evaluation after step 10 takes a moment; polls go by
    tracker.add("eval", {"attempt": 0, "step": 10, "epoch": 1, "eval_loss": 1.7, "time": 1.0})
    assert tracker.finish({"status": "finished", "steps": 10}, timeout_s=10)
    assert backend.rows == [(10, {"attempt": 0.0, "loss": 1.5, "world_size": 2.0, "epoch": 1.0,
                                  "eval_loss": 1.7})]


def test_a_poll_that_cannot_read_the_snapshot_waits_for_one_that_can(tmp_path):
    reads = {"n": 0}

    def committed() -> int:
        reads["n"] += 1
        if reads["n"] <= 3:
            raise RuntimeError("half written")
        return 3

    tracker, backend = fake_tracker(tmp_path, committed)
    for s in range(1, 6):
        tracker.add("step", rec(0, s, 10.0 + s))
    deadline = time.monotonic() + 10
    while len(backend.rows) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [s for s, _ in backend.rows] == [1, 2, 3] and reads["n"] > 3
    assert tracker.finish({"status": "finished", "steps": 5}, timeout_s=10)
    assert [s for s, _ in backend.rows] == [1, 2, 3, 4, 5]


def test_the_config_becomes_dotted_parameters():
    assert flatten({"train": {"max_steps": 8, "lr": None}, "model": {"kwargs": {}, "mods": ["a"]}}) == {
        "train.max_steps": "8", "train.lr": "None", "model.kwargs": "{}", "model.mods": '["a"]'}


def test_preflight_names_the_tracking_packages(monkeypatch, capsys, tmp_path):
    cfg = load_config(None, ["log.mlflow=file:///tmp/x", "log.wandb=proj"])
    needs = {n.setting: n.module for n in needed_packages(cfg)}
    assert needs["log.mlflow"] == "mlflow" and needs["log.wandb"] == "wandb"
    assert not [n for n in needed_packages(load_config(None, [])) if n.setting.startswith("log.")]
    monkeypatch.setitem(sys.modules, "wandb", None)  # what a missing package looks like to import
    with pytest.raises(ConfigError, match=r"log.wandb needs the package 'wandb'.*'\.\[track\]'"):
        check_packages(cfg)
    code = main(["train", "log.wandb=proj", f"run.storage_path={tmp_path}"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "'wandb'" in errors[0], errors
    assert list(tmp_path.iterdir()) == []  # refused before Ray started or anything was written


def feed(tracker: Tracker, folder: Path, committed: list[int | None]) -> None:
    """Attempt 0 logs 1..6 and crashes after the checkpoint of step 4; attempt 1 replays 5..8."""
    lines = []
    tracker.attempt(0, 2)
    for s in range(1, 7):
        lines.append(rec(0, s, 10.0 + s))
        tracker.add("step", lines[-1])
    committed[0] = 4
    tracker.attempt(1, 1)
    for s in range(5, 9):
        lines.append(rec(1, s, 20.0 + s, world_size=1))
        tracker.add("step", lines[-1])
    extra = {"step_time_s": 0.1, "data_wait_s": 0.0, "real_tokens": 100, "padded_tokens": 120,
             "tokens_per_s": 1000.0}  # what the report needs to draw a record
    (folder / "metrics.jsonl").write_text("".join(json.dumps({**r, **extra, "time": 1.0 + i}) + "\n"
                                                  for i, r in enumerate(lines)))


def make_tracker(folder: Path, mlflow: str | None, wandb: str | None, warnings: list[str],
                 committed: list[int | None]) -> Tracker:
    return Tracker(functools.partial(build_backends, mlflow, wandb, folder), folder, "run1",
                   {"train": {"max_steps": 8}}, lambda: committed[0], warnings.append, poll_s=0.05)


def test_mlflow_file_store_gets_every_step_once_and_a_resume_continues_the_run(tmp_path):
    from mlflow.tracking import MlflowClient

    folder, uri, warnings, committed = tmp_path / "run", f"file://{tmp_path}/mlruns", [], [None]
    folder.mkdir()
    tracker = make_tracker(folder, uri, None, warnings, committed)
    feed(tracker, folder, committed)
    assert tracker.finish({"status": "failed", "steps": 8, "final_loss": 28.0})
    assert not warnings
    state = json.loads((folder / "tracking.json").read_text())
    client = MlflowClient(uri)
    history = [(m.step, m.value) for m in client.get_metric_history(state["mlflow"], "loss")]
    assert history == [(1, 11.0), (2, 12.0), (3, 13.0), (4, 14.0), (5, 25.0), (6, 26.0), (7, 27.0),
                       (8, 28.0)]
    run = client.get_run(state["mlflow"])
    assert run.info.status == "FAILED" and run.data.params["train.max_steps"] == "8"
    assert (run.data.tags["attempt"], run.data.tags["world_size"]) == ("1", "1")
    assert {a.path for a in client.list_artifacts(state["mlflow"])} >= {"loss.png", "throughput.png"}
    # a new driver resumes: the same tracked run, steps after those it logged
    tracker = make_tracker(folder, uri, None, warnings, [None])
    tracker.add("step", rec(2, 8, 99.0))
    tracker.add("step", rec(2, 9, 29.0))
    assert tracker.finish({"status": "finished", "steps": 9, "final_loss": 29.0})
    assert json.loads((folder / "tracking.json").read_text())["mlflow"] == state["mlflow"]
    history = [(m.step, m.value) for m in client.get_metric_history(state["mlflow"], "loss")]
    assert history[-2:] == [(8, 28.0), (9, 29.0)]
    assert client.get_run(state["mlflow"]).info.status == "FINISHED"
    assert client.get_run(state["mlflow"]).data.metrics["summary/final_loss"] == 29.0
    assert not warnings


def read_wandb_records(path: Path) -> list[Any]:
    """The records of a W&B offline run file (`run-<id>.wandb`): W&B's LevelDB-style log of
    protobuf records (a 7-byte file header ':W&B', then 32 KiB blocks of records, each with a
    7-byte header: checksum, length, type full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, parts, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            out.append(record)
    return out


def item_key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def wandb_run(folder: Path, name: str = "offline-run-*") -> dict[str, Any]:
    """The offline run's history rows, summary and saved files (run folder `folder`, W&B's
    folder of the run `name`: the only one by default)."""
    (run_file,) = folder.glob(f"wandb/{name}/run-*.wandb")
    history, summary, files = [], {}, []
    for r in read_wandb_records(run_file):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            history.append({item_key(i): json.loads(i.value_json) for i in r.history.item})
        elif kind == "summary":
            summary.update({item_key(i): json.loads(i.value_json) for i in r.summary.update})
        elif kind == "files":
            files += [f.path for f in r.files.files]
    return {"history": history, "summary": summary, "files": files, "dir": run_file.parent}


def test_wandb_offline_gets_every_step_once(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    folder, warnings, committed = tmp_path / "run", [], [None]
    folder.mkdir()
    tracker = make_tracker(folder, None, "proj", warnings, committed)
    feed(tracker, folder, committed)
    assert tracker.finish({"status": "finished", "steps": 8, "final_loss": 28.0})
    assert not warnings
    run = wandb_run(folder)
    assert [(h["step"], h["loss"]) for h in run["history"]] == [
        (1, 11.0), (2, 12.0), (3, 13.0), (4, 14.0), (5, 25.0), (6, 26.0), (7, 27.0), (8, 28.0)]
    assert run["summary"]["final_loss"] == 28.0 and run["summary"]["status"] == "finished"
    assert {"loss.png", "throughput.png"} <= set(run["files"])
    assert (run["dir"] / "files" / "loss.png").is_file()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_that_refuses_connections_costs_one_warning_and_never_blocks_the_caller(tmp_path):
    folder, warnings, committed = tmp_path / "run", [], [None]
    folder.mkdir()
    tracker = make_tracker(folder, f"http://127.0.0.1:{closed_port()}", None, warnings, committed)
    start = time.monotonic()
    feed(tracker, folder, committed)
    assert time.monotonic() - start < 0.5  # the caller only queues
    assert tracker.finish({"status": "finished", "steps": 8})
    assert len(warnings) == 1 and "mlflow" in warnings[0] and "run goes on" in warnings[0], warnings
