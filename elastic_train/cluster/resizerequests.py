"""Rank 0's side of a checkpoint ahead of a resize: a checkpoint now saves the work a resize
would lose.

Two sources ask for one: the driver's node watcher (nodewatch.py: a node joined, a grow waits for
the checkpoint) through the RunLog, and Ray's drain notice (a spot reclaim or a scale-down), which
the worker reads itself and answers twice: at once, and as late before the deadline as is safe.
A mixin of `worker.RayWorkerEnv` (it uses the env's runlog, rank and `log_event`), as
`faulthooks.FaultHooks` is; its `hold_for_resize` hook shares the request state set up here.
"""

from __future__ import annotations

import time
from collections import deque

import ray

from elastic_train.cluster import raycompat

REQUEST_POLL_INTERVAL_S = 1.0  # how often rank 0 asks the RunLog whether a checkpoint is wanted
REQUEST_COMMIT_WAIT_S = 60.0  # the longest rank 0 waits for Ray to commit a requested checkpoint


class ResizeRequests:
    """Checkpoint requests ahead of a resize, mixed into `worker.RayWorkerEnv`."""

    def init_requests(self) -> None:
        """The request state, empty (called from the env's `__init__`)."""
        self._held_request: str | None = None  # hold_for_resize: a request it took ...
        self._request_granted = False  # ... whether this step's end saves a requested checkpoint
        self._hold_at: int | None = None  # ... and the step after which it holds
        self._request_ref = None  # checkpoint_requested: the RunLog call in flight ...
        self._last_request_poll = -REQUEST_POLL_INTERVAL_S  # ... and when it was made
        self._last_poll: float | None = None  # preemption_notice: when it last ran ...
        self._step_intervals: deque[float] = deque(maxlen=8)  # ... and the times between
        self._saving_requested = False  # ... whether the step since then saved a requested checkpoint
        self._requested_checkpoint_s = 0.0  # ... and the longest such step (its commit included)
        self._preemption_seen = None  # the drain notice already acted on ...
        self._late_saved = False  # ... and whether its last checkpoint before the deadline was

    def checkpoint_requested(self) -> bool:
        """Rank 0 only, never blocking: is a resize coming, so that a checkpoint now saves work?

        Either Ray announced that a node of this group is being drained (a spot reclaim or a
        scale-down: `preemption_notice`), or the driver's node watcher asked (a node joined)."""
        if self.world_rank != 0:
            return False
        if self._held_request:
            reason, self._held_request = self._held_request, None
            self.runlog.log_event.remote({"event": "checkpoint_requested", "reason": reason})
            self._request_granted = self._saving_requested = True
            return True
        notice = self.preemption_notice()
        if notice:
            self.runlog.log_event.remote({"event": "checkpoint_requested", "reason": notice})
            self._saving_requested = True
            return True
        ref = self._request_ref
        if ref is None:
            # At most one actor call a second, not one a step: a node joining waits that long more.
            now = time.monotonic()
            if now - self._last_request_poll < REQUEST_POLL_INTERVAL_S:
                return False
            self._last_request_poll = now
            self._request_ref = self.runlog.take_checkpoint_request.remote()
            return False
        ready, _ = ray.wait([ref], timeout=0)
        if not ready:
            return False
        self._request_ref = None
        reason = ray.get(ref)
        if reason:
            self.runlog.log_event.remote({"event": "checkpoint_requested", "reason": reason})
            self._request_granted = self._saving_requested = True
        return bool(reason)

    def preemption_notice(self) -> str | None:
        """Why to checkpoint now because a node of this group is being drained; None otherwise.

        Ray Train's PreemptionWatcher polls Ray's drain table (spot reclaims, scale-downs) and marks
        every worker; the group keeps running until the drain deadline, then Ray restarts it
        without that node. A new notice asks for a checkpoint at once; when the notice carries a
        deadline, one more is asked for as late as is safe: the longest step that saved a
        requested checkpoint (the first one's, its wait for Ray's commit included), plus three of
        the slowest recent step times, plus 0.5 s before it, so that at most a few steps are lost
        and the last checkpoint is committed before the node goes. This reads the mark where
        `ray.train.get_preemption_info()` reads it, without that call's barrier across workers (an
        actor round trip on every step): the step's own all-reduce spreads rank 0's answer.
        Ray-internal; if a later Ray moves it, drains are not seen here and cost what a lost node
        costs.
        """
        now = time.monotonic()
        if self._last_poll is not None:  # once per step: the recent step times, checkpoints too
            interval = now - self._last_poll
            self._step_intervals.append(interval)
            if self._saving_requested:  # that step saved a requested checkpoint and waited for its commit
                self._requested_checkpoint_s = max(self._requested_checkpoint_s, interval)
        self._saving_requested = False
        self._last_poll = now
        try:
            from ray.train.v2._internal.execution.context import get_train_context

            info = get_train_context().preemption_context.preemption_info
        except Exception:  # noqa: BLE001 - see the docstring
            return None
        if info is None:
            return None
        nodes = ", ".join(n[:12] for n in info.preempted_node_ids)
        if info != self._preemption_seen:
            self._preemption_seen, self._late_saved = info, False
            return f"node(s) {nodes} draining (ranks {info.preempted_ranks}, deadline_ms {info.deadline_ms})"
        if info.deadline_ms and not self._late_saved:
            left = info.deadline_ms / 1000 - time.time()
            if left < self._requested_checkpoint_s + 3 * max(self._step_intervals, default=1.0) + 0.5:
                self._late_saved = True
                return f"node(s) {nodes} drained in {left:.1f} s: the last checkpoint before"
        return None

    def checkpoint_committed(self, step: int) -> None:
        """Rank 0, after saving a requested checkpoint: wait until Ray has committed it, then say
        so. A report that has returned is only queued: Ray commits it at the controller's next
        poll, and a grow let through before that would restart from the checkpoint before."""
        if self.world_rank != 0:
            return
        fs, run_path = raycompat.worker_run_folder()
        committed = raycompat.wait_until_committed(fs, run_path, step, REQUEST_COMMIT_WAIT_S)
        if committed is not None and committed >= step:
            ray.get(self.runlog.checkpoint_done.remote(step))
        else:  # the grow waiting for it goes ahead after its own wait (nodewatch.GrowHold)
            self.log_event({"event": "checkpoint_not_committed", "step": step,
                            "waited_s": REQUEST_COMMIT_WAIT_S})
