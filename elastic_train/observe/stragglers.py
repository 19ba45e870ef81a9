"""Which rank holds the others back: per-rank figures from the step records, for summary.json,
the progress line and the report.

Rank 0's step records carry every rank's busy time (its step less its time in collectives: its own
work) and data wait of the step before (`rank_busy_s`, `rank_data_wait_s`, see loop.py); each
rank's `start` event names its node. Pure functions over those records: no Ray, no torch.
"""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np

STRAGGLER_RATIO = 1.5  # a rank this many times the others' median busy time is worth showing
# the step record's fields (lists in rank order, of the step before), written by loop.py
RANK_BUSY = "rank_busy_s"
RANK_DATA_WAIT = "rank_data_wait_s"


def straggler(busy_s: list[float]) -> tuple[int, float] | None:
    """(the slowest rank, its busy time / the median of the others'), or None for one rank."""
    if len(busy_s) < 2:
        return None
    slowest = int(np.argmax(busy_s))
    others = statistics.median(b for r, b in enumerate(busy_s) if r != slowest)
    return slowest, busy_s[slowest] / others if others > 0 else float("inf")


def rank_nodes(events: list[dict[str, Any]]) -> dict[tuple[int, int], str]:
    """(attempt, rank) -> the node (IP address) it ran on, from the ranks' `start` events."""
    return {(e["attempt"], e["rank"]): e["node"] for e in events
            if e.get("event") == "start" and "node" in e and "rank" in e}


def _percentiles(values: list[float]) -> dict[str, float]:
    p50, p99 = np.percentile(values, [50, 99])
    return {"p50_s": float(p50), "p99_s": float(p99)}


def rank_figures(records: list[dict[str, Any]], events: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (attempt, rank): p50/p99 of busy time and data wait over the attempt's steps; and the
    slowest rank of the attempt that logged the most steps (the bulk of the run), with its node
    and how much slower it is than the others (`slowest_ratio`, by median busy time)."""
    nodes = rank_nodes(events)
    by_attempt: dict[int, list[dict]] = {}
    for rec in records:
        if RANK_BUSY in rec:
            by_attempt.setdefault(rec["attempt"], []).append(rec)
    ranks = []
    for attempt, recs in sorted(by_attempt.items()):
        for rank in range(len(recs[0][RANK_BUSY])):
            ranks.append({"attempt": attempt, "rank": rank, "node": nodes.get((attempt, rank)),
                          "steps": len(recs),
                          "busy": _percentiles([r[RANK_BUSY][rank] for r in recs]),
                          "data_wait": _percentiles([r[RANK_DATA_WAIT][rank] for r in recs])})
    out: dict[str, Any] = {"per_rank": ranks, "slowest_rank": None, "slowest_node": None,
                           "slowest_ratio": None}
    if by_attempt:
        bulk = max(by_attempt, key=lambda a: (len(by_attempt[a]), a))
        found = straggler([r["busy"]["p50_s"] for r in ranks if r["attempt"] == bulk])
        if found is not None:
            rank, ratio = found
            out.update(slowest_rank=rank, slowest_node=nodes.get((bulk, rank)),
                       slowest_ratio=ratio)
    return out
