"""Resize sooner and lose nothing: refresh Ray's resource reservations when nodes come and go, and
let a grow wait for a checkpoint of the current step.

Ray Train V2's elastic policy sizes a restart from the reservations of Ray's autoscaling
coordinator, which re-reads the cluster's nodes only every 20 s (its TICK_INTERVAL_S, not
configurable). After a node dies the restart is therefore first tried at the old size, and waits out
`scaling.worker_group_start_timeout_s` before a smaller one is tried. `NodeWatcher`, a driver-side
thread, watches the node table and asks the coordinator to re-read it at once, so the retry after
the first (failed) start already sees the smaller cluster, and a joined node is seen at once.

A grow restarts a healthy group: without a checkpoint of the step it is at, the steps since the last
periodic checkpoint would be trained again. `CheckpointBeforeGrow`, Ray's elastic policy with one
change, holds a grow decision until rank 0 has committed a checkpoint asked for by that decision.
It is the one place that decides, so it closes the race a driver-side request had with Ray's own
20 s tick (a tick right after the join grew the group before the requested checkpoint was saved).

`start_coordinator` starts that coordinator while the driver sets the run up, not after the
controller has started: it is on the path to the first step.

All reach into Ray 2.60 internals (the coordinator's `_tick` and its factory, the scaling policy
classes, and `Trainer._initialize_and_run_controller` in cluster/driver.py); tests/test_grow_hold.py (the
policy seams), tests/test_elastic.py (the tick) and tests/test_train_ray.py (the factory) fail if
they move.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import ray
from ray.train.v2._internal.execution.scaling_policy import (
    ElasticScalingPolicy,
    NoopDecision,
    ResizeDecision,
    ScalingDecision,
)

logger = logging.getLogger("elastic_train")

COORDINATOR = ("AutoscalingCoordinator", "AutoscalingCoordinator")  # actor name, namespace
# The longest a grow waits for its checkpoint: a synchronous save of a large model, or a step or an
# evaluation in between, can take a while; after that it grows anyway (and says so in events.jsonl).
GROW_CHECKPOINT_WAIT_S = 120.0
RUNLOG_CALL_TIMEOUT_S = 10.0


def alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def start_coordinator() -> bool:
    """Start Ray Train's autoscaling coordinator now, from the driver, while the run is set up.
    Ray Train creates it (a detached actor, one per cluster: created once, then found) when its
    controller starts and waits for it before it starts any worker: ~1 s of every run's start-up on
    the path to the first step. Started here, its process comes up beside the driver's own work.
    Ray Data's function, which Ray Train's client calls (tests/test_train_ray.py checks that both
    find the one actor). False if it could not."""
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )

        get_or_create_autoscaling_coordinator()
        return True
    except Exception as exc:  # a Ray without it: Ray Train starts its own, as before
        logger.info("could not start Ray's autoscaling coordinator early: %s", exc)
        return False


def refresh_reservations() -> bool:
    """Make the autoscaling coordinator re-read the cluster now; False if it cannot."""
    try:
        coordinator = ray.get_actor(COORDINATOR[0], namespace=COORDINATOR[1])
        ray.get(coordinator._tick.remote(), timeout=10)
        return True
    except Exception as exc:  # no coordinator (fixed-size run) or a Ray without _tick
        logger.info("could not refresh Ray's resource reservations: %s", exc)
        return False


class NodeWatcher:
    """Background thread: when nodes die or join, refresh the coordinator's reservations."""

    def __init__(self, interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self.losses: list[str] = []
        self.joins: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="node-watcher")

    def start(self) -> NodeWatcher:
        self._alive = alive_nodes()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                now = alive_nodes()
            except Exception:  # the driver is shutting down
                return
            lost, joined = self._alive - now, now - self._alive
            self._alive = now
            if lost or joined:
                self.losses.extend(lost)
                self.joins.extend(joined)
                refreshed = refresh_reservations()
                logger.info("nodes lost %s, joined %s; reservations refreshed: %s",
                            sorted(n[:12] for n in lost), sorted(n[:12] for n in joined), refreshed)


class GrowHold:
    """Whether a grow of the running group may go ahead: once the checkpoint asked for it is
    committed, or `wait_s` after asking. `ask(reason)` requests a checkpoint and returns its
    ticket; `done(ticket)` says whether it is committed; `clock` is injectable for tests."""

    def __init__(self, ask: Callable[[str], int], done: Callable[[int], bool],
                 gave_up: Callable[[dict], None], wait_s: float = GROW_CHECKPOINT_WAIT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ask, self.done, self.gave_up = ask, done, gave_up
        self.wait_s, self.clock = wait_s, clock
        self._held: tuple[float, int, float] | None = None  # (group start, ticket, asked at)

    def allow(self, group_start: float, from_workers: int, to_workers: int) -> bool:
        if self._held is None or self._held[0] != group_start:
            self._held = (group_start, self.ask(f"growing from {from_workers} to {to_workers} "
                                                "workers"), self.clock())
        _, ticket, asked_at = self._held
        if self.done(ticket):
            self._held = None
            return True
        waited_s = self.clock() - asked_at
        if waited_s < self.wait_s:
            return False
        self._held = None
        self.gave_up({"event": "grow_without_checkpoint", "waited_s": round(waited_s, 1),
                      "from_workers": from_workers, "to_workers": to_workers})
        return True

    def clear(self) -> None:
        """No grow is wanted any more: the next one asks for a checkpoint of its own."""
        self._held = None


class CheckpointBeforeGrow(ElasticScalingPolicy):
    """Ray Train's elastic policy, except that a grow of a running group waits for a checkpoint
    of the step the group is at (`GrowHold`), and the decision is looked at again at every poll of
    the controller meanwhile, so the group grows right after the commit. Shrinks and restarts of a
    failed group are Ray's own: a dead worker's steps since the last checkpoint are lost anyway."""

    def __init__(self, scaling_config, runlog) -> None:
        super().__init__(scaling_config)

        def ask(reason: str) -> int:
            return ray.get(runlog.request_checkpoint.remote(reason), timeout=RUNLOG_CALL_TIMEOUT_S)

        def done(ticket: int) -> bool:
            return ray.get(runlog.checkpoint_request_done.remote(ticket),
                           timeout=RUNLOG_CALL_TIMEOUT_S)

        self.hold = GrowHold(ask, done, gave_up=lambda record: runlog.log_event.remote(record))

    def make_decision_for_running_worker_group(self, worker_group_state,
                                               worker_group_status) -> ScalingDecision:
        decision = super().make_decision_for_running_worker_group(worker_group_state,
                                                                  worker_group_status)
        current = worker_group_state.num_workers
        if not isinstance(decision, ResizeDecision) or decision.num_workers <= current:
            self.hold.clear()
            return decision
        try:
            allowed = self.hold.allow(worker_group_state.start_time, current, decision.num_workers)
        except Exception as exc:  # the RunLog is gone (the run is ending): Ray's decision stands
            logger.warning("growing without a checkpoint first: %s", exc)
            self.hold.clear()
            return decision
        if allowed:
            return decision
        self._latest_monitor_time = float("-inf")  # decide again at the controller's next poll
        return NoopDecision()
