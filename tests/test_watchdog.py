"""The step watchdog's decisions on a scripted clock, and the NCCL settings of a GPU run (no Ray)."""

from __future__ import annotations

import pytest

from elastic_train import load_config
from elastic_train.cluster.driver import nccl_env
from elastic_train.training.watchdog import StepWatchdog, Verdict

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_slow_step_reported_once_then_timeout():
    clock = Clock()
    dog = StepWatchdog(timeout_s=30.0, slow_factor=10.0, clock=clock)
    assert dog.check() is None  # between steps
    dog.begin_step(1)
    clock.now = 100.0  # the first step (compilation, warm-up): no median, no timeout
    assert dog.check() is None
    clock.now = 25.0
    dog.end_step(25.0)
    for step, seconds in ((2, 1.0), (3, 1.0)):
        dog.begin_step(step)
        clock.now += seconds
        dog.end_step(seconds)
    assert dog.check() is None
    dog.begin_step(4)  # the median of 25, 1, 1 is 1 s
    clock.now += 10.0
    assert dog.check() is None  # exactly 10x: not yet
    clock.now += 0.5
    assert dog.check() == Verdict("slow", 4, 10.5, 1.0)
    assert dog.check() is None  # reported once
    clock.now += 21.0  # past the timeout, but the step's collectives time out first ...
    assert dog.check() is None
    clock.now += 1.0  # ... by two median steps
    assert dog.check() == Verdict("timeout", 4, 32.5, 1.0)


def test_an_empty_iteration_disarms_without_counting_as_a_step():
    clock = Clock()
    dog = StepWatchdog(timeout_s=5.0, slow_factor=2.0, clock=clock)
    dog.begin_step(1)
    clock.now = 1.0
    dog.end_step(1.0)
    dog.begin_step(2)
    clock.now = 100.0
    dog.end_step(None)  # the epoch's end: nothing trained
    assert dog.check() is None
    dog.begin_step(2)
    clock.now += 2.5
    assert dog.check() == Verdict("slow", 2, 2.5, 1.0)  # the median is still the real step's


def test_nccl_flight_recorder_dumps_into_the_run_folder_on_gpu(tmp_path):
    cfg = load_config(None, [f"run.storage_path={tmp_path}", "run.name=big"])
    assert nccl_env(cfg) == {}  # CPU: gloo
    cfg.scaling.use_gpu = True
    env = nccl_env(cfg)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "big" / "nccl_trace" / "rank_")
