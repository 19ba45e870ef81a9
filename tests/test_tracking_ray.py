"""Tracked runs on a real local Ray cluster: a run with a crash in it, logged to an MLflow file store
and to W&B offline, shows one tracked run with every step once (the latest attempt's), the
evaluations, the summary and the report's plots; a tracking server that refuses connections costs
the run nothing but a warning; a resume continues the same tracked runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TINY
from test_tracking import closed_port, wandb_run

from elastic_train import load_config
from elastic_train.api import train
from elastic_train.observe.summary import effective_records

pytestmark = pytest.mark.ray


def run(tmp_path, data, name, *extra):
    cfg = load_config(None, [*TINY, f"data.path={data}", f"run.storage_path={tmp_path}",
                             f"run.name={name}", "checkpoint.every_steps=4", "scaling.max_failures=2",
                             "train.max_steps=14", *extra])
    return train(cfg)


def records(result) -> list[dict]:
    return [json.loads(line) for line in (Path(result.run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_a_crashed_run_is_one_tracked_run_with_each_step_once_in_mlflow_and_wandb(
        ray_cluster, held_out_dataset, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for it to read a file store
    uri = f"file://{tmp_path}/mlruns"
    result = run(tmp_path, held_out_dataset, "tracked", "fault.crash_at_step=10", "fault.crash_rank=1",
                 "eval.fraction=0.1", "eval.every_steps=5", f"log.mlflow={uri}", "log.wandb=proj")
    assert result.summary["status"] == "finished" and result.summary["restarts"] == 1
    lines = records(result)
    steps = effective_records([r for r in lines if "eval_loss" not in r])
    evals = effective_records([r for r in lines if "eval_loss" in r])
    replayed = [r["step"] for r in lines if "eval_loss" not in r and r["attempt"] == 0
                and r["step"] >= min(s for s, r in steps.items() if r["attempt"] == 1)]
    assert replayed, "the crash replayed no step: the test shows nothing"
    assert sorted(steps) == list(range(1, 15)) and evals

    state = json.loads((Path(result.run_dir) / "tracking.json").read_text())
    client = MlflowClient(uri)
    (experiment,) = [e for e in client.search_experiments() if e.name == "elastic_train"]
    assert len(client.search_runs([experiment.experiment_id])) == 1
    loss = [(m.step, m.value) for m in client.get_metric_history(state["mlflow"], "loss")]
    assert loss == [(s, r["loss"]) for s, r in steps.items()]  # each once, the latest attempt's
    attempt = {m.step: m.value for m in client.get_metric_history(state["mlflow"], "attempt")}
    assert attempt == {s: r["attempt"] for s, r in steps.items()}
    eval_loss = [(m.step, m.value) for m in client.get_metric_history(state["mlflow"], "eval_loss")]
    assert eval_loss == [(s, r["eval_loss"]) for s, r in evals.items()] and eval_loss
    tracked = client.get_run(state["mlflow"])
    assert tracked.info.status == "FINISHED"
    assert tracked.data.params["train.max_steps"] == "14"
    assert (tracked.data.tags["attempt"], tracked.data.tags["world_size"]) == ("1", "2")
    assert tracked.data.metrics["summary/final_loss"] == pytest.approx(result.summary["final_loss"])
    assert {a.path for a in client.list_artifacts(state["mlflow"])} == {
        "loss.png", "throughput.png", "summary.json"}

    wb = wandb_run(Path(result.run_dir))
    history = [h for h in wb["history"] if "loss" in h]
    assert [(h["step"], h["loss"], h["attempt"]) for h in history] == [
        (s, r["loss"], r["attempt"]) for s, r in steps.items()]
    assert [(h["step"], h["eval_loss"]) for h in wb["history"] if "eval_loss" in h] == eval_loss
    assert wb["summary"]["final_loss"] == pytest.approx(result.summary["final_loss"])
    assert {"loss.png", "throughput.png", "summary.json"} <= set(wb["files"])
    events = [json.loads(line) for line in (Path(result.run_dir) / "events.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["event"] == "tracking_warning"]
    (finished,) = [e for e in events if e["event"] == "tracking_finished"]
    assert finished["complete"], finished

    # a resume (more steps) continues the same tracked runs
    more = run(tmp_path, held_out_dataset, "tracked", "eval.fraction=0.1", "eval.every_steps=5",
               f"log.mlflow={uri}", "log.wandb=proj", "train.max_steps=18")
    assert more.summary["status"] == "finished"
    steps = effective_records([r for r in records(more) if "eval_loss" not in r])
    assert sorted(steps) == list(range(1, 19))
    assert json.loads((Path(more.run_dir) / "tracking.json").read_text())["mlflow"] == state["mlflow"]
    assert len(client.search_runs([experiment.experiment_id])) == 1
    loss = [(m.step, m.value) for m in client.get_metric_history(state["mlflow"], "loss")]
    assert loss == [(s, r["loss"]) for s, r in steps.items()]
    assert client.get_run(state["mlflow"]).data.params["train.max_steps"] == "14"  # params stay
    (second,) = [d for d in Path(more.run_dir).glob("wandb/offline-run-*") if d != wb["dir"]]
    assert second.name.endswith(wb["dir"].name.rsplit("-", 1)[1])  # the same W&B run id
    resumed = [r for r in wandb_run(second.parent.parent, second.name)["history"] if "loss" in r]
    assert [h["step"] for h in resumed] == [15, 16, 17, 18]


def test_a_tracking_server_that_refuses_connections_costs_the_run_a_warning(
        ray_cluster, small_dataset, tmp_path):
    uri = f"http://127.0.0.1:{closed_port()}"
    result = run(tmp_path, small_dataset, "refused", f"log.mlflow={uri}")
    assert result.summary["status"] == "finished"
    assert sorted(r["step"] for r in records(result)) == list(range(1, 15))
    events = [json.loads(line) for line in (Path(result.run_dir) / "events.jsonl").read_text().splitlines()]
    warnings = [e["message"] for e in events if e["event"] == "tracking_warning"]
    assert len(warnings) == 1 and uri in warnings[0] and "run goes on" in warnings[0], warnings
    (finished,) = [e for e in events if e["event"] == "tracking_finished"]
    assert finished["wait_s"] < 5, finished  # a dropped server holds nothing back at the end
