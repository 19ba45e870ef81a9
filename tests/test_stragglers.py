"""Per-rank step figures: which rank is slowest, in summary.json, the progress line and the report
(synthetic records, no Ray)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from test_report import check_png

from elastic_train.observe.progress import format_line
from elastic_train.observe.report import make_report
from elastic_train.observe.stragglers import rank_figures, straggler
from elastic_train.observe.summary import build_summary
from elastic_train.training.collectives import rank_slots

pytestmark = pytest.mark.unit


def test_rank_slots_sum_to_every_ranks_values_in_rank_order():
    world = 3
    summed = [sum(v) for v in zip(*(rank_slots(world, r, 10.0 + r, 20.0 + r)
                                    for r in range(world)), strict=True)]
    assert summed == [10.0, 11.0, 12.0, 20.0, 21.0, 22.0]


def test_straggler_is_the_slowest_rank_against_the_others_median():
    assert straggler([0.1]) is None and straggler([]) is None
    assert straggler([0.1, 0.3]) == (1, pytest.approx(3.0))
    assert straggler([0.2, 0.1, 0.1, 0.9]) == (3, pytest.approx(9.0))


def _record(step: int, attempt: int, busy: list[float], wait: list[float], end: float) -> dict:
    return {"step": step, "epoch": 0, "time": end, "attempt": attempt, "world_size": len(busy),
            "loss": 3.0, "lr": 1e-3, "real_tokens": 100, "padded_tokens": 110,
            "step_time_s": max(busy), "data_wait_s": wait[0], "tokens_per_s": 100 / max(busy),
            "skipped_steps": 0, "rank_busy_s": busy, "rank_data_wait_s": wait}


def write_run(folder: Path) -> None:
    """Attempt 0: 2 ranks on two nodes, rank 1 three times slower, 3 steps (the first step of an
    attempt carries no per-rank figures); attempt 1 (a restart): 10 steps, rank 2 the slow one."""
    folder.mkdir()
    t = time.time() - 100
    events = [{"time": t, "event": "fit_start"}]
    events += [{"time": t, "event": "start", "attempt": 0, "rank": r, "node": f"10.0.0.{r + 1}"}
               for r in range(2)]
    records = [{k: v for k, v in _record(1, 0, [0.1, 0.3], [0.0, 0.0], t + 1).items()
                if not k.startswith("rank_")}]
    records += [_record(s, 0, [0.1, 0.3], [0.01, 0.02], t + s) for s in (2, 3)]
    events += [{"time": t + 5, "event": "start", "attempt": 1, "rank": r, "node": f"10.0.1.{r}"}
               for r in range(3)]
    records += [_record(s, 1, [0.2, 0.2 + 0.01 * s, 0.5 + 0.1 * s], [0.01, 0.01, 0.05], t + 5 + s)
                for s in range(3, 13)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (folder / "attempts.json").write_text(json.dumps(
        [{"attempt": 0, "world_size": 2, "start_time": t}, {"attempt": 1, "world_size": 3,
                                                            "start_time": t + 5}]))


def test_rank_figures_per_attempt_and_rank_and_the_slowest_of_the_bulk(tmp_path):
    write_run(tmp_path / "run")
    summary = build_summary(tmp_path / "run", start_time=time.time() - 100)
    ranks = {(r["attempt"], r["rank"]): r for r in summary["per_rank"]}
    assert sorted(ranks) == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    assert ranks[(0, 1)]["steps"] == 2 and ranks[(0, 1)]["node"] == "10.0.0.2"
    assert ranks[(0, 1)]["busy"] == {"p50_s": pytest.approx(0.3), "p99_s": pytest.approx(0.3)}
    assert ranks[(0, 1)]["data_wait"]["p50_s"] == pytest.approx(0.02)
    slow = [0.5 + 0.1 * s for s in range(3, 13)]  # rank 2 of attempt 1
    assert ranks[(1, 2)]["busy"]["p50_s"] == pytest.approx((slow[4] + slow[5]) / 2)
    assert ranks[(1, 2)]["busy"]["p99_s"] == pytest.approx(slow[-2] + 0.91 * (slow[-1] - slow[-2]))
    # attempt 1 logged the most steps: its slowest rank is the run's
    assert (summary["slowest_rank"], summary["slowest_node"]) == (2, "10.0.1.2")
    others = sorted([0.2, (0.2 + 0.01 * 7 + 0.2 + 0.01 * 8) / 2])
    assert summary["slowest_ratio"] == pytest.approx(ranks[(1, 2)]["busy"]["p50_s"] / (sum(others) / 2))


def test_no_per_rank_figures_no_slowest():
    assert rank_figures([], []) == {"per_rank": [], "slowest_rank": None, "slowest_node": None,
                                    "slowest_ratio": None}


def test_progress_line_names_a_notably_slower_rank():
    latest = {"step": 5, "epoch": 0, "loss": 2.0, "lr": 1e-3, "tokens_per_s": 10.0, "world_size": 3}
    assert "slowest" not in format_line(latest, [], 10, None)
    even = format_line({**latest, "rank_busy_s": [1.0, 1.2, 1.1]}, [], 10, None)
    assert "slowest" not in even
    slow = format_line({**latest, "rank_busy_s": [1.0, 3.3, 1.1]}, [], 10, None)
    assert slow.endswith(" slowest rank 1 3.1x")


def test_report_draws_each_ranks_busy_time(tmp_path):
    write_run(tmp_path / "run")
    report = make_report(tmp_path / "run")
    assert report.ranks_png == tmp_path / "run" / "ranks.png"
    check_png(report.ranks_png)
