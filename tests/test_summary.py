"""summary.json's effective steps (unit): the steps a restart threw away are not counted, as in the
tracked run (observe/tracking.py), for a run that failed or was stopped during a replay too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from elastic_train.observe.summary import LOST_STATE, build_summary, effective_records

pytestmark = pytest.mark.unit


def _record(step: int, attempt: int, t0: float = 0.0) -> dict[str, Any]:
    return {"step": step, "epoch": 0, "loss": round(3.0 - step / 10 - attempt, 2), "lr": 1e-3,
            "world_size": 2, "real_tokens": 100, "padded_tokens": 110, "step_time_s": 0.1,
            "data_wait_s": 0.0, "attempt": attempt, "time": t0 + step + 100 * attempt,
            "tokens_per_s": 1000.0}


def _eval(step: int, attempt: int, loss: float, t0: float = 0.0) -> dict[str, Any]:
    return {"step": step, "epoch": 0, "attempt": attempt, "eval_loss": loss, "eval_s": 0.1,
            "time": t0 + step + 100 * attempt + 0.5}


def _write(folder: Path, lines: list[dict], attempts: int, t0: float,
           events: list[dict] | None = None) -> None:
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events or []))
    (folder / "attempts.json").write_text(json.dumps(
        [{"attempt": a, "world_size": 2, "start_time": t0 + 100 * a, "cause": "restart" if a else "start"}
         for a in range(attempts)]))


def test_a_run_that_fails_during_a_replay_ends_at_the_replayed_step(tmp_path):
    # attempt 0 trains 1..15 (evaluating at 14) and crashes, the checkpoint of step 10 committed;
    # attempt 1 replays 11, 12 and the run fails: 11..15 of attempt 0 were thrown away
    t0 = 1000.0
    lines = [_record(s, 0, t0) for s in range(1, 16)] + [_eval(14, 0, 0.5, t0)]
    lines += [_record(s, 1, t0) for s in (11, 12)]
    _write(tmp_path, lines, 2, t0)
    s = build_summary(tmp_path, start_time=t0, error="worker died")
    assert (s["status"], s["steps"], s["final_loss"]) == ("failed", 12, _record(12, 1)["loss"])
    assert s["real_tokens"] == 12 * 100 and s["replayed_steps"] == 5
    assert s["final_eval_loss"] is None and s["eval_steps"] == []  # step 14 was thrown away
    assert s["ledger"]["replayed_s"] == pytest.approx(5 * 0.1)
    assert s["ledger"]["productive_s"] == pytest.approx(12 * 0.1)
    effective = effective_records([r for r in lines if "eval_loss" not in r])
    assert [(step, r["attempt"]) for step, r in effective.items()] == [
        *((step, 0) for step in range(1, 11)), (11, 1), (12, 1)]


def test_a_late_record_of_an_older_attempt_never_counts_and_a_finished_replay_is_as_before(tmp_path):
    # attempt 1 resumed from the checkpoint of step 4 and went on to the end (10); a record of
    # attempt 0 past its crash that arrives late (step 7, after attempt 1's) is superseded
    t0 = 0.0
    lines = [_record(s, 0) for s in range(1, 7)] + [_record(s, 1) for s in range(5, 11)]
    lines.append(_record(7, 0))
    _write(tmp_path, lines, 2, t0)
    s = build_summary(tmp_path, start_time=t0)
    assert (s["steps"], s["final_loss"], s["replayed_steps"]) == (10, _record(10, 1)["loss"], 3)
    assert s["real_tokens"] == 10 * 100


def test_in_place_records_of_one_attempt_keep_their_rules(tmp_path):
    # in place, a lost state restores the checkpoint of step 4 within attempt 0: the run log keeps
    # the first record of each (attempt, step), so the replays leave no record; they are counted
    # from the restore event, and nothing of attempt 0 is superseded
    lines = [_record(s, 0) for s in range(1, 9)]
    events = [{"event": "restored_instead_of_healing", "step": 4, "reason": LOST_STATE,
               "time": 6.5}]
    _write(tmp_path, lines, 1, 0.0, events)
    s = build_summary(tmp_path, start_time=0.0)
    assert (s["steps"], s["replayed_steps"], s["real_tokens"]) == (8, 2, 800)
