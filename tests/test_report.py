"""Tests for `elastic-train report`: a synthetic run folder (unit), and a real run with a crash (ray)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from matplotlib.image import imread

from elastic_train.cli import main
from elastic_train.observe.report import find_marks, make_report
from elastic_train.observe.summary import build_summary

LEDGER_PARTS = ("startup_s", "productive_s", "recovery_s", "replayed_s", "checkpoint_s",
                "data_wait_s", "shutdown_s", "other_s")


def _record(step: int, attempt: int, world_size: int, end: float, loss: float) -> dict:
    step_time_s, real, padded = 1.0 / world_size * 2, 15000, 15600
    return {"step": step, "epoch": 0, "time": end, "attempt": attempt, "world_size": world_size,
            "loss": loss, "lr": 1e-3, "grad_norm": 1.5, "real_tokens": real,
            "padded_tokens": padded, "step_time_s": step_time_s, "data_wait_s": 0.05,
            "forward_backward_s": step_time_s - 0.1, "optimizer_s": 0.02,
            "tokens_per_s": real / step_time_s, "mfu": 0.02, "rss_bytes": 6e8, "skipped": False,
            "micro_batches": 8, "skipped_steps": 0}


def write_run(folder: Path) -> dict:
    """A run that crashed after step 7 (2 workers) and resumed from the step-5 checkpoint on 1
    worker, up to step 12; returns its summary.json."""
    folder.mkdir(parents=True)
    fit_start = time.time() - 60.0
    records, events = [], [{"time": fit_start, "event": "fit_start"}]
    t = fit_start + 10.0  # start-up
    attempts = [{"attempt": 0, "world_size": 2, "start_time": t}]
    for step in range(1, 8):
        t += 1.0
        records.append(_record(step, 0, 2, t, 5.5 - 0.2 * step))
        if step == 5:
            events.append({"time": t + 0.1, "event": "checkpoint", "step": 5, "blocked_s": 0.1,
                           "final": False})
            t += 0.1
    t += 12.0  # the crash, detection and a new worker group
    attempts.append({"attempt": 1, "world_size": 1, "start_time": t - 0.5})
    for step in range(6, 13):
        t += 2.0
        records.append(_record(step, 1, 1, t, 5.5 - 0.2 * step + 0.03))
    events.append({"time": t + 0.3, "event": "checkpoint", "step": 12, "blocked_s": 0.3,
                   "final": True})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (folder / "attempts.json").write_text(json.dumps(attempts))
    summary = build_summary(folder, start_time=fit_start)
    (folder / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def check_png(path: Path) -> None:
    image = imread(path)
    assert image.shape[0] >= 400 and image.shape[1] >= 800, image.shape
    assert image.std() > 0.01  # something is drawn


@pytest.mark.unit
def test_report_synthetic_run(tmp_path, capsys):
    folder = tmp_path / "run"
    summary = write_run(folder)
    assert summary["restarts"] == 1 and summary["replayed_steps"] == 2

    assert main(["report", str(folder)]) == 0
    out = capsys.readouterr().out
    for text in ("finished", "12 (epochs", f"{summary['first_loss']:.4f}",
                 f"{summary['final_loss']:.4f}", "2 → 1", f"{summary['goodput']:.1%}",
                 "recovery", "replayed", "source: summary.json", "loss.png"):
        assert text in out, text
    check_png(folder / "loss.png")
    check_png(folder / "throughput.png")

    report = make_report(folder)
    assert [(m.kind, m.attempt, m.step, m.world_sizes) for m in report.loss_marks] == [
        ("resize", 1, 5, (2, 1))]
    assert report.throughput_marks == report.marks


@pytest.mark.unit
def test_report_without_summary(tmp_path, capsys):
    folder = tmp_path / "run"
    summary = write_run(folder)
    (folder / "summary.json").unlink()
    report = make_report(folder)
    computed = report.run.summary
    assert computed["status"] == "incomplete"
    assert computed["steps"] == 12 and computed["restarts"] == 1
    # It ends at the logs' last line (the final checkpoint event), not now.
    last_event = json.loads((folder / "events.jsonl").read_text().splitlines()[-1])
    first_event = json.loads((folder / "events.jsonl").read_text().splitlines()[0])
    assert computed["wall_s"] == pytest.approx(last_event["time"] - first_event["time"])
    assert computed["ledger"]["recovery_s"] == pytest.approx(summary["ledger"]["recovery_s"])
    assert sum(computed["ledger"][p] for p in LEDGER_PARTS) == pytest.approx(computed["wall_s"])
    assert "incomplete" in capsys.readouterr().out

    # A summary.json of an earlier fit (a resumed run going on) is recomputed too: told by the
    # time it says it was written, earlier than the new fit's records, whatever the files' times
    # (remote storage uploads the old summary again with the new logs: its object is newest).
    (folder / "summary.json").write_text(json.dumps(summary))
    assert make_report(folder).run.summary["status"] == "finished"
    resumed = _record(13, 2, 1, summary["written_at"] + 30.0, 3.0)
    with (folder / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(resumed) + "\n")
    os.utime(folder / "metrics.jsonl", (summary["written_at"],) * 2)  # as if uploaded first
    assert make_report(folder).run.summary["status"] == "incomplete"
    # one written before summary.json said when: the files' times decide
    (folder / "summary.json").write_text(json.dumps({k: v for k, v in summary.items()
                                                     if k != "written_at"}))
    old = time.time() - 100
    os.utime(folder / "summary.json", (old, old))
    os.utime(folder / "metrics.jsonl")
    assert make_report(folder).run.summary["status"] == "incomplete"


@pytest.mark.unit
def test_report_missing_metrics(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert main(["report", str(tmp_path / "absent")]) == 2
    assert "error: " in capsys.readouterr().err


@pytest.mark.unit
def test_find_marks_restart_then_resize():
    records = [_record(s, a, w, 100.0 + 3 * i, 1.0) for i, (s, a, w) in enumerate(
        [(1, 0, 2), (2, 0, 2), (3, 0, 2), (3, 1, 2), (4, 1, 2), (5, 2, 3)])]
    attempts = [{"attempt": a, "world_size": w, "start_time": 99.0 + t}
                for a, w, t in [(0, 2, 0), (1, 2, 9), (2, 2, 40), (3, 3, 50)]]
    attempts[3]["attempt"] = 2  # attempts.json is right where metrics and it disagree
    attempts[2]["attempt"] = 3  # an attempt that died before logging a step: time only
    marks = find_marks(records, attempts)
    assert [(m.kind, m.attempt, m.step) for m in marks] == [
        ("restart", 1, 2), ("resize", 2, 4), ("resize", 3, None)]
    assert marks[1].world_sizes == (2, 3) and marks[2].world_sizes == (3, 2)
    assert marks[2].time == 139.0
    assert marks[0].label == "attempt 1: restart after step 3, resumed from step 2"
    assert marks[2].label == "attempt 3: resize 3→2 workers after step 5"


@pytest.mark.unit
def test_tensorboard_writer(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from elastic_train.observe.tb import TensorBoardWriter

    writer = TensorBoardWriter(tmp_path)
    records = [_record(s, 0, 2, 100.0 + s, 5.0 - 0.1 * s) for s in range(1, 5)]
    records += [_record(s, 1, 1, 110.0 + s, 4.0 - 0.1 * s) for s in range(3, 6)]
    records[1]["grad_norm"] = float("inf")  # a skipped step
    for rec in records:
        writer.write(rec)
    writer.close()
    assert sorted(p.name for p in (tmp_path / "tensorboard").iterdir()) == [
        "attempt_000", "attempt_001"]
    events = EventAccumulator(str(tmp_path / "tensorboard" / "attempt_001"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "lr", "tokens_per_s", "step_time_s", "world_size", "skipped"} <= tags
    assert not tags & {"step", "time", "attempt"}
    loss = events.Scalars("loss")
    assert [e.step for e in loss] == [3, 4, 5]
    assert loss[0].value == pytest.approx(3.7) and loss[0].wall_time == pytest.approx(113.0)
    first = EventAccumulator(str(tmp_path / "tensorboard" / "attempt_000"))
    first.Reload()
    assert [e.step for e in first.Scalars("grad_norm")] == [1, 3, 4]


@pytest.mark.unit
def test_report_of_a_run_folder_on_remote_storage(tmp_path, capsys, monkeypatch):
    """An s3:// run folder (pyarrow's in-memory mock:// store standing in) is read through a
    local copy; its PNGs go into --output, or ./<name>-report/ in the current folder."""
    import pyarrow.fs as pafs

    from elastic_train.observe import runfolder

    store, _ = pafs.FileSystem.from_uri("mock:///runs")
    monkeypatch.setattr(runfolder, "split_uri",
                        lambda uri: (store, uri.split("://", 1)[1].strip("/"), False))
    summary = write_run(tmp_path / "r")
    store.create_dir("runs/r")
    pafs.copy_files(str(tmp_path / "r"), "runs/r", source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=store)
    assert main(["report", "mock:///runs/r", "--output", str(tmp_path / "figures")]) == 0
    out = capsys.readouterr().out
    assert "source: summary.json" in out and f"{summary['goodput']:.1%}" in out
    check_png(tmp_path / "figures" / "loss.png")
    check_png(tmp_path / "figures" / "throughput.png")
    monkeypatch.chdir(tmp_path)
    assert main(["report", "mock:///runs/r"]) == 0
    assert "the run folder is remote" in capsys.readouterr().out
    check_png(tmp_path / "r-report" / "loss.png")

    assert main(["report", "mock:///runs/absent"]) == 2
    assert capsys.readouterr().err == "error: run folder 'mock:///runs/absent' does not exist\n"


@pytest.mark.unit
def test_report_that_cannot_write_its_figures_is_one_error_line(tmp_path, capsys):
    folder = tmp_path / "run"
    write_run(folder)
    (folder / "loss.png").mkdir()  # unwritable as a file, even for root
    assert main(["report", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write '{folder / 'loss.png'}'") and err.count("\n") == 1
    assert main(["report", str(folder), "--output", str(tmp_path / "figures")]) == 0
    check_png(tmp_path / "figures" / "loss.png")


@pytest.mark.unit
def test_report_of_a_summary_without_optional_figures(tmp_path, capsys):
    folder = tmp_path / "run"
    summary = write_run(folder)
    for key in ("goodput", "ledger", "world_sizes", "padding_efficiency"):
        summary.pop(key)
    (folder / "summary.json").write_text(json.dumps(summary))
    assert main(["report", str(folder)]) == 0
    check_png(folder / "throughput.png")


@pytest.mark.unit
def test_a_store_that_never_answers_is_given_up_on_with_one_line(monkeypatch, capsys):
    """A remote run folder whose store takes connections and never answers (a firewall that
    drops replies; GCS's client retrying for minutes): report, export and sample give up after
    the store timeout with one line, instead of hanging (a real S3 client against a local socket
    that never replies; the timeout shortened)."""
    import socket

    from elastic_train.observe import runfolder

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel accepts; nothing ever reads or replies
    port = silent.getsockname()[1]
    monkeypatch.setattr(runfolder, "STORE_TIMEOUT_S", 1.0)
    uri = f"s3://nobucket/runs/r?region=us-east-1&endpoint_override=127.0.0.1:{port}&scheme=http"
    try:
        for command in (["report", uri], ["sample", uri, "--prompt", "x"]):
            assert main(command) == 2
            assert capsys.readouterr().err == (f"error: run folder '{uri}' did not answer within "
                                               "1 s; is it reachable from here?\n")
    finally:
        silent.close()
