"""The start-up breakdown in summary.json: from the command to the first step, phase by phase."""

from __future__ import annotations

import pytest

from elastic_train.observe.summary import startup_breakdown

pytestmark = pytest.mark.unit


def _worker(attempt: int, t0: float) -> dict:
    return {"event": "startup", "attempt": attempt, "time": t0 + 20.0, "process_start": t0,
            "train_fn_start": t0 + 5.0, "model_built": t0 + 6.0, "restored": t0 + 8.0,
            "first_batch": t0 + 8.5, "first_step": t0 + 9.5}


def test_phases_add_up_from_the_command_to_the_first_step():
    driver = {"process_start": 100.0, "train_call": 103.0, "checks_done": 104.0, "ray_ready": 114.0,
              "fit_call": 115.0}
    events = [{"event": "fit_start", "time": 115.0, "driver_startup": driver},
              _worker(0, 120.0), _worker(1, 200.0)]
    out = startup_breakdown(events, start_time=114.0)
    assert out["driver_imports_s"] == 3.0 and out["ray_start_s"] == 10.0
    assert out["worker_group_s"] == 5.0 and out["worker_init_s"] == 5.0
    assert out["restore_s"] == 2.0 and out["first_step_s"] == 1.0
    phases = [v for k, v in out.items() if k.endswith("_s") and k != "total_s"]
    assert sum(phases) == pytest.approx(out["total_s"]) == 29.5
    assert out["restarts"] == [{"attempt": 1, "worker_init": 5.0, "model_build": 1.0, "restore": 2.0,
                                "first_batch": 0.5, "first_step": 1.0, "total_from_process": 9.5}]
    # A worker process Ray started before the run asked for it counts from the ask.
    early = [events[0], {**_worker(0, 110.0)}]
    out = startup_breakdown(early, start_time=114.0)
    assert out["worker_group_s"] == 0.0 and out["worker_init_s"] == 0.0
    assert startup_breakdown([], 0.0) == {}
