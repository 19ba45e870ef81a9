"""The test hooks of `RayWorkerEnv` (the `fault.*` keys): crash, hang, pause or slow a rank at a
chosen step, in an evaluation, a checkpoint or a heal; poison a gradient; hold a group for a resize.

A mixin, so that worker.py reads as the seam it is; every hook acts only when its key is set, and
each fires once per run (the RunLog's `claim_fault`), however many attempts reach its step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import ray
import torch

from elastic_train.cluster import raycompat
from elastic_train.config import NODE_KINDS, fault_schedule
from elastic_train.recovery import checkpoints as in_place_checkpoints
from elastic_train.training.step import poison_gradient

CRASH_COMMIT_WAIT_S = 120.0  # the longest a crash hook waits for a checkpoint's commit


class FaultHooks:
    """Test hooks mixed into `worker.RayWorkerEnv` (they use its runlog, fault config, ranks and
    checkpoint bookkeeping)."""

    driver: tuple[str, int] | None = None  # the driver's (node id, pid): fault.schedule's stop
    participating_rank: int | None = None  # in place: this replica's rank among those training
    _hold_armed = False  # fault.schedule's join: rank 0 holds for the grow it waited for

    def inject_faults(self, step: int) -> None:
        """The test hooks that act at the end of a step: a crash, a hang, a slow rank."""
        f = self.fault
        if f.slow_rank == self.world_rank:
            time.sleep(f.slow_step_s)
        if f.step_pause_s:
            time.sleep(f.step_pause_s)
        if self.world_rank == 0 and (f.hold_for_resize_at_step is not None or self._hold_armed):
            self._hold_for_resize(step, f.hold_for_resize_at_step)
        if f.wait_for_replacement_at_step == step:
            ray.get(self.log_event({"event": "waiting_for_replacement", "step": step}))
            self.step_ended(None)  # a wait for an event, not a hang: out of the watchdog's sight
            while not ray.get(self.runlog.run_state.remote())["replacements_in_quorum"]:
                time.sleep(0.1)
            self.step_began(step)
        hang = f.hang_at_step == step and f.hang_rank == self.world_rank
        if hang and ray.get(self.runlog.claim_fault.remote(f"hang@{step}")):
            ray.get(self.log_event({"event": "hang_injected", "step": step}))
            threading.Event().wait()  # a live process that never finishes its step
        # in place a lost rank's steps go on without it: a fault aims at the rank taking part
        me = self.participating_rank if self.participating_rank is not None else self.world_rank
        for at, kind, rank in fault_schedule(f.schedule):
            if at == step and kind in NODE_KINDS:
                self._node_fault(kind, step)
            elif at == step and rank == me \
                    and ray.get(self.runlog.claim_fault.remote(f"{kind}@{step}")):
                self._wait_for_commit_then_log(self.last_saved_step, step, in_checkpoint=False,
                                               kind=kind)
                self._scheduled_fault(kind, step)
        if f.crash_in_checkpoint or f.crash_in_eval or f.crash_at_step != step \
                or f.crash_rank != self.world_rank:
            return
        if ray.get(self.runlog.claim_fault.remote(f"crash@{step}")):
            self._wait_for_commit_then_log(self.last_saved_step, step, in_checkpoint=False)
            os._exit(1)

    def _scheduled_fault(self, kind: str, step: int) -> None:
        """fault.schedule's fault of this rank at `step`: die, be SIGKILLed from another process,
        or SIGTERM the driver (when it runs on this node); then wait, out of the watchdog's sight,
        for the end that Ray or the driver brings."""
        if kind == "crash":
            os._exit(1)
        self.step_ended(None)
        if kind == "kill":
            subprocess.Popen(["kill", "-KILL", str(os.getpid())])
        elif self.driver is not None and self.driver[0] == ray.get_runtime_context().get_node_id():
            os.kill(self.driver[1], signal.SIGTERM)
        else:  # a driver elsewhere: nothing to stop from here, the run goes on
            self.log_event({"event": "stop_skipped", "step": step, "reason": "driver on another node"})
            self.step_began(step)
            return
        threading.Event().wait()

    def _node_fault(self, kind: str, step: int) -> None:
        """fault.schedule's lose, join or drain at `step`, which the test carries out on the
        cluster once rank 0 has announced it (`crash_injected`, after the checkpoint saved last is
        committed). lose: every rank holds (each once per run: a replay of the step goes on)
        until Ray restarts the group without the node. join: rank 0 waits for the grow's
        checkpoint request, saves the next step, then holds (as fault.hold_for_resize_at_step).
        drain: the run goes on; the drain notice asks for its own checkpoints."""
        if self.world_rank == 0 and ray.get(self.runlog.claim_fault.remote(f"{kind}@{step}")):
            self._wait_for_commit_then_log(self.last_saved_step, step, in_checkpoint=False,
                                           kind=kind)
            if kind == "join":
                self._request_granted, self._hold_armed = False, True
                self._wait_for_resize_request(step)
        if kind == "lose" and ray.get(self.runlog.claim_fault.remote(f"lose@{step}:{self.world_rank}")):
            self.step_ended(None)  # a wait for Ray, not a hang: out of the watchdog's sight
            threading.Event().wait()  # Ray ends this process when it restarts the group

    def _wait_for_resize_request(self, step: int) -> None:
        """Rank 0 waits after `step` until a grow asks for a checkpoint (granted at the next
        step's start: that step's end saves and commits it)."""
        ray.get(self.log_event({"event": "waiting_for_resize", "step": step}))
        self.step_ended(None)
        # the regular poll's call may be in flight and take the request first: wait for it too
        reason = ray.get(self._request_ref) if self._request_ref is not None else None
        self._request_ref = None
        while not reason:
            time.sleep(0.1)
            reason = ray.get(self.runlog.take_checkpoint_request.remote())
        self.step_began(step)
        self._held_request = reason

    def _hold_for_resize(self, step: int, at: int | None) -> None:
        """Test hook (fault.hold_for_resize_at_step): once a joining node's checkpoint request is
        granted (this step's end saves and commits it), hold after the next step until Ray
        replaces this group; if none is granted by step `at`, wait there for it. Once per run."""
        granted, self._request_granted = self._request_granted, False
        if step == self._hold_at and ray.get(self.runlog.claim_fault.remote(f"hold@{step}")):
            ray.get(self.log_event({"event": "holding_for_resize", "step": step}))
            threading.Event().wait()  # Ray ends this process when it restarts the group
        if self._hold_at is not None:
            return
        if granted:
            self._hold_at = step + 1
        elif step == at and ray.get(self.runlog.claim_fault.remote(f"hold_wait@{step}")):
            self._wait_for_resize_request(step)

    def maybe_crash_in_eval(self, step: int) -> None:
        """Test hook: die in the evaluation after step `crash_at_step` (after its first batch)."""
        f = self.fault
        if not f.crash_in_eval or f.crash_at_step != step or f.crash_rank != self.world_rank:
            return
        if ray.get(self.runlog.claim_fault.remote(f"crash_in_eval@{step}")):
            self._wait_for_commit_then_log(self.last_saved_step, step, in_checkpoint=False)
            os._exit(1)

    def _wait_for_commit_then_log(self, saved_step: int, step: int, in_checkpoint: bool,
                                  kind: str = "crash") -> None:
        """Before a test hook kills this process: wait (bounded) until the checkpoint saved last
        (of `saved_step`) is committed, then log the committed step in `crash_injected`.

        A checkpoint written in the background is committed only after the controller's next poll
        (see raycompat); a crash before that resumes from the one before. Tests inject a crash to
        check the resume from a known checkpoint, so the hook waits for it instead of racing it."""
        fs, run_path = raycompat.worker_run_folder()
        t0 = time.monotonic()
        if self.group is not None:  # in place: periodic checkpoints are committed by a pointer
            saved_step = max(saved_step, self.in_place_saved_step)
            committed = self._wait_for_in_place_pointer(fs, run_path, saved_step)
        elif saved_step > 0:
            committed = raycompat.wait_until_committed(fs, run_path, saved_step, CRASH_COMMIT_WAIT_S)
        else:
            committed = raycompat.committed_step(fs, run_path)
        waited_s = time.monotonic() - t0
        record = {"event": "crash_injected", "kind": kind, "step": step, "rank": self.world_rank,
                  "participating_rank": self.participating_rank,
                  "in_checkpoint": in_checkpoint, "saved_step": saved_step,
                  "committed_step": committed, "commit_wait_s": round(waited_s, 3)}
        if saved_step > 0 and (committed is None or committed < saved_step):
            record["commit_wait_timed_out"] = True  # crash anyway: the test will see it
        ray.get(self.runlog.log_event.remote(record))

    @staticmethod
    def _wait_for_in_place_pointer(fs, run_path: str, saved_step: int) -> int | None:
        """In place: wait (bounded) until the pointer names `saved_step` or later; its step."""
        deadline = time.monotonic() + CRASH_COMMIT_WAIT_S
        while True:
            pointer = in_place_checkpoints.read_pointer(fs, run_path)
            step = pointer["step"] if pointer else None
            if saved_step <= 0 or (step is not None and step >= saved_step) \
                    or time.monotonic() > deadline:
                return step
            time.sleep(0.05)

    def maybe_crash_in_heal(self) -> None:
        """Test hook (fault.crash_in_heal): the first replacement of fault.crash_rank dies as it
        starts to receive its heal from a peer (the peer is sending it)."""
        f = self.fault
        if not (f.crash_in_heal and self.joining and f.crash_rank == self.world_rank):
            return
        if ray.get(self.runlog.claim_fault.remote("crash_in_heal")):
            ray.get(self.log_event({"event": "crash_injected", "in_heal": True}))
            os._exit(1)

    def maybe_poison_gradient(self, model: torch.nn.Module, step: int) -> None:
        f = self.fault
        if f.nan_at_step != step or f.nan_rank != self.world_rank:
            return
        if f.nan_repeat or ray.get(self.runlog.claim_fault.remote(f"nan@{step}")):
            poison_gradient(model)  # this rank's own rows when sharded
