"""The run's horizon (data/horizon.py): the steps the progress line counts to and the limit that
ends the run, checked against the steps the plan's streams actually yield, epoch by epoch; and
summary.json's `ended_by` / `epochs_completed` against the evaluation records' epoch."""

from __future__ import annotations

import json

import pytest

from elastic_train.data.horizon import plan_horizon
from elastic_train.observe.summary import build_summary
from tests.test_plan import run_epoch, spec, table_of, write_rows

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("bucketing", [True, False])
def test_horizon_counts_the_steps_the_streams_yield_over_epochs(tmp_path, bucketing):
    write_rows(tmp_path / "d", 900, rows_per_block=20, files=2)
    table = table_of(tmp_path / "d")
    stream = spec(bucketing=bucketing)
    per_epoch = [len(run_epoch(table, 1, epoch=e, stream_spec=stream)[0]) for e in range(3)]
    assert len(set(per_epoch)) >= 1 and min(per_epoch) > 0
    by_epochs = plan_horizon(table, stream, max_steps=10_000, epochs=3)
    assert (by_epochs.total, by_epochs.limit, by_epochs.exact) == (sum(per_epoch), "train.epochs", True)
    by_steps = plan_horizon(table, stream, max_steps=per_epoch[0] + 1, epochs=3)
    assert (by_steps.total, by_steps.limit) == (per_epoch[0] + 1, "train.max_steps")
    # the epoch ends exactly at max_steps: max_steps is what stops the loop first
    exact = plan_horizon(table, stream, max_steps=per_epoch[0], epochs=1)
    assert (exact.total, exact.limit) == (per_epoch[0], "train.max_steps")


def _folder(tmp_path, steps: int, eval_epoch: int):
    records = [{"step": s, "epoch": 0, "attempt": 0, "loss": 1.0, "lr": 1e-3, "time": 100.0 + s,
                "step_time_s": 1.0, "data_wait_s": 0.0, "real_tokens": 10, "padded_tokens": 10,
                "world_size": 1} for s in range(1, steps + 1)]
    records.append({"step": steps, "epoch": eval_epoch, "attempt": 0, "eval_loss": 2.0,
                    "best_eval_loss": 2.0, "best_step": steps, "time": 200.0, "eval_s": 0.1})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return tmp_path


def test_summary_says_which_limit_ended_the_run_and_agrees_with_the_eval_epoch(tmp_path):
    # 28 steps, the epoch ran out (the final evaluation says epoch 1): train.epochs ended it
    by_epochs = build_summary(_folder(tmp_path, 28, eval_epoch=1), 0.0, limits=(120, 1))
    assert by_epochs["ended_by"] == "train.epochs"
    assert by_epochs["epochs_completed"] == 1 == by_epochs["final_eval_epoch"]
    by_steps = build_summary(_folder(tmp_path, 28, eval_epoch=0), 0.0, limits=(28, 3))
    assert (by_steps["ended_by"], by_steps["epochs_completed"]) == ("train.max_steps", 0)
    failed = build_summary(_folder(tmp_path, 28, eval_epoch=0), 0.0, error="boom", limits=(28, 3))
    assert "ended_by" not in failed
