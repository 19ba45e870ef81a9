"""summary.json from the run folder's logs: totals, attempts, and the goodput ledger.

A step's effective record is the one of its latest attempt: steps replayed after a restart are
counted once, and the superseded records are the work a failure cost ("replayed"). The rule is the
tracked run's (observe/tracking.py): a record of attempt a is superseded once a later attempt has
logged a step at or before it (that attempt restarted from an earlier checkpoint, so the steps
after it that attempt a trained were thrown away), even where the later attempt never got as far:
a run that fails during a replay ends at the replay's step, not at the failed attempt's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elastic_train.observe.stragglers import rank_figures


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by a crash
                continue
    return out


def split_records(lines: list[dict[str, Any]]) -> tuple[list[dict], list[dict]]:
    """metrics.jsonl's lines as (step records, evaluation records: those with `eval_loss`)."""
    steps = [r for r in lines if "eval_loss" not in r]
    return steps, [r for r in lines if "eval_loss" in r]


def eval_figures(evals: list[dict[str, Any]], steps: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """`final_eval_loss` (of the latest step evaluated), `best_eval_loss` and its `best_step`,
    over the evaluations of each step's latest attempt (a step evaluated again after a restart
    counts once; `steps`, the step records, say which a restart threw away). Every key is there,
    null (eval_steps empty) before or without an evaluation: a script reads them from any run's
    summary.json."""
    effective = effective_records(evals, steps)
    if not effective:
        return {"final_eval_loss": None, "final_eval_epoch": None, "final_eval_perplexity": None,
                "best_eval_loss": None, "best_step": None, "eval_steps": []}
    last = effective[max(effective)]
    best = min(effective.values(), key=lambda r: (r["eval_loss"], r["step"]))
    return {"final_eval_loss": last["eval_loss"], "final_eval_epoch": last.get("epoch"),
            "final_eval_perplexity": last.get("eval_perplexity"),
            "best_eval_loss": best["eval_loss"], "best_step": best["step"],
            "eval_steps": sorted(effective)}


def _eval_s_within(evals: list[dict], after: float, until: float) -> float:
    """Seconds of the evaluations that ended in (after, until]."""
    return sum(e["eval_s"] for e in evals if after < e["time"] <= until)


WORKER_PHASES = (("worker_init", "train_fn_start"), ("model_build", "model_built"),
                 ("restore", "restored"), ("first_batch", "first_batch"), ("first_step", "first_step"))


def startup_breakdown(events: list[dict], start_time: float) -> dict[str, Any]:
    """Seconds of each start-up phase of this fit, from the command to the first step:
    the driver's (imports before `train()`, input checks, Ray start, run set-up) and rank 0's
    (worker group start: scheduling and process spawn; worker init: imports, Ray Train context,
    process group; model build; restore: optimizer and checkpoint load; first batch; first step).
    Later attempts (restarts) get their worker phases in `restarts`. A worker process that Ray
    started ahead of time counts from when it was asked for."""
    driver = next((e["driver_startup"] for e in reversed(events)
                   if e.get("event") == "fit_start" and "driver_startup" in e), None)
    attempts = [e for e in events if e.get("event") == "startup" and e["time"] >= start_time]
    if driver is None or not attempts:
        return {}
    first = attempts[0]
    asked = max(first["process_start"], driver["fit_call"])
    phases = {"driver_imports": driver["train_call"] - driver["process_start"],
              "input_checks": driver["checks_done"] - driver["train_call"],
              "ray_start": driver["ray_ready"] - driver["checks_done"],
              "run_setup": driver["fit_call"] - driver["ray_ready"],
              "worker_group": asked - driver["fit_call"]}
    phases.update(_worker_phases(first, asked))
    phases["total"] = first["first_step"] - driver["process_start"]
    restarts = [{"attempt": e["attempt"], **_worker_phases(e, e["process_start"]),
                 "total_from_process": e["first_step"] - e["process_start"]} for e in attempts[1:]]
    return {**{f"{k}_s": round(v, 3) for k, v in phases.items()},
            "restarts": [{k: (round(v, 3) if k != "attempt" else v) for k, v in r.items()}
                         for r in restarts]}


def _worker_phases(event: dict, begin: float) -> dict[str, float]:
    out, previous = {}, begin
    for name, key in WORKER_PHASES:
        out[name] = event[key] - previous
        previous = event[key]
    return out


def effective_records(records: list[dict[str, Any]],
                      steps: Sequence[dict[str, Any]] = ()) -> dict[int, dict[str, Any]]:
    """step -> the record of that step's latest attempt, the superseded records left out (see the
    module docstring). `steps`: the step records that also say where each attempt began (for
    evaluation records: the step records of the same run)."""
    first: dict[int, int] = {}  # attempt -> the lowest step it logged
    for rec in [*steps, *records]:
        first[rec["attempt"]] = min(first.get(rec["attempt"], rec["step"]), rec["step"])
    later_first: dict[int, float] = {}  # attempt -> the lowest step any later attempt logged
    lowest = float("inf")
    for attempt in sorted(first, reverse=True):
        later_first[attempt] = lowest
        lowest = min(lowest, first[attempt])
    latest: dict[int, dict[str, Any]] = {}
    for rec in records:
        if later_first[rec["attempt"]] <= rec["step"]:
            continue  # thrown away by a later attempt's restart from an earlier checkpoint
        old = latest.get(rec["step"])
        if old is None or rec["attempt"] >= old["attempt"]:
            latest[rec["step"]] = rec
    return dict(sorted(latest.items()))


LOST_STATE = "no live replica holds the run's state"


def retrained_in_place(records: list[dict[str, Any]], events: list[dict[str, Any]]) -> int:
    """In place, steps trained again within one attempt: when every replica holding the run's
    state was lost, the replacements restore the last checkpoint (recovery/replica.py) and train
    again the steps after it that the lost ones had committed. The run log keeps the first record
    of each (attempt, step), so those replays leave no second record: each such restore counts
    the steps logged after its checkpoint before it (replacements restoring the same checkpoint
    for the same loss count once)."""
    losses: dict[int, float] = {}  # restored step -> the first restore's time
    for e in events:
        if e.get("event") == "restored_instead_of_healing" and e.get("reason") == LOST_STATE:
            losses[e["step"]] = min(losses.get(e["step"], e["time"]), e["time"])
    return sum(len({r["step"] for r in records if r["step"] > step and r["time"] < when})
               for step, when in losses.items())


def ledger(records: list[dict], events: list[dict], start_time: float, end_time: float,
           evals: list[dict] | None = None) -> dict:
    """Split this fit's wall time into start-up, productive, recovery, replayed, checkpoint
    blocking, data wait, evaluation, shutdown (after the last step: final checkpoint, worker group
    teardown) and the rest (logging and bookkeeping between steps). Evaluation is neither
    training nor lost: its own line, taken out of whichever gap it ran in."""
    fit = [r for r in records if r["time"] >= start_time]
    evals = [e for e in evals or [] if e["time"] >= start_time]
    effective = effective_records(fit)
    kept = {id(r) for r in effective.values()}
    wall = max(end_time - start_time, 1e-9)
    parts = {"startup_s": 0.0, "productive_s": 0.0, "recovery_s": 0.0, "replayed_s": 0.0,
             "checkpoint_s": 0.0, "data_wait_s": 0.0, "eval_s": 0.0, "shutdown_s": 0.0}
    previous_end = None
    previous_attempt = None
    for rec in fit:
        begin = rec["time"] - rec["step_time_s"]
        if previous_attempt is None:
            parts["startup_s"] = begin - start_time
        elif rec["attempt"] != previous_attempt:
            parts["recovery_s"] += max(begin - previous_end - _eval_s_within(evals, previous_end, begin),
                                       0.0)
        previous_end, previous_attempt = rec["time"], rec["attempt"]
        parts["data_wait_s"] += rec["data_wait_s"]
        compute = rec["step_time_s"] - rec["data_wait_s"]
        parts["productive_s" if id(rec) in kept else "replayed_s"] += compute
    parts["checkpoint_s"] = sum(
        e.get("blocked_s", 0.0) for e in events
        if e.get("event") == "checkpoint" and not e.get("final") and e["time"] >= start_time
    )
    parts["eval_s"] = sum(e["eval_s"] for e in evals)
    if fit:
        parts["shutdown_s"] = max(end_time - previous_end - _eval_s_within(evals, previous_end, end_time),
                                  0.0)
    else:
        parts["startup_s"] = wall
    parts["other_s"] = wall - sum(parts.values())
    parts["wall_s"] = wall
    parts["goodput"] = parts["productive_s"] / wall
    return parts


def build_summary(folder: str | Path, start_time: float, error: str | None = None,
                  limits: tuple[int, int] | None = None) -> dict:
    """summary.json's content from the run folder's records. `limits`: (train.max_steps,
    train.epochs), so a finished run says which one ended it (`ended_by`) and counts its epochs
    as its evaluation records do (an epoch run to its end is completed)."""
    folder = Path(folder)
    end_time = time.time()
    records, evals = split_records(read_jsonl(folder / "metrics.jsonl"))
    events = read_jsonl(folder / "events.jsonl")
    attempts = json.loads((folder / "attempts.json").read_text()) if (
        folder / "attempts.json").is_file() else []
    effective = effective_records(records)
    last = effective[max(effective)] if effective else {}
    real = sum(r["real_tokens"] for r in effective.values())
    padded = sum(r["padded_tokens"] for r in effective.values())
    fit_real = sum(r["real_tokens"] for r in effective.values() if r["time"] >= start_time)
    wall = end_time - start_time
    summary = {
        "status": "failed" if error else "finished",
        "reason": error,
        "steps": last.get("step", 0),
        "epochs_completed": last.get("epoch", 0),
        "final_loss": last.get("loss"),
        "first_loss": effective[min(effective)]["loss"] if effective else None,
        "real_tokens": real,
        "padded_tokens": padded,
        "padding_efficiency": real / padded if padded else None,
        "wall_s": wall,
        "written_at": end_time,  # what report compares with the logs: not a file's time
        "tokens_per_s": fit_real / wall if wall > 0 else None,
        **attempt_counts(attempts),
        # in place: lost replicas replaced within an attempt (no restart, no attempt of their own)
        "replacements": sum(e.get("event") == "replacement_joined" for e in events),
        "world_sizes": [a["world_size"] for a in attempts],
        "skipped_steps": last.get("skipped_steps", 0),
        "replayed_steps": len(records) - len(effective) + retrained_in_place(records, events),
        "optimizer_state_bytes_per_param": next(
            (e["bytes_per_param"] for e in reversed(events) if e.get("event") == "optimizer_state"),
            None),
        "ledger": ledger(records, events, start_time, end_time, evals),
        **eval_figures(evals, records),
        "startup": startup_breakdown(events, start_time),
    }
    if limits is not None and not error and effective:
        summary.update(_ended_by(summary["steps"], summary["epochs_completed"], evals, *limits))
    summary["goodput"] = summary["ledger"]["goodput"]
    summary.update(reduce_figures(events))
    summary.update(read_figures(events, sum(r.get("rows", 0) for r in effective.values())))
    summary.update(rank_figures(records, events))
    summary.update(compile_figures(events))
    return summary


def _ended_by(steps: int, epoch: int, evals: list[dict], max_steps: int, epochs: int) -> dict:
    """`ended_by` (the limit that ended a finished run) and `epochs_completed`. A step record's
    epoch is the one it trained in; an evaluation after an epoch's end says the next one, as the
    loop's state does: so a run ended by train.epochs completed them all, one ended by
    train.max_steps those before its last step's (or those its last evaluation saw)."""
    if steps >= max_steps:
        seen = max([epoch, *(e.get("epoch", 0) for e in evals)])
        return {"ended_by": "train.max_steps", "epochs_completed": seen}
    return {"ended_by": "train.epochs", "epochs_completed": epochs}


def attempt_counts(attempts: list[dict]) -> dict[str, int]:
    """`restarts`: attempts the group restarted into, after a failure or a resize (metrics.jsonl's
    `attempt` counts them); `resizes`: those of them Ray Train's scaling policy began, replacing
    a group no failure ended (a grow); `resumes`: attempts begun by a new driver (the user ran
    the run again). attempts.json written before attempts had a `cause`: every attempt but the
    first was a restart."""
    causes = [a.get("cause", "start" if i == 0 else "restart") for i, a in enumerate(attempts)]
    resizes = causes.count("resize")
    return {"restarts": causes.count("restart") + resizes, "resumes": causes.count("resume"),
            "resizes": resizes}


def reduce_figures(events: list[dict]) -> dict:
    """The gradient reduction that ran (the latest attempt's), why, and its compression."""
    chosen = next((e for e in reversed(events) if e.get("event") == "grad_reduce"), {})
    return {"grad_reduce": chosen.get("chosen"), "grad_reduce_reason": chosen.get("reason"),
            "grad_compression": chosen.get("grad_compression"), "device": chosen.get("device"),
            "precision": chosen.get("precision"), "micro_batch_tokens": chosen.get("micro_batch_tokens")}


def compile_figures(events: list[dict]) -> dict:
    """train.compile (training/compile.py): `compiled_graphs`, the most graphs one process held
    (the recompile bound: 2 per compiled module for bucketed data); `compile_loaded` and
    `compile_compiled`, graphs loaded from the cache and compiled afresh by all processes; and
    `compile_step_s`, seconds of the steps that did either (rank 0's, all attempts)."""
    compiles = [e for e in events if e.get("event") == "compile"]
    if not compiles:
        return {}
    return {"compiled_graphs": max(e["total_graphs"] for e in compiles),
            "compile_loaded": sum(e["loaded"] for e in compiles),
            "compile_compiled": sum(e["compiled"] for e in compiles),
            "compile_step_s": sum(e["step_s"] for e in compiles if e["rank"] == 0)}


def read_figures(events: list[dict], rows_trained: int) -> dict:
    """`read_amplification`: rows read from storage by all ranks of all attempts / rows trained
    (each process logs its running count; the last one of each (attempt, rank, process) counts: in
    place, a replacement shares its attempt and rank with the process it replaced), and the rows
    and bytes read per (attempt, rank)."""
    last: dict[tuple[int, int, int | None], dict] = {}
    for e in events:
        if e.get("event") == "data_read":
            last[(e["attempt"], e["rank"], e.get("pid"))] = e
    rows_read = sum(e["rows_read"] for e in last.values())
    balance = [e["partition_balance"] for e in events if e.get("event") == "epoch_plan"]
    utilisation = {e["world_size"]: e["utilisation"] for e in events
                   if e.get("event") == "start" and "utilisation" in e}
    build_peaks = [e["build_peak_rss_bytes"] for e in events
                   if e.get("event") == "start" and e.get("build_peak_rss_bytes")]
    return {
        # the largest peak resident bytes of any rank right after building its model (VmHWM)
        "build_peak_rss_bytes": max(build_peaks) if build_peaks else None,
        "partition_balance": max(balance) if balance else None,
        "utilisation_by_world_size": {str(w): u for w, u in sorted(utilisation.items())},
        "read_amplification": rows_read / rows_trained if rows_trained else None,
        "rows_read": rows_read,
        "bytes_read": sum(e["bytes_read"] for e in last.values()),
        "reads_per_rank": [{k: e[k] for k in ("attempt", "rank", "rows_read", "bytes_read")}
                           for _, e in sorted(last.items())],
    }
