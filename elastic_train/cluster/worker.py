"""The one seam between the training loop and Ray Train: `RayWorkerEnv`, and the worker entry.

Everything the loop needs from the outside world goes through here: the device and ranks, the data
rows of an epoch (the Ray Data shard), the latest checkpoint, saving one, logging (to the RunLog
actor); and, mixed in from their own modules, checkpoints asked for ahead of a resize
(resizerequests.py) and the fault-injection hooks that tests use (faulthooks.py).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile
import time
import uuid
from typing import Any

import numpy as np
import psutil
import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from ray.train import Checkpoint
from ray.train.v2.api.report_config import CheckpointUploadMode

from elastic_train.cluster import raycompat
from elastic_train.cluster.faulthooks import FaultHooks
from elastic_train.cluster.inplace_ray import GROUP_ENV, JOINING
from elastic_train.cluster.resizerequests import ResizeRequests
from elastic_train.config import ConfigError, FaultConfig, config_from_dict
from elastic_train.data.rowgroups import BlockTable, DataError
from elastic_train.observe.provenance import versions
from elastic_train.recovery import checkpoints as in_place_checkpoints
from elastic_train.training.checkpoint import (
    BestCheckpointWriter,
    checkpoint_name,
    staging_folder,
    write_checkpoint,
)
from elastic_train.training.watchdog import StepWatchdog, Verdict

REPORT_TRIES = 20  # a report Ray skipped (its barrier reset by a replacement) is made again this often
LAST_EVENT_WAIT_S = 10.0  # the watchdog's wait for its event to be written before the process ends


def _broadcast_from_rank0(value: Any) -> Any:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


def _reported(report) -> bool:
    """Call `report` (a `ray.train.report`); False if Ray skipped it because its barrier was
    reset: Ray 2.60 then takes back the report's index (`TrainContext.report_call_index`) and
    returns as from a report. If a later Ray moves that counter, every report counts as made."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        context = get_train_context()
        before = context.report_call_index
    except Exception:  # noqa: BLE001 - see the docstring
        context = before = None
    report()
    return context is None or context.report_call_index != before


class RayWorkerEnv(FaultHooks, ResizeRequests):
    """What `loop.train_loop` sees of Ray Train on one worker."""

    def __init__(self, fault: FaultConfig, record_ids: bool, runlog, block_table: BlockTable,
                 watchdog: StepWatchdog, extra_columns: tuple[str, ...] = (),
                 eval_table: BlockTable | None = None, provenance: dict[str, Any] | None = None,
                 startup: dict[str, float] | None = None) -> None:
        ctx = ray.train.get_context()
        # Only what the env itself acts on: the config reaches the loop one way, as its argument.
        self.fault = fault  # test hooks
        self.record_ids = record_ids  # data.record_ids: log each step's sample ids
        self.runlog = runlog
        # the records this worker sends, numbered: the RunLog takes them in this order (its
        # threads would not: runlog.py `_in_order`)
        self._sender, self._sent = f"{os.getpid()}-{uuid.uuid4().hex[:8]}", itertools.count()
        self.block_table = block_table  # the data set's blocks; the loop reads its partitions'
        self.eval_table = eval_table  # the held-out blocks (None: no evaluation)
        self.startup = dict(startup or {})  # the loop adds its phases, rank 0 logs them
        # the driver's record (data, tokenizer, git) with this worker's own library versions: a
        # worker may run another image than the driver
        driver = dict(provenance or {})
        self.provenance = {**driver, "versions": versions(), "driver_versions": driver.get("versions")}
        self.extra_columns = extra_columns  # data set columns beyond id/tokens/length, for the loss
        self.world_rank = ctx.get_world_rank()
        self.world_size = ctx.get_world_size()
        self.local_world_size = ctx.get_local_world_size()  # ranks sharing this node's memory
        self.device = ray.train.torch.get_device()
        # Where this rank runs, on each event it logs: a slow or hung rank is named by its node,
        # and a test finds the process to freeze by its pid.
        self.whereabouts = {"rank": self.world_rank, "node": ray.util.get_node_ip_address(),
                            "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}
        self.watchdog = watchdog
        self.attempt = -1
        self.last_saved_step = -1
        self._nonfinite_pending: list[int] = []
        self.fatal: str | None = None  # set when the run must stop (see handle_nonfinite)
        self.init_requests()  # checkpoints ahead of a resize (resizerequests.py)
        self.group = os.environ.get(GROUP_ENV)  # in-place recovery: the group start's token, or JOINING
        self.collective_timeout_s = watchdog.timeout_s  # in place: the group start's longest wait
        self.heal_first = False  # in place: a replacement skips the restore (it heals from a peer)
        self.checkpoint_keep = 2  # checkpoint.keep: in place, the writer's own retention
        self.in_place_saved_step = -1  # in place: the last periodic checkpoint this process wrote
        self._in_place_writer = None  # in place: the periodic checkpoints' writer (checkpoints.py)
        self._restored = contextlib.ExitStack()  # a remote checkpoint's local copy, until the next step

    # -- model, data, checkpoints --------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module,
                      ddp_kwargs: dict[str, Any] | None) -> torch.nn.Module:
        """Move to this worker's device; wrap in DDP with `ddp_kwargs` unless they are None (the
        loop reduces gradients itself). Ray wraps nothing at world size 1."""
        return ray.train.torch.prepare_model(model, parallel_strategy="ddp" if ddp_kwargs is not None
                                             else None, parallel_strategy_kwargs=ddp_kwargs)

    def latest_checkpoint_dir(self) -> str | None:
        """The newest checkpoint, Ray's or one written in place (recovery/checkpoints.py), as a
        local folder; None without one, or for a replacement in place that heals from a live peer
        instead (`heal_first`: the peer's state is newer than any checkpoint)."""
        if self.heal_first:
            self.log_event({"event": "restore_skipped", "reason": "a live peer heals this replica"})
            return None
        checkpoint = ray.train.get_checkpoint()
        fs, run_path = raycompat.worker_run_folder()
        pointer = in_place_checkpoints.read_pointer(fs, run_path)
        ray_name = os.path.basename(checkpoint.path.rstrip("/")) if checkpoint is not None else None
        chosen = in_place_checkpoints.newest(
            ray_name, raycompat.checkpoint_step(ray_name) if ray_name else None, pointer)
        if chosen is None:
            return None
        t0 = time.monotonic()
        self._restored.close()
        if chosen[0] != ray_name:  # written in place, newer than Ray's
            local = self._local_copy(fs, f"{run_path}/{chosen[0]}")
            if local != f"{run_path}/{chosen[0]}":
                self._restored.callback(shutil.rmtree, local, ignore_errors=True)
        else:
            # Local storage: the checkpoint's own folder. Remote: one download per node into a
            # temporary folder the node's local ranks share (Ray's file locks), deleted when the
            # last of them has begun its next step (step_began): a node's disk keeps no copy
            # of each checkpoint a run ever restored.
            local = self._restored.enter_context(checkpoint.as_directory())
        self.log_event({"event": "restore", "rank": self.world_rank,
                        "node": ray.get_runtime_context().get_node_id(),
                        "checkpoint": chosen[0], "local_dir": local,
                        "seconds": round(time.monotonic() - t0, 3)})
        state_path = os.path.join(local, "state.json")
        if os.path.exists(state_path):
            import json

            with open(state_path) as f:
                self.last_saved_step = json.load(f)["train_state"]["step"]
        return local

    @staticmethod
    def _local_copy(fs, directory: str) -> str:
        """A folder of the run's storage as a local path (copied for remote storage)."""
        import pyarrow.fs as pafs

        if isinstance(fs, pafs.LocalFileSystem):
            return directory
        local = tempfile.mkdtemp(prefix="elastic-train-restore-")
        pafs.copy_files(directory, local, source_filesystem=fs)
        return local

    def save_in_place(self, snap: dict, step: int) -> None:
        """In place: write a periodic checkpoint from this live participant, outside Ray's report
        barrier (recovery/checkpoints.py), in the background; the loop is blocked only for the
        snapshot already taken. Test hook: fault.crash_in_checkpoint at fault.crash_at_step ends
        this process halfway through the write."""
        if self._in_place_writer is None:
            fs, run_path = raycompat.worker_run_folder()

            def protected() -> str | None:  # Ray's latest: its own retention's, never ours
                try:
                    return raycompat.committed_checkpoint_dir(fs, run_path)
                except raycompat.SnapshotUnreadable:
                    return None

            self._in_place_writer = in_place_checkpoints.InPlaceCheckpointWriter(
                fs, run_path, self.checkpoint_keep, protected)
        f = self.fault
        crash = (f.crash_in_checkpoint and f.crash_at_step == step and f.crash_rank == self.world_rank
                 and ray.get(self.runlog.claim_fault.remote(f"crash_in_checkpoint@{step}")))
        if crash:
            ray.get(self.log_event({"event": "crash_injected", "step": step, "in_checkpoint": True,
                                    "saved_step": self.in_place_saved_step}))
        self.in_place_saved_step = step

        def committed(at: int, write_s: float) -> None:
            self.log_event({"event": "checkpoint_committed", "step": at, "write_s": round(write_s, 3)})

        self._in_place_writer.submit(snap, step, committed, crash_midway=crash)

    def wait_for_checkpoints(self) -> None:
        """In place: until the periodic checkpoint in flight is written (the run's end)."""
        if self._in_place_writer is not None:
            self._in_place_writer.wait()

    def save_checkpoint(self, snap: dict | None, step: int, final: bool) -> None:
        """Every rank reports (a barrier) with its share of the checkpoint, written in the
        background into the same checkpoint folder (`snap` None: this rank has no share).

        In place, Ray resets that barrier when it replaces a replica group, and a rank waiting in
        it returns from `ray.train.report` as if it had reported (Ray 2.60 logs "Synchronization
        barrier was reset ... Skipping this report"). A survivor in its final report when its
        peer died then ended without reporting, and the replacement waited in the barrier for
        it for ever: a skipped report is made again (`_reported`)."""
        if step == self.last_saved_step:
            return
        previous, self.last_saved_step = self.last_saved_step, step
        for attempt in range(REPORT_TRIES):
            if self._report_once(snap, step, final, previous, first=attempt == 0):
                return
            self.log_event({"event": "report_skipped", "step": step, "final": final,
                            "why": "Ray reset the report barrier (a replica group replaced in place)"})
        raise RuntimeError(f"Ray skipped the report of step {step} {REPORT_TRIES} times in a row: its "
                           "barrier was reset by as many replacements of a replica group")

    def _report_once(self, snap: dict | None, step: int, final: bool, previous: int,
                     first: bool) -> bool:
        if snap is None:
            return _reported(lambda: ray.train.report({"step": step}))
        crash = (
            first
            and self.fault.crash_in_checkpoint
            and self.fault.crash_at_step == step
            and self.world_rank == 0
            and ray.get(self.runlog.claim_fault.remote(f"crash_in_checkpoint@{step}"))
        )
        checkpoint = Checkpoint.from_directory(staging_folder())

        def upload_fn(ckpt: Checkpoint, dir_name: str) -> Checkpoint:
            try:
                if crash:  # the test hook dies mid-write once the checkpoint before is committed
                    self._wait_for_commit_then_log(previous, step, in_checkpoint=True)
                storage = ray.train.get_context().get_storage()
                written = f"{storage.experiment_fs_path}/{dir_name}"
                if self.group is not None and in_place_checkpoints.is_whole(
                        storage.storage_filesystem, written):
                    # in place, the final step's periodic checkpoint, written whole already: Ray
                    # registers that folder (rewriting it could leave it half written)
                    return Checkpoint(written, filesystem=storage.storage_filesystem)
                write_checkpoint(snap, ckpt.path, crash_midway=crash)
                return storage.persist_current_checkpoint(ckpt, dir_name)
            finally:  # the local copy, copied or not (Ray deletes an ASYNC upload's only)
                shutil.rmtree(ckpt.path, ignore_errors=True)

        reported = _reported(lambda: ray.train.report(
            {"step": step},
            checkpoint=checkpoint,
            checkpoint_dir_name=checkpoint_name(step),
            checkpoint_upload_mode=CheckpointUploadMode.SYNC if final else CheckpointUploadMode.ASYNC,
            checkpoint_upload_fn=upload_fn,
            delete_local_checkpoint_after_upload=False,  # upload_fn has
        ))
        if not reported:  # skipped before the upload: its folder was never used
            shutil.rmtree(checkpoint.path, ignore_errors=True)
        return reported

    # -- logging ---------------------------------------------------------------------------------
    def begin_attempt(self) -> int:
        if self.group is not None:  # in-place recovery: no collective across the replicas
            w = self.whereabouts
            ray.get(self.runlog.register_replica.remote(self.world_rank, w["pid"], w["node_id"],
                                                        self.startup["process_start"]))
            if self.joining:
                self.attempt = ray.get(self.runlog.join_attempt.remote())
                self.log_event({"event": "replacement_joined", "attempt": self.attempt})
            else:
                self.attempt = ray.get(self.runlog.begin_group_attempt.remote(self.group, self.world_size))
                self._wait_for_group()
            return self.attempt
        attempt = None
        if self.world_rank == 0:
            attempt = ray.get(self.runlog.begin_attempt.remote(self.world_size))
        self.attempt = _broadcast_from_rank0(attempt)
        return self.attempt

    def _order(self) -> tuple[str, int]:
        return self._sender, next(self._sent)

    def log_step(self, record: dict[str, Any]) -> None:
        self.runlog.log_step.remote(record, self._order())

    def _wait_for_group(self) -> None:
        """In place: the workers of a group start meet before their first quorum, or the first
        one up would train alone (a quorum of one is valid) and the others start far behind.
        Bounded by scaling.collective_timeout_s (a worker lost before it is ready)."""
        deadline = time.monotonic() + self.collective_timeout_s
        while ray.get(self.runlog.ready_in_group.remote(self.group, self.world_rank)) < self.world_size:
            if time.monotonic() > deadline:
                self.log_event({"event": "group_start_incomplete"})
                return
            time.sleep(0.05)

    # -- in-place recovery (inplace.py) ----------------------------------------------------------
    @property
    def joining(self) -> bool:
        """This worker replaces a lost replica of a running group."""
        return self.group == JOINING

    def run_finished(self) -> int | None:
        return ray.get(self.runlog.run_state.remote())["finished_step"]

    def latest_step(self) -> int | None:
        return ray.get(self.runlog.run_state.remote())["latest_step"]

    def mark_finished(self, step: int) -> None:
        ray.get(self.runlog.mark_finished.remote(step))

    def asked_for_quorum(self) -> None:
        self.runlog.replacement_in_quorum.remote()

    def claim_writer(self, what: str, attempt: int, step: int) -> bool:
        return ray.get(self.runlog.claim_writer.remote(what, attempt, step))

    @property
    def fence_after_s(self) -> float:
        """A replica missing this long is frozen (fence.py): by default, its own watchdog would
        have ended it by then, and written its last event."""
        if self.fault.fence_after_s is not None:
            return self.fault.fence_after_s
        return self.watchdog.timeout_s + LAST_EVENT_WAIT_S

    def log_committed(self, record: dict[str, Any], ids: list[int] | None) -> None:
        line = None
        if ids is not None:
            line = {"attempt": record["attempt"], "step": record["step"], "epoch": record["epoch"],
                    "participants": record["world_size"], "ids": ids}
        self.runlog.log_committed.remote(record, line, self._order())

    def fence(self, world_rank: int, pid: int, missing_s: float) -> None:
        self.runlog.fence.remote(world_rank, pid, missing_s)

    def log_event(self, record: dict[str, Any]) -> Any:
        return self.runlog.log_event.remote({**self.whereabouts, **record})

    # -- the step watchdog (watchdog.py) ---------------------------------------------------------
    def step_began(self, step: int) -> None:
        self._restored.close()  # restored: the state is in memory (latest_checkpoint_dir)
        self.watchdog.begin_step(step)

    def step_ended(self, step_time_s: float | None) -> None:
        self.watchdog.end_step(step_time_s)

    def on_verdict(self, verdict: Verdict) -> None:
        """Runs on the watchdog's thread: report a slow step; end the process on a timeout."""
        record = {"step": verdict.step, "elapsed_s": round(verdict.elapsed_s, 3),
                  "median_s": verdict.median_s}
        if verdict.kind == "slow":
            self.log_event({"event": "slow_step", **record})
            return
        try:  # the event first, if the RunLog takes it in time: it says why the attempt ended
            ray.get(self.log_event({"event": "step_timeout", **record}), timeout=LAST_EVENT_WAIT_S)
        finally:
            os._exit(1)  # the main thread may be blocked for good: only ending the process is sure

    def log_eval(self, record: dict[str, Any]) -> None:
        self.runlog.log_eval.remote(record, self._order())

    def best_writer(self) -> BestCheckpointWriter:
        return BestCheckpointWriter(*raycompat.worker_run_folder())

    def log_consumed(self, attempt: int, state, micro_batches) -> None:
        if not self.record_ids:
            return
        ids = np.concatenate([mb.ids for mb in micro_batches]).tolist() if micro_batches else []
        line = {"attempt": attempt, "rank": self.world_rank, "step": state.step,
                "epoch": state.epoch if state.step_in_epoch else state.epoch - 1, "ids": ids}
        self.runlog.log_consumed.remote(self.world_rank, attempt, [line])

    # -- the non-finite policy ------------------------------------------------------------------
    def handle_nonfinite(self, step: int, micro_batches) -> None:
        """Too many non-finite steps in a row: roll back once (restart from the last checkpoint);
        the second time at the same step, stop the run naming the step and its sample ids.

        Every rank calls this at the same step (the skip decision is all-reduced). In place,
        `handle_nonfinite_in_place` instead."""
        from elastic_train.training.collectives import gather_from_all
        from elastic_train.training.step import NonFiniteError

        mine = [int(i) for mb in micro_batches for i in mb.ids]
        ids = sorted(i for rank_ids in gather_from_all(mine) for i in rank_ids)
        first_time = None
        if self.world_rank == 0:
            first_time = ray.get(self.runlog.claim_fault.remote(f"rollback@{step}"))
        first_time = _broadcast_from_rank0(first_time)
        if first_time:
            if self.world_rank == 0:
                self.runlog.log_event.remote({"event": "rollback", "step": step})
            raise NonFiniteError(f"non-finite gradients up to step {step}: rolling back")
        message = _nonfinite_message(step, ids, "all ranks")
        if self.world_rank == 0:  # before any rank returns: the driver reads it after fit()
            ray.get(self.runlog.set_fatal.remote(message))
        self.fatal = message
        raise NonFiniteError(message)

    def handle_nonfinite_in_place(self, step: int, participants: dict[int, int], ids: list[int],
                                  whole_step: bool) -> None:
        """In place, the same policy, decided by the RunLog for every replica alike.

        Each replica's process group is itself alone: a broadcast from world rank 0 reaches no
        other replica, which then took the first time for the second and stopped alone, silently.
        Every replica of the step asks the RunLog (`claim_rollback`), naming the occurrence by
        the step's participants (world rank: pid, the same on each: they ride in its all-reduce),
        and gets the one answer given to that occurrence. Either answer ends every replica:
        "rollback" raises, Ray replaces each (or restarts the group) and, no live replica holding
        the run's state, they restore the last checkpoint (replica.settle_unrestored), replaying
        the step as other processes: a new occurrence, answered "fatal". "fatal": the RunLog
        holds the reason before any replica returns (`train_worker`). `ids`: the step's sample
        ids, every partition's (`whole_step`, data.record_ids) or this replica's own."""
        from elastic_train.training.step import NonFiniteError

        scope = "every partition" if whole_step else "this replica's partitions"
        message = _nonfinite_message(step, sorted(ids), scope)
        occurrence = ",".join(f"{rank}:{pid}" for rank, pid in sorted(participants.items()))
        decision = ray.get(self.runlog.claim_rollback.remote(step, occurrence, message))
        if decision == "rollback":
            raise NonFiniteError(f"non-finite gradients up to step {step}: rolling back")
        self.fatal = message
        raise NonFiniteError(message)


def _nonfinite_message(step: int, ids: list[int], scope: str) -> str:
    """The reason a run stops on non-finite gradients: the step and its sample ids (256 shown)."""
    shown = ids if len(ids) <= 256 else [*ids[:256], "..."]
    return (f"non-finite gradients at step {step} again after a rollback; the sample ids "
            f"of that step's batch ({len(ids)}, {scope}): {shown}")


def train_worker(config: dict[str, Any]) -> None:
    """Entry point of every Ray Train worker (`train_loop_per_worker`)."""
    # Ray started this process, imported its modules and formed the process group before this.
    startup = {"process_start": psutil.Process().create_time(), "train_fn_start": time.time()}
    from elastic_train.cluster import raydata  # noqa: F401  (registers data.reader=ray_data)
    from elastic_train.recovery.inplace import in_place_loop
    from elastic_train.training.loop import train_loop
    from elastic_train.training.memory import ModelTooLargeError
    from elastic_train.training.step import NonFiniteError

    cfg = config_from_dict(config["config"])
    if not cfg.scaling.use_gpu:
        torch.set_num_threads(cfg.scaling.torch_threads)
    _make_nccl_dump_folder()
    # in place, one step may wait out three timeouts (its quorum, its all-reduce with a hung peer,
    # the commit vote) before the survivors go on without the peer: only a step past them all is
    # this worker's own hang
    waits = 3 if cfg.fault.recovery == "in_place" else 1
    watchdog = StepWatchdog(waits * cfg.scaling.collective_timeout_s, cfg.scaling.slow_step_factor)
    env = RayWorkerEnv(cfg.fault, cfg.data.record_ids, config["runlog"], config["block_table"],
                       watchdog, tuple(config["extra_columns"]), config.get("eval_table"),
                       config.get("provenance"), startup)
    env.checkpoint_keep, env.driver = cfg.checkpoint.keep, config.get("driver")
    # the first sign of this process in the run's events (a fault schedule from outside finds a
    # replacement by it while it still starts, restores or heals: tests, benchmarks/recovery.py)
    env.log_event({"event": "worker_started", "process_start": startup["process_start"],
                   "joining": env.joining})
    if ray.get(config["runlog"].progress.remote())["fatal"]:
        return  # an earlier attempt found what stops this run (see below)
    watchdog.start(env.on_verdict)
    try:
        loop = in_place_loop if cfg.fault.recovery == "in_place" else train_loop
        loop(cfg, env, config.get("model_fn"), config.get("loss_fn"))
    except (ModelTooLargeError, DataError, ConfigError) as exc:
        # A restart would fail the same way: the RunLog keeps the reason, which the driver reports
        # as the failure; raising makes Ray stop the other ranks (which may wait in a collective),
        # and the restarted group sees the reason and returns at once.
        ray.get(env.runlog.set_fatal.remote(str(exc)))
        raise
    except NonFiniteError:
        if env.fatal is None:
            # the first time: Ray restarts the group from the last checkpoint (in place: replaces
            # every replica, which all raise, and they restore it: handle_nonfinite_in_place)
            raise
        # The run is over and the RunLog holds the reason, which the driver reports as the
        # failure. Raising would only make Ray restart the group to fail the same way again
        # (forever with scaling.max_failures=-1). No final checkpoint is saved.
    finally:
        watchdog.stop()


def _make_nccl_dump_folder() -> None:
    """NCCL's flight recorder writes its dump to TORCH_NCCL_DEBUG_INFO_TEMP_FILE + rank (set by the
    driver on GPU runs, api.nccl_env) but does not create the folder."""
    prefix = os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    if prefix:
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
