"""Which checkpoint Ray Train counts as committed: the one reach into Ray's internals for that.

Read from Ray 2.60 (`ray/train/v2/_internal/`): a checkpoint reported with
`CheckpointUploadMode.ASYNC` is written by a background thread, queued on the worker, taken by the
controller's next poll, paired with the reports of every other rank, and only then registered by
the controller's `CheckpointManager`, which rewrites `checkpoint_manager_snapshot.json`
(`constants.CHECKPOINT_MANAGER_SNAPSHOT_FILENAME`) in the run folder, `latest_checkpoint_result.
checkpoint_dir_name` naming the latest one. After a failure Ray restarts from exactly that
checkpoint. So a checkpoint is *committed* once that file names it: a crash before that loses it
(and the steps since the one before), however complete its files are.

Ray writes the file in place (`open_output_stream`, not a rename): a read may see it empty or half
written, which is read again, never taken for "no checkpoint". If a later Ray renames the file or
its fields, the tests of `tests/test_raycompat.py` fail (they build the file with Ray's own model).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pyarrow.fs as pafs

RAY_VERSION_READ = "2.60"
SNAPSHOT_FILENAME = "checkpoint_manager_snapshot.json"  # CHECKPOINT_MANAGER_SNAPSHOT_FILENAME
_STEP_DIR = re.compile(r"checkpoint_(\d+)")  # our names: worker.save_checkpoint's checkpoint_dir_name


class SnapshotFormatError(RuntimeError):
    """Ray's checkpoint-manager snapshot is not what this module was written against."""


class SnapshotUnreadable(RuntimeError):
    """The snapshot stayed half written (not valid JSON) over every read."""


def committed_checkpoint_dir(fs: pafs.FileSystem, run_path: str, retries: int = 50,
                             retry_s: float = 0.02) -> str | None:
    """The folder name of the run's latest committed checkpoint; None if none is committed yet.

    `run_path` is the run folder on `fs` (`<storage_path>/<run.name>`). A half-written snapshot is
    read again, up to `retries` times `retry_s` apart, then SnapshotUnreadable; a snapshot
    without the fields read here raises SnapshotFormatError."""
    path = f"{run_path.rstrip('/')}/{SNAPSHOT_FILENAME}"
    for _ in range(retries):
        try:
            with fs.open_input_stream(path) as f:
                text = f.read().decode("utf-8")
        except FileNotFoundError:
            return None
        try:
            state = json.loads(text)
        except ValueError:  # caught Ray mid-write
            time.sleep(retry_s)
            continue
        return _latest_dir_name(state, path)
    raise SnapshotUnreadable(f"{path}: not valid JSON after {retries} reads")


def _latest_dir_name(state: Any, path: str) -> str | None:
    if not isinstance(state, dict) or "latest_checkpoint_result" not in state:
        raise SnapshotFormatError(f"{path}: no latest_checkpoint_result (read from Ray "
                                  f"{RAY_VERSION_READ}); has Ray changed its snapshot format?")
    latest = state["latest_checkpoint_result"]
    if latest is None:
        return None
    if not isinstance(latest, dict) or not isinstance(latest.get("checkpoint_dir_name"), str):
        raise SnapshotFormatError(f"{path}: latest_checkpoint_result has no checkpoint_dir_name")
    return latest["checkpoint_dir_name"]


def checkpoint_step(dir_name: str) -> int:
    """The step of one of our checkpoint folders (`checkpoint_000000008` -> 8)."""
    match = _STEP_DIR.fullmatch(dir_name)
    if match is None:
        raise ValueError(f"not a checkpoint folder of ours: {dir_name!r}")
    return int(match.group(1))


def committed_step(fs: pafs.FileSystem, run_path: str) -> int | None:
    """The step of the latest committed checkpoint; None if none is committed yet (no snapshot,
    or one that names none). A snapshot that cannot be read raises (SnapshotUnreadable,
    SnapshotFormatError) instead: a caller must not take it for "none yet" (the tracker releases
    nothing then, observe/tracking.py). Ray's alone: in place, the periodic checkpoints committed
    by `in_place_checkpoint.json` are not counted (recovery/checkpoints.py)."""
    name = committed_checkpoint_dir(fs, run_path)
    return None if name is None else checkpoint_step(name)


def committed_checkpoint_step(run_uri: str) -> int | None:
    """`committed_step` for a run folder given as a local path or a pyarrow.fs URI (driver side)."""
    from elastic_train.observe.runfolder import split_uri

    fs, path, _ = split_uri(run_uri)
    return committed_step(fs, path)


def worker_run_folder() -> tuple[pafs.FileSystem, str]:
    """Inside a Ray Train worker: (filesystem, path) of the run folder Ray writes its snapshot to."""
    import ray.train

    storage = ray.train.get_context().get_storage()  # a DeveloperAPI (StorageContext)
    return storage.storage_filesystem, storage.experiment_fs_path


def wait_until_committed(fs: pafs.FileSystem, run_path: str, step: int, timeout_s: float,
                         poll_s: float = 0.1) -> int | None:
    """Wait (at most `timeout_s`) until a checkpoint of `step` or later is committed; return the
    committed step then (smaller than `step`, or None, if the wait timed out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            committed = committed_step(fs, run_path)
        except SnapshotUnreadable:
            committed = None  # still half written after the retries: poll again
        if (committed is not None and committed >= step) or time.monotonic() >= deadline:
            return committed
        time.sleep(poll_s)
