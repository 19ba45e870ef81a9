"""The gradient reduction through Ray on 2 CPU workers: a communication hook trains and resumes
after a crash on its own curve (`auto` choosing exact and keeping its choice across a restart:
tests/test_train_ray.py's crash run).

The run crashes rank 1 at step 7 with checkpoints every 4 steps, so the restart replays steps
5-7 from the step-4 checkpoint. Attempt 0 trained those steps uninterrupted: the replayed losses
must equal them to the bit. The loss of step 6 is computed with the weights that step 5's
compressed gradient made, so with PowerSGD it checks that each rank got its own error feedback
back (a fresh state gives other weights: tests/test_commhooks_dist.py). The stateless fp16 and
bf16 hooks are registered by the same code from the same key, and are held against one process at
the dist tier there; a Ray run of their own would prove nothing more. One fit in all.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_train_ray import crash_event, metrics, run

pytestmark = pytest.mark.ray

CRASH = ["train.max_steps=12", "fault.crash_at_step=7", "fault.crash_rank=1"]


def events(result, name: str) -> list[dict]:
    lines = (Path(result.run_dir) / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == name]


def assert_replay_matches_first_attempt(result) -> None:
    """One restart, from the step-4 checkpoint; the replayed steps' losses equal attempt 0's."""
    s = result.summary
    assert s["status"] == "finished" and s["restarts"] == 1 and s["world_sizes"] == [2, 2]
    assert crash_event(result)["committed_step"] == 4
    by_attempt: dict[int, dict[int, float]] = {0: {}, 1: {}}
    for rec in metrics(result):
        by_attempt[rec["attempt"]][rec["step"]] = rec["loss"]
    replayed = sorted(set(by_attempt[0]) & set(by_attempt[1]))
    assert replayed == [5, 6, 7]
    assert [by_attempt[1][s] for s in replayed] == [by_attempt[0][s] for s in replayed]
    assert max(by_attempt[1]) == 12 and s["final_loss"] < s["first_loss"]


def test_a_hook_trains_and_resumes_after_a_crash_on_its_curve(ray_cluster, small_dataset, tmp_path):
    compression = "powersgd"  # the hook with state: each rank's error feedback, saved and restored
    result = run(tmp_path, small_dataset, compression, *CRASH, "train.grad_reduce=ddp",
                 f"train.grad_compression={compression}", "train.powersgd_warmup_steps=2")
    assert_replay_matches_first_attempt(result)
    s = result.summary
    assert (s["grad_reduce"], s["grad_compression"]) == ("ddp", compression)
    assert not events(result, "powersgd_reset")  # the same world size: every rank's state back
