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


def test_batch_sizes_and_row_length_follow_a_small_data_set_unless_set(tmp_path):
    """300 short prompt/response examples prepared with --max-seq-len 1024 and the CLI's
    defaults: data.max_seq_len is the longest row (not 1024), the micro-batch the power of two
    that holds it, the step a few micro-batches, so an epoch is tens of steps; values given
    are kept; the default corpus keeps 2048 / 16384."""
    from elastic_train.cli import main
    from elastic_train.config import load_config, num_partitions
    from elastic_train.data.dataset import inspect_dataset
    from elastic_train.preflight.inputs import check_inputs, run_horizon

    lines = [json.dumps({"prompt": f"Question {i}: what is {i} plus {i}?\n",
                         "response": f" It is {2 * i}." + " Indeed." * (i % 7)}) for i in range(300)]
    (tmp_path / "sft.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["prepare", str(tmp_path / "sft.jsonl"), "--output", str(tmp_path / "data"),
                 "--max-seq-len", "1024", "--engine", "local"]) == 0
    longest = inspect_dataset(str(tmp_path / "data")).max_length
    run = [f"data.path={tmp_path / 'data'}", f"run.storage_path={tmp_path / 'runs'}"]
    cfg = load_config(None, run)
    info = check_inputs(cfg)
    d = cfg.data
    assert longest <= d.max_seq_len < 1024  # the longest row (of training or held-out data)
    assert d.micro_batch_tokens == 1 << (d.max_seq_len - 1).bit_length()
    assert 2 <= num_partitions(cfg) <= 8 and d.global_batch_tokens % d.micro_batch_tokens == 0
    horizon = run_horizon(cfg, info)
    assert horizon.limit == "train.epochs" and 10 <= horizon.total < cfg.train.max_steps
    assert cfg.optim.schedule_steps == horizon.total  # the cosine ends with the epoch
    own = load_config(None, [*run, "optim.schedule_steps=500"])
    check_inputs(own)
    assert own.optim.schedule_steps == 500  # a value given is kept
    kept = load_config(None, [*run, "data.max_seq_len=200", "data.micro_batch_tokens=400",
                              "data.global_batch_tokens=1200"])
    check_inputs(kept)
    assert (kept.data.max_seq_len, kept.data.micro_batch_tokens,
            kept.data.global_batch_tokens) == (200, 400, 1200)
    default = load_config(None, [f"run.storage_path={tmp_path / 'runs'}"])
    check_inputs(default)
    assert (default.data.micro_batch_tokens, default.data.global_batch_tokens) == (2048, 16384)
