"""A run's figures through Ray's metrics API, so the Ray dashboard's Prometheus and Grafana show them.

The RunLog actor holds one `RunMetrics` and feeds it every rank-0 step record and every attempt.
Ray's core worker in the actor's process sends the values to its node's metrics agent once per
metrics report interval (`RAY_metrics_report_interval_ms`, 10 s by default), and Prometheus scrapes
the agent; Ray prefixes every name with `ray_`. Every series carries the tag `run` (the run's name).

    elastic_train_step             gauge      the latest step trained
    elastic_train_step_time_s      histogram  seconds per step (rank 0: data wait, forward, backward,
                                              all-reduce, optimizer); quantiles from its buckets.
                                              Ray rebuilds its `_sum` from the midpoints of the
                                              buckets hit, so a mean from it is rough
    elastic_train_tokens_per_s     gauge      real (non-padding) tokens of the latest step / its time
    elastic_train_mfu              gauge      the latest step's model FLOPs utilisation
                                              (against log.peak_flops per worker)
    elastic_train_goodput          gauge      productive seconds / wall seconds since the fit
                                              started (`RunningGoodput`)
    elastic_train_world_size       gauge      workers of the current attempt
    elastic_train_restarts         gauge      attempts so far less one, as summary.json's `restarts`
                                              counts them (0 for an uninterrupted run)

`restarts` is a gauge, not a counter: a counter cannot be set to 0, so an uninterrupted run would
show no series at all. The gauges stay exported while the RunLog lives, that is until the driver's
`train` returns; the last interval's values may not reach the agent before that.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ray.util.metrics import Gauge, Histogram

PREFIX = "elastic_train_"
# Seconds, from tiny test models to large models on many GPUs.
STEP_TIME_BOUNDARIES_S = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0]


class RunningGoodput:
    """Goodput while the run goes on: productive seconds / wall seconds since the fit started.

    Productive seconds are counted as summary.json's ledger counts them at the end: the compute time
    (step time less data wait) of each step's latest attempt. A step replayed after a restart
    replaces its earlier record, whose seconds thereby turn into lost time, like the start-up,
    recovery, checkpoint and data-wait seconds that never counted. The figure is the fit's so far,
    not a recent window: a restart lowers it for the rest of the fit.
    """

    def __init__(self, start_time: float) -> None:
        self.start_time = start_time
        self.productive_s = 0.0
        self._compute_s: dict[int, float] = {}  # step -> compute seconds of its latest attempt

    def add_step(self, step: int, compute_s: float) -> None:
        self.productive_s += compute_s - self._compute_s.get(step, 0.0)
        self._compute_s[step] = compute_s

    def value(self, now: float) -> float:
        return self.productive_s / max(now - self.start_time, 1e-9)


class RunMetrics:
    """The run's Ray metrics (see the module docstring); lives in the RunLog actor."""

    def __init__(self, run_name: str, start_time: float) -> None:
        self.goodput = RunningGoodput(start_time)
        self._lock = threading.Lock()  # the RunLog runs calls on several threads (max_concurrency)
        tags = ("run",)
        self.gauges = {name: Gauge(PREFIX + name, description, tag_keys=tags) for name, description in (
            ("step", "The latest step trained."),
            ("tokens_per_s", "Real (non-padding) tokens of the latest step per second."),
            ("mfu", "Model FLOPs utilisation of the latest step, against log.peak_flops per worker."),
            ("goodput", "Productive seconds / wall seconds since the fit started."),
            ("world_size", "Workers of the current attempt."),
            ("restarts", "Attempts so far less one (summary.json's restarts)."),
        )}
        self.step_time_s = Histogram(PREFIX + "step_time_s", "Seconds per training step.",
                                     boundaries=STEP_TIME_BOUNDARIES_S, tag_keys=tags)
        for metric in (*self.gauges.values(), self.step_time_s):
            metric.set_default_tags({"run": run_name})

    def on_attempt(self, attempt: int, world_size: int) -> None:
        """A start or restart of the worker group (`attempt` counts from 0 in the run folder)."""
        with self._lock:
            self.gauges["restarts"].set(attempt)
            self.gauges["world_size"].set(world_size)
            self.gauges["goodput"].set(self.goodput.value(time.time()))

    def on_step(self, record: dict[str, Any]) -> None:
        """Rank 0's record of a step (metrics.jsonl's fields)."""
        with self._lock:
            self.goodput.add_step(record["step"], record["step_time_s"] - record["data_wait_s"])
            self.step_time_s.observe(record["step_time_s"])
            for name in ("step", "tokens_per_s", "mfu", "world_size"):
                self.gauges[name].set(record[name])
            self.gauges["goodput"].set(self.goodput.value(time.time()))
