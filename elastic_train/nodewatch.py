"""Resize sooner and lose nothing: refresh Ray's resource reservations when nodes come and go.

Ray Train V2's elastic policy sizes a restart from the reservations of Ray's autoscaling
coordinator, which re-reads the cluster's nodes only every 20 s (its TICK_INTERVAL_S, not
configurable). After a node dies the restart is therefore first tried at the old size, and waits out
`scaling.worker_group_start_timeout_s` before a smaller one is tried. This driver-side thread watches
the node table and asks the coordinator to re-read it at once, so the retry after the first
(failed) start already sees the smaller cluster. It uses a private method of a Ray actor: if that is
gone in a later Ray, it logs once and Ray's own 20 s tick still applies.
"""

from __future__ import annotations

import logging
import threading
import time

import ray

logger = logging.getLogger("elastic_train")

COORDINATOR = ("AutoscalingCoordinator", "AutoscalingCoordinator")  # actor name, namespace


def alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


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
    """Background thread: when nodes die or join, refresh the coordinator's reservations; when
    one joins, ask the workers (through the RunLog actor) for a checkpoint, because Ray is about
    to restart the group at a larger size and would otherwise lose the steps since the last one."""

    def __init__(self, runlog=None, interval_s: float = 0.25) -> None:
        self.runlog = runlog
        self.interval_s = interval_s
        self.losses: list[str] = []
        self.joins: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="node-loss-watcher")

    def start(self) -> NodeWatcher:
        self._alive = alive_nodes()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _checkpoint_first(self, reason: str, timeout_s: float = 15.0) -> None:
        """Ask the workers for a checkpoint and wait (bounded) until it is committed, so that the
        resize that follows the refresh restarts from the current step."""
        ray.get(self.runlog.request_checkpoint.remote(reason))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            if ray.get(self.runlog.requested_checkpoint_step.remote()) is not None:
                return
            time.sleep(0.1)
        logger.info("no checkpoint within %.0f s of a node joining; resizing anyway", timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                now = alive_nodes()
            except Exception:  # the driver is shutting down
                return
            lost, joined = self._alive - now, now - self._alive
            self._alive = now
            if joined and self.runlog is not None:
                self._checkpoint_first(f"{len(joined)} node(s) joined")
            if lost or joined:
                self.losses.extend(lost)
                self.joins.extend(joined)
                refreshed = refresh_reservations()
                logger.info("nodes lost %s, joined %s; reservations refreshed: %s",
                            sorted(n[:12] for n in lost), sorted(n[:12] for n in joined), refreshed)
