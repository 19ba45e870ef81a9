"""The run's figures in Ray's metrics export (raymetrics.py), as Prometheus scrapes them."""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest
from conftest import TINY, own_ray_cluster, start_shared_ray

from elastic_train import load_config
from elastic_train.api import train
from elastic_train.cluster.raymetrics import RunningGoodput

GAUGES = ("step", "tokens_per_s", "mfu", "goodput", "world_size", "restarts")


@pytest.mark.unit
def test_goodput_counts_each_steps_latest_attempt_against_wall_time():
    goodput = RunningGoodput(start_time=100.0)
    for step in (1, 2, 3):
        goodput.add_step(step, compute_s=2.0)
    assert goodput.value(now=112.0) == pytest.approx(6.0 / 12.0)
    # A restart from the checkpoint of step 1 replays steps 2 and 3: the first tries become lost
    # time, and the replayed ones count once.
    goodput.add_step(2, compute_s=1.0)
    goodput.add_step(3, compute_s=1.0)
    assert goodput.productive_s == pytest.approx(4.0)
    assert goodput.value(now=120.0) == pytest.approx(4.0 / 20.0)


@pytest.fixture(scope="module")
def metrics_cluster():
    """A local cluster of the module's own, as the shared one but with processes that send their
    metrics every second (the floor; 10 s by default), and the URL where its node's agent serves
    them in Prometheus' text format. The next module starts the shared one again."""
    import ray

    own_ray_cluster()
    start_shared_ray(metrics_report_interval_ms=1000)
    (node,) = [n for n in ray.nodes() if n["Alive"]]
    yield f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"
    own_ray_cluster()


def scrape(url: str, run: str) -> dict[str, float]:
    """This run's `elastic_train_` samples: name -> value (histograms as `_count` and `_sum`)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:  # the agent may not listen yet, or be busy
        return {}
    return {sample.name.removeprefix("ray_"): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name.startswith("ray_elastic_train_") and sample.labels.get("run") == run}


def train_and_scrape(url: str, cfg) -> tuple[dict, list[dict[str, float]]]:
    """Train in a thread and scrape the metrics while it runs (the RunLog that exports them ends
    with the run), then for up to 60 s more until those of the last step show up; the summary and
    every scrape that had this run's gauges."""
    out = {}
    thread = threading.Thread(target=lambda: out.update(summary=train(cfg).summary))
    thread.start()
    seen = []
    while thread.is_alive():
        seen += _gauges(scrape(url, cfg.run.name))
        time.sleep(0.5)
    thread.join()
    assert "summary" in out, "training failed: see the thread's traceback above"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(s["elastic_train_step"] == out["summary"]["steps"]
                                                  for s in seen):
        seen += _gauges(scrape(url, cfg.run.name))
        time.sleep(0.5)
    return out["summary"], seen


def _gauges(sample: dict[str, float]) -> list[dict[str, float]]:
    return [sample] if all(f"elastic_train_{name}" in sample for name in GAUGES) else []


@pytest.mark.ray
def test_step_time_tokens_mfu_goodput_and_restarts_reach_prometheus(metrics_cluster, small_dataset,
                                                                     tmp_path):
    cfg = load_config(None, [*TINY, f"data.path={small_dataset}", f"run.storage_path={tmp_path}",
                             "run.name=metrics", "train.max_steps=16", "checkpoint.every_steps=4"])
    summary, seen = train_and_scrape(metrics_cluster, cfg)
    assert summary["status"] == "finished" and summary["restarts"] == 0
    assert seen, "no elastic_train_ gauges of this run in Ray's metrics export"
    last = seen[-1]
    assert 1 <= last["elastic_train_step"] <= summary["steps"]
    assert 1 <= last["elastic_train_step_time_s_count"] <= summary["steps"]
    assert last["elastic_train_step_time_s_sum"] > 0
    assert last["elastic_train_tokens_per_s"] > 0
    assert 0 < last["elastic_train_mfu"] < 1
    assert 0 < last["elastic_train_goodput"] <= 1
    assert last["elastic_train_world_size"] == 2
    assert all(s["elastic_train_restarts"] == 0 for s in seen)


@pytest.mark.ray
def test_a_restart_sets_the_restarts_gauge_and_a_replayed_step_counts_once(metrics_cluster, tmp_path):
    """The run log alone, fed as rank 0 feeds it: two steps, a restart at world size 1 from the
    checkpoint of step 1, step 2 again (a crash run costs minutes; this, seconds)."""
    import ray

    from elastic_train.cluster.runlog import RunLog

    runlog = RunLog.remote(str(tmp_path / "direct"))

    def log_step(step: int, attempt: int, world_size: int) -> None:
        record = {"step": step, "attempt": attempt, "world_size": world_size, "time": time.time(),
                  "step_time_s": 0.5, "data_wait_s": 0.1, "tokens_per_s": 1000.0 * world_size,
                  "mfu": 0.01 * world_size}
        ray.get(runlog.log_step.remote(record))  # one at a time: the actor has several threads

    try:
        assert ray.get(runlog.begin_attempt.remote(2)) == 0
        log_step(1, attempt=0, world_size=2)
        log_step(2, attempt=0, world_size=2)
        assert ray.get(runlog.begin_attempt.remote(1)) == 1
        log_step(2, attempt=1, world_size=1)
        deadline = time.monotonic() + 60
        sample = {}
        while time.monotonic() < deadline and sample.get("elastic_train_step_time_s_count") != 3:
            time.sleep(0.5)
            sample = scrape(metrics_cluster, "direct")
    finally:
        ray.kill(runlog)
    assert sample.get("elastic_train_step_time_s_count") == 3, sample
    # Ray (2.60, open_telemetry_metric_recorder.py) rebuilds a histogram's sum from the midpoints
    # of the buckets its values fell in: three 0.5 s steps, each in (0.25, 0.5].
    assert 3 * 0.25 <= sample["elastic_train_step_time_s_sum"] <= 3 * 0.5
    assert sample["elastic_train_restarts"] == 1
    assert (sample["elastic_train_step"], sample["elastic_train_world_size"]) == (2, 1)
    assert (sample["elastic_train_tokens_per_s"], sample["elastic_train_mfu"]) == (1000, 0.01)
    # Exported; its arithmetic is the unit test's (these made-up steps are longer than the
    # seconds the run log has lived, so the figure here means nothing).
    assert sample["elastic_train_goodput"] > 0
