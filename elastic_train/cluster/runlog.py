"""The run folder's files, written by one small Ray actor that lives on the driver's node.

Workers send it per-step metrics (rank 0) and consumed sample ids (every rank) as fire-and-forget
calls, so the loop never waits for storage and never calls `ray.train.report` just to log. The
actor appends to `metrics.jsonl` and `consumed/*.jsonl`, keeps `attempts.json` (the world size and
start time of every attempt: restarts survive a driver restart too), and serves the latest state to
the driver's progress display. For a remote `run.storage_path` (s3://, gs://, ...) it writes a local
staging copy and uploads it on `flush`. A fit's new config is staged until its first attempt
begins, and a fit that ends before that leaves an earlier run's folder as it was
(observe/runfolder.py: `stage_file`, `accept`, `settle`). It also exports the run's figures
through Ray's metrics API (`raymetrics.py`).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from elastic_train.cluster.raycompat import committed_step
from elastic_train.cluster.raymetrics import RunMetrics
from elastic_train.config import redact
from elastic_train.observe.runfolder import RunFolder
from elastic_train.observe.tb import TensorBoardWriter
from elastic_train.observe.tracking import Tracker, build_backends
from elastic_train.recovery.fence import end_process

WINDOW_STEPS = 10  # steps in the progress line's tokens/s
HOLD_S = 5.0  # the longest a sender's record waits for the one it sent before (`_in_order`)


@ray.remote(num_cpus=0, max_concurrency=4)
class RunLog:
    """One per run; see the module docstring."""

    def __init__(self, run_uri: str, flush_interval_s: float = 10.0, tensorboard: bool = False,
                 tracking: dict[str, Any] | None = None) -> None:
        self.folder = RunFolder(run_uri)
        self.tb = TensorBoardWriter(self.folder.local) if tensorboard else None
        # an earlier run's tracked runs are reopened only once this fit is accepted (`accept`)
        self.tracking = tracking
        self.tracker = self._start_tracker(tracking) if tracking and not self.folder.resuming else None
        self.attempts: list[dict] = self.folder.read_json("attempts.json", [])
        self.faults: dict[str, bool] = self.folder.read_json("faults.json", {})
        # in place: the answer given to each occurrence of too many non-finite steps in a row,
        # (step, its participants): "rollback" or "fatal" (`claim_rollback`)
        self.nonfinite: dict[tuple[int, str], str] = {}
        self.writers: set[tuple[str, int, int]] = set()  # in place: checkpoints claimed (claim_writer)
        self.latest: dict[str, Any] | None = None
        self._recent: list[tuple[int, int, float, float]] = []  # (attempt, step, real tokens, seconds)
        self.latest_eval: dict[str, Any] | None = None
        self.fatal: str | None = None
        self.checkpoint_request: str | None = None  # the reason of a request no rank 0 took yet
        self.tickets = {"asked": 0, "taken": 0, "done": 0}  # requests numbered: asked, taken, committed
        self.group_token: str | None = None  # in-place recovery: the group start of the attempt
        self.group_ready: set[int] = set()  # ... its workers ready for their first quorum
        self.finished_step: int | None = None  # ... and where its training ended
        self.replacements = 0  # ... and how many lost workers were replaced in place
        self.replacements_in_quorum = 0  # ... and of those, how many reached their first quorum
        self.replicas: dict[tuple[int, int], tuple[str, float]] = {}  # ... (rank, pid): (node, start)
        self.logged: dict[str, set[tuple[int, int]]] = {}  # ... "step"/"eval": (attempt, step) kept
        self._logged_lock = threading.Lock()  # ... taken by up to max_concurrency calls at once
        # The attempts and the group start's state, read and changed by several workers' calls
        # at once: a group's second worker must not see the new token before the attempt exists
        # (it took index -1 and its records were counted as replays; seen under load).
        self._attempt_lock = threading.Lock()
        # The latest step and its window, the checkpoint tickets and the faults claimed: each
        # read, then changed, by calls that a threaded actor may run at once and out of the
        # order their caller sent them (Ray keeps no order on a threaded actor).
        self._state_lock = threading.Lock()
        self.flush_interval_s = flush_interval_s
        self._last_sync = time.time()
        self._sync_lock = threading.Lock()  # one upload at a time (remote storage)
        # The records a worker sends (steps, committed steps, evaluations) are taken in the order
        # it sent them (`_in_order`): sender -> the next number, and those that came before it.
        self._order_lock = threading.Lock()
        self._next: dict[str, int] = {}
        self._held: dict[str, dict[int, tuple[float, Callable[[], None]]]] = {}
        # this driver's session: its first attempt resumes the run if an earlier driver's began one
        self.session, self.session_attempts = time.time(), 0
        self.failures: list[dict[str, Any]] = []  # every failure the failure policy saw (failures.py)
        self.rank_nodes: dict[int, str] = {}  # each rank's node, from the events its worker logs
        self.worker_started: float | None = None  # when a worker last began (it builds, then begins)
        # The driver starts the RunLog as the fit starts; the run folder is `<storage>/<run.name>`.
        self.metrics = RunMetrics(run_name=Path(self.folder.remote_path).name, start_time=time.time())

    def begin_attempt(self, world_size: int) -> int:
        """Record a new attempt (a start or restart of the worker group); return its index. Its
        `cause`: start (the run's first), resume (a new driver's first: the user ran it again) or
        restart (after a failure). The first accepts the run (`accept`)."""
        with self._attempt_lock:
            return self._begin_attempt(world_size)

    def _begin_attempt(self, world_size: int) -> int:
        self.accept()
        cause = "start" if not self.attempts else "restart" if self.session_attempts else "resume"
        before = self.attempts[-1] if self.session_attempts else None
        if before is not None and "end" not in before:
            failed = next((f for f in reversed(self.failures)
                           if f.get("attempt") == before["attempt"]), None)
            if failed is not None:  # in place: a failure of its own that the group did not outlive
                self._end_attempt({k: failed.get(k) for k in ("cause", "rank", "node", "step",
                                                              "committed_step")}, before)
            else:  # no failure ended it: Ray Train's scaling policy replaced the group (a grow).
                # A failure reported late (its caller's call came after the new group began)
                # turns both back into a failure and a restart (`record_failure`)
                cause = "resize"
                self._end_resized(before)
        elif before is not None and before["end"]["cause"] == "resize":
            cause = "resize"  # a grow whose new group started only at a later try
        self.session_attempts += 1
        self.attempts.append({"attempt": len(self.attempts), "world_size": world_size,
                              "start_time": time.time(), "cause": cause, "session": self.session})
        self.folder.write("attempts.json", json.dumps(self.attempts))
        self.metrics.on_attempt(len(self.attempts) - 1, world_size)
        if self.tracker is not None:
            self.tracker.attempt(len(self.attempts) - 1, world_size)
        return len(self.attempts) - 1

    def stage_file(self, name: str, text: str) -> None:
        """A file of this fit's config, written once the run is accepted (observe/runfolder.py)."""
        self.folder.stage(name, text)

    def accept(self) -> None:
        """The run is accepted (its first attempt begins): the staged files take their names, and
        an earlier run's tracked runs are reopened."""
        self.folder.accept()
        if self.tracking and self.tracker is None and self.folder.accepted:  # not once discarded
            self.tracker = self._start_tracker(self.tracking)

    def settle(self) -> bool:
        """The fit is over: True if its files stay (the run was accepted, or the folder is a new
        run's, which keeps the record of its failure); False if it was an earlier run's folder
        and the fit never began: the folder is as it was before, and nothing more is written.
        Under the attempts' lock: a worker's late `begin_attempt` comes before (the run was
        accepted) or after (it writes nothing), never between the check and the discard."""
        with self._attempt_lock:
            if self.folder.accepted or not self.folder.resuming:
                self.accept()
                return True
            self.folder.discard()
            return False

    def begin_group_attempt(self, token: str, world_size: int) -> int:
        """In-place recovery: every worker of a group start asks with the same token (inplace.py);
        the first begins the attempt, the others get its index."""
        with self._attempt_lock:
            if self.group_token != token:
                self.group_token, self.finished_step, self.group_ready = token, None, set()
                self._begin_attempt(world_size)
            return len(self.attempts) - 1

    def ready_in_group(self, token: str, world_rank: int) -> int:
        """In-place recovery: a worker of a group start is ready for its first quorum; returns
        how many are (they start together, or the first would train the run alone)."""
        with self._attempt_lock:
            if self.group_token == token:
                self.group_ready.add(world_rank)
            return len(self.group_ready)

    def join_attempt(self) -> int:
        """In-place recovery: a replacement joins the current attempt (no restart)."""
        with self._attempt_lock:
            self.replacements += 1
            return max(len(self.attempts) - 1, 0)

    def replacement_in_quorum(self) -> None:
        """In-place recovery: a replacement is about to ask for its first quorum (the test hook
        fault.wait_for_replacement_at_step waits for this, not for the join: between the two the
        replacement opens its data, and a survivor let go at the join formed a quorum alone)."""
        with self._attempt_lock:
            self.replacements_in_quorum += 1

    def register_replica(self, world_rank: int, pid: int, node_id: str, process_start: float) -> None:
        """In-place recovery: where a replica's process runs, should it have to be fenced."""
        self.replicas[(world_rank, pid)] = (node_id, process_start)

    def fence(self, world_rank: int, pid: int, missing_s: float) -> None:
        """In-place recovery: end that replica's process, missing from every step for `missing_s`
        (fence.py), by a task pinned to its node; the task logs the outcome."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from elastic_train.cluster.runlog import fence_task

        record = {"event": "fenced", "rank": world_rank, "pid": pid, "missing_s": round(missing_s, 1)}
        where = self.replicas.get((world_rank, pid))
        if where is None:
            self.log_event({**record, "outcome": "not fenced: unknown process"})
            return
        node_id, process_start = where
        record["node_id"] = node_id
        if not any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
            self.log_event({**record, "outcome": "gone with its node"})
            return
        strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
        fence_task.options(scheduling_strategy=strategy).remote(
            pid, process_start, ray.get_runtime_context().current_actor, record)

    def mark_finished(self, step: int) -> None:
        self.finished_step = step if self.finished_step is None else max(self.finished_step, step)

    def run_state(self) -> dict[str, Any]:
        """The step the run finished at (None while it trains), the latest logged step (and its
        (attempt, step): `latest`), and the reason a worker gave for ending the run (`fatal`)."""
        latest = None if self.latest is None else (self.latest["attempt"], self.latest["step"])
        return {"finished_step": self.finished_step, "replacements": self.replacements,
                "replacements_in_quorum": self.replacements_in_quorum,
                "latest_step": None if self.latest is None else self.latest["step"],
                "latest": latest, "fatal": self.fatal}

    def record_failure(self, record: dict[str, Any]) -> None:
        """A failure the failure policy saw (failures.py): the attempt it ended gets its `end`
        (cause, rank, node, the step it got to, the last committed step) in attempts.json, unless
        in place (a replacement joins the attempt), and the run's events get it."""
        record = {"time": time.time(), **record}  # the failure policy's time when it saw it
        if record.get("rank") is not None and not record.get("node"):
            record["node"] = self.rank_nodes.get(record["rank"])
        record["committed_step"] = self._committed()
        with self._attempt_lock:
            # the attempt that was running when the failure was seen: the last one begun before
            # it (a call that came late, after the controller restarted the group anyway: its
            # caller waits 5 s, finds the restart's attempt begun after it)
            failed = next((a for a in reversed(self.attempts) if a["start_time"] <= record["time"]), None)
            # an end taken for a resize when the next group began: this failure ended it
            resized = failed is not None and failed.get("end", {}).get("cause") == "resize"
            if (failed is not None and failed.get("session") == self.session
                    and ("end" not in failed or resized)
                    and record["kind"] not in ("start", "start_timeout")):
                record["attempt"] = failed["attempt"]
                record["step"] = self._step_reached(failed)
                if not record.get("in_place"):
                    if resized:
                        del failed["end"]
                        after = failed["attempt"] + 1
                        if after < len(self.attempts) and self.attempts[after]["cause"] == "resize":
                            self.attempts[after]["cause"] = "restart"
                    self._end_attempt({k: record.get(k) for k in ("cause", "rank", "node", "step",
                                                                  "committed_step")}, failed)
            elif (record["kind"] in ("start", "start_timeout") and failed is not None
                  and failed.get("session") == self.session and "end" not in failed
                  and not record.get("in_place")):
                # a group that failed to start while the last one had no end: Ray Train shut that
                # one down for a grow (it starts groups only then, or after a failure, which ended
                # the last one). It ends now, as a resize: else the driver took it for running
                # and waited without a word or a bound for a group that never came (RunWatch)
                self._end_resized(failed)
        self.failures.append(record)
        self.log_event({"event": "failure", **record})

    def _end_resized(self, attempt: dict[str, Any]) -> None:
        """`attempt`'s end: Ray Train's scaling policy shut its group down for a bigger one."""
        self._end_attempt({"cause": "resize", "step": self._step_reached(attempt),
                           "committed_step": self._committed()}, attempt)

    def _step_reached(self, attempt: dict[str, Any]) -> int | None:
        """The step `attempt` got to: its last record's (None without one)."""
        latest = self.latest if self.latest and self.latest["attempt"] == attempt["attempt"] else None
        return latest["step"] if latest else None

    def _committed(self) -> int | None:
        """The last committed step; None while Ray rewrites the snapshot (an attempt's end says
        so)."""
        try:
            return committed_step(self.folder.fs, self.folder.remote_path)
        except Exception:  # noqa: BLE001 - the store's error, whatever its type
            return None

    def end_attempt(self, end: dict[str, Any]) -> None:
        """The current attempt ended (a failure, or the run's end: finished, stopped)."""
        with self._attempt_lock:
            self._end_attempt(end)

    def _end_attempt(self, end: dict[str, Any], attempt: dict[str, Any] | None = None) -> None:
        """`end` into `attempt` (the current one by default) if it began in this session and has
        none yet."""
        current = attempt or (self.attempts[-1] if self.attempts else None)
        if current is not None and current.get("session") == self.session and "end" not in current:
            current["end"] = {"time": time.time(), **end}
            self.folder.write("attempts.json", json.dumps(self.attempts))

    def log_step(self, record: dict[str, Any], order: tuple[str, int] | None = None) -> None:
        """Rank 0's record of a step; `order`: (sender, number), see `_in_order`."""
        self._in_order(order, lambda: self._log_step(record))
        self._maybe_sync()

    def _log_step(self, record: dict[str, Any]) -> None:
        """A step's record (rank 0's; in place, the first of each committed step's). `latest`
        only moves forward in (attempt, step): a record that comes after a later one (from
        another replica, in place) is written, but does not set it back."""
        with self._state_lock:
            window = self._window(record)
            if self.latest is None or _place(record) >= _place(self.latest):
                self.latest = {**record, **window}
        self._log_metrics(record)
        self.metrics.on_step(record)
        if self.tracker is not None:
            self.tracker.add("step", record)

    def _window(self, record: dict[str, Any]) -> dict[str, float]:
        """`window_tokens_per_s`: real tokens over step seconds of the last WINDOW_STEPS steps
        (the progress line's figure: one step's rate swings with whatever that step met)."""
        if "real_tokens" not in record or "step_time_s" not in record:
            return {}
        attempt, step = _place(record)
        if self._recent and self._recent[-1][0] != attempt:
            self._recent.clear()  # a restart: its steps go back to its checkpoint
        if not self._recent or step > self._recent[-1][1]:  # not one that came late
            self._recent.append((attempt, step, record["real_tokens"], record["step_time_s"]))
            del self._recent[:-WINDOW_STEPS]
        seconds = sum(s for *_, s in self._recent)
        return {"window_tokens_per_s": sum(n for _, _, n, _ in self._recent) / seconds} if seconds > 0 else {}

    def log_committed(self, record: dict[str, Any], line: dict[str, Any] | None,
                      order: tuple[str, int] | None = None) -> None:
        """In-place recovery: every participant of a committed step sends its record and, with
        data.record_ids, a line of all its sample ids; the first is kept (within an attempt the
        committed steps only go up), so a replica lost right after the step leaves no gap. Each
        replica's records are taken in the order it sent them: every replica commits the steps
        in order, so the first record of step s+1 comes after the first of step s."""
        def take() -> None:
            if not self._first("step", record):
                return
            self._log_step(record)
            if line is not None:
                self.folder.append(f"consumed/attempt{record['attempt']:03d}-steps.jsonl",
                                   [json.dumps(line)])

        self._in_order(order, take)
        self._maybe_sync()

    def log_eval(self, record: dict[str, Any], order: tuple[str, int] | None = None) -> None:
        """An evaluation's record: in metrics.jsonl too, told apart by its `eval_loss`. In place,
        every replica sends it: the first of each (attempt, step) is kept."""
        def take() -> None:
            if not self._first("eval", record):
                return
            self.latest_eval = record
            self._log_metrics(record)
            if self.tracker is not None:
                self.tracker.add("eval", record)

        self._in_order(order, take)
        self._maybe_sync()

    def _in_order(self, order: tuple[str, int] | None, take: Callable[[], None]) -> None:
        """Take a record (`take`: its writes) in the order its sender sent it. Ray runs a
        threaded actor's calls on several threads and keeps no order between them, even between
        two calls of one caller: step 2's record was written to metrics.jsonl before step 1's
        (seen under load). A worker numbers what it sends, (sender, 0), (sender, 1), ...; one
        that comes before its predecessor waits here, and is taken right after it. A number
        that never comes (a call lost with its sender's process: nothing later is sent then)
        holds the rest HOLD_S at most. `order` None: at once."""
        if order is None:
            take()
            return
        sender, number = order
        with self._order_lock:
            if number < self._next.get(sender, 0):  # it came after the wait for it gave up
                take()
                return
            self._held.setdefault(sender, {})[number] = (time.monotonic(), take)
            self._take_held(sender)

    def _take_held(self, sender: str, waited_s: float | None = None) -> None:
        """Take `sender`'s held records that are next in its order, and past each one that has
        not come while the oldest held waited `waited_s` (HOLD_S; 0: all). Under `_order_lock`."""
        waited_s = HOLD_S if waited_s is None else waited_s
        held = self._held[sender]
        expected = self._next.get(sender, 0)
        while held:
            if expected not in held:
                if time.monotonic() - min(t for t, _ in held.values()) < waited_s:
                    break
                self.log_event({"event": "record_order_gap", "sender": sender,
                                "missing": list(range(expected, min(held)))})
                expected = min(held)  # give up on the lost one
            while expected in held:
                held.pop(expected)[1]()
                expected += 1
        self._next[sender] = expected
        if not held:
            del self._held[sender]

    def _take_all_held(self, waited_s: float | None = None) -> None:
        """Every sender's held records that waited `waited_s` (HOLD_S; 0: all, in order)."""
        with self._order_lock:
            for sender in list(self._held):
                self._take_held(sender, waited_s)

    def _start_tracker(self, settings: dict[str, Any]) -> Tracker:
        """MLflow / W&B (observe/tracking.py), fed from here: the one place that sees every record."""
        os.environ.update(settings["env"])  # the driver's MLFLOW_* / WANDB_* (WANDB_MODE=offline)
        make = functools.partial(build_backends, settings["mlflow"], settings["wandb"], self.folder.local)
        return Tracker(make, self.folder.local, settings["run_name"], settings["params"],
                       committed=lambda: committed_step(self.folder.fs, self.folder.remote_path),
                       warn=self._tracking_warning)

    def _tracking_warning(self, message: str) -> None:
        print(f"warning: {redact.shown(message)}", file=sys.stderr, flush=True)
        self.log_event({"event": "tracking_warning", "message": message})

    def finish_tracking(self, summary: dict[str, Any]) -> bool:
        """The run ended (summary.json's content): the tracked runs get what is left, the summary
        and the plots, within a bounded wait. True if they got all of it (or there are none)."""
        if self.tracker is None:
            return True
        start = time.monotonic()
        complete = self.tracker.finish(summary)
        self.log_event({"event": "tracking_finished", "complete": complete,
                        "wait_s": round(time.monotonic() - start, 3)})
        return complete

    def _first(self, kind: str, record: dict[str, Any]) -> bool:
        """True for the first record of its (attempt, step) of this kind. The keys kept, not the
        last one: this actor runs up to four calls at once, so a replica's record of step s+1 may
        be taken before every record of step s, which a high-water mark then dropped (step 159
        missing from an uninterrupted run's metrics.jsonl and consumed/, under load). The oldest
        half is forgotten past 4096 keys: no record arrives thousands of steps late."""
        key = (record["attempt"], record["step"])
        with self._logged_lock:
            kept = self.logged.setdefault(kind, set())
            if key in kept:
                return False
            kept.add(key)
            if len(kept) > 4096:
                kept.difference_update(sorted(kept)[:2048])
            return True

    def _log_metrics(self, record: dict[str, Any]) -> None:
        self.folder.append("metrics.jsonl", [json.dumps(record)])
        if self.tb is not None:
            self.tb.write(record)

    def log_consumed(self, world_rank: int, attempt: int, lines: list[dict[str, Any]]) -> None:
        self.folder.append(f"consumed/attempt{attempt:03d}-rank{world_rank:03d}.jsonl",
                           [json.dumps(line) for line in lines])

    def log_event(self, record: dict[str, Any]) -> None:
        if isinstance(record.get("rank"), int) and record.get("node"):
            self.rank_nodes[record["rank"]] = record["node"]
        if record.get("event") == "worker_started":
            self.worker_started = time.time()
        self.folder.append("events.jsonl", [json.dumps({"time": time.time(), **record})])

    def claim_fault(self, key: str) -> bool:
        """True the first time `key` is claimed in this run folder: a fault fires once."""
        with self._state_lock:
            if self.faults.get(key):
                return False
            self.faults[key] = True
            self.folder.write("faults.json", json.dumps(self.faults))
            return True

    def claim_writer(self, what: str, attempt: int, step: int) -> bool:
        """In-place recovery: True for the first replica that asks to write `what` (the final
        or a best checkpoint) of `step` in `attempt`. Every replica holds the whole state, and
        the one that asks first is alive then: a writer fixed in advance (the quorum's first
        participant) may have died right after committing the step, and nobody wrote it."""
        with self._state_lock:
            key = (what, attempt, step)
            if key in self.writers:
                return False
            self.writers.add(key)
            return True

    def claim_rollback(self, step: int, occurrence: str, message: str) -> str:
        """In-place recovery: too many non-finite steps in a row up to `step`; every replica of
        that step asks, and every one gets the answer given to its `occurrence` (the step's
        participants, world rank: pid): "rollback" the first time the run reaches `step` so
        (the same key as restart mode's claim: `rollback@<step>`, kept in faults.json), "fatal"
        when another occurrence, the replay after that rollback, reaches it again. The first
        "fatal" records `message` as the run's reason before any replica returns (`set_fatal`).
        One answer for all: a replica's own process group is itself alone, so no broadcast
        shares a decision (worker.handle_nonfinite_in_place)."""
        key = f"rollback@{step}"
        with self._state_lock:
            decision = self.nonfinite.get((step, occurrence))
            if decision is not None:
                return decision
            decision = "fatal" if self.faults.get(key) else "rollback"
            self.nonfinite[(step, occurrence)] = decision
            if decision == "rollback":
                self.faults[key] = True
                self.folder.write("faults.json", json.dumps(self.faults))
                self.log_event({"event": "rollback", "step": step, "participants": occurrence})
            else:
                self.set_fatal(message)
            return decision

    def request_checkpoint(self, reason: str) -> int:
        """A resize is coming: rank 0 checkpoints at its next step. Returns the request's ticket,
        done once rank 0 has committed a checkpoint it took the request for."""
        with self._state_lock:  # rank 0's take must not come between the request and its ticket
            self.checkpoint_request = reason
            self.tickets["asked"] += 1
            return self.tickets["asked"]

    def take_checkpoint_request(self) -> str | None:
        with self._state_lock:
            reason, self.checkpoint_request = self.checkpoint_request, None
            if reason is not None:
                self.tickets["taken"] = self.tickets["asked"]
            return reason

    def checkpoint_done(self, step: int) -> None:
        """Rank 0 committed the requested checkpoint (of this step)."""
        with self._state_lock:
            self.tickets["done"] = self.tickets["taken"]

    def checkpoint_request_done(self, ticket: int) -> bool:
        with self._state_lock:
            return self.tickets["done"] >= ticket

    def set_fatal(self, message: str) -> None:
        """A worker decided the run cannot go on (e.g. non-finite gradients after a rollback)."""
        self.fatal = message
        self.log_event({"event": "fatal", "message": message})

    def progress(self) -> dict[str, Any]:
        """The driver's poll (every second or so): also takes records held past HOLD_S."""
        self._take_all_held()
        return {"latest": self.latest, "latest_eval": self.latest_eval, "attempts": self.attempts,
                "fatal": self.fatal, "failures": self.failures, "worker_started": self.worker_started}

    def take_held(self) -> None:
        """The fit is over, its workers gone: every record still held for one before it
        (`_in_order`) is taken now, so that the summary built next counts it."""
        self._take_all_held(waited_s=0)

    def local_folder(self) -> str:
        return str(self.folder.local)

    def write_file(self, name: str, text: str) -> None:
        self.folder.write(name, text)

    def _maybe_sync(self) -> None:
        """Upload the staging copy if the last upload began flush_interval_s ago and none is
        running (the calls that come meanwhile do not start one each: every thread would be
        uploading and the driver's and workers' calls would wait). A failed upload is a
        warning: the step's other bookkeeping goes on, and the next one uploads it all."""
        if self.folder.is_local or time.time() - self._last_sync <= self.flush_interval_s:
            return
        if not self._sync_lock.acquire(blocking=False):
            return
        try:
            self._last_sync = time.time()
            self.folder.sync(pace_s=self.flush_interval_s)
        except Exception as exc:  # noqa: BLE001 - the store's error, whatever its type
            print(redact.shown(f"warning: uploading the run folder failed ({exc}); the next "
                               "upload retries"),
                  file=sys.stderr, flush=True)
            self.log_event({"event": "upload_failed", "error": str(exc)})
        finally:
            self._sync_lock.release()

    def flush(self) -> None:
        """Take the records still held (`_in_order`), then upload the staging copy now, after
        any upload running (the run's end: an OSError that names the run folder, the store's
        error and where the staging copy is)."""
        self._take_all_held(waited_s=0)
        with self._sync_lock:
            try:
                self.folder.sync()
            except Exception as exc:  # noqa: BLE001 - the store's error, whatever its type
                raise OSError(f"uploading run folder {self.folder.uri} failed ({exc}); every "
                              f"file is in its staging copy {self.folder.local}: copy them there "
                              "once the store answers") from None
            self._last_sync = time.time()


def _place(record: dict[str, Any]) -> tuple[int, int]:
    """A step record's place in the run: attempts in order, steps in order within one."""
    return record.get("attempt", 0), record["step"]


@ray.remote(num_cpus=0, max_retries=0)
def fence_task(pid: int, process_start: float, runlog: Any, record: dict[str, Any]) -> None:
    """`end_process` on the node it is pinned to; the outcome goes to the run's events."""
    runlog.log_event.remote({**record, "outcome": end_process(pid, process_start)})


def poll_progress(runlog) -> dict[str, Any]:
    """The RunLog's progress record, for `observe.progress.Progress`."""
    return ray.get(runlog.progress.remote(), timeout=10)
