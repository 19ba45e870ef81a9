"""raycompat: reading which checkpoint Ray Train has committed, against Ray's own snapshot model.

If a Ray upgrade renames the snapshot file or its fields, these fail (here, not as flaky crash
tests). The same reader on a real run's folder: tests/test_train_ray.py.
"""

from __future__ import annotations

import threading
import time

import pyarrow.fs as pafs
import pytest

from elastic_train.cluster import raycompat

pytestmark = pytest.mark.unit


def ray_snapshot_json(latest: str | None, earlier: tuple[str, ...] = ()) -> str:
    """The file's text as Ray's CheckpointManager._save_state writes it (its own pydantic model)."""
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import (
        _CheckpointManagerState,
        _TrainingResultState,
    )

    names = [*earlier, *([latest] if latest else [])]
    results = [_TrainingResultState(checkpoint_dir_name=n, metrics={"step": 1}) for n in names]
    return _CheckpointManagerState(
        checkpoint_results=results, checkpoint_report_indices=list(range(len(results))),
        latest_checkpoint_result=results[-1] if latest else None, pending_training_results=[],
        pending_validation_specs=[], current_report_index=len(results),
        validated_checkpoint_dir_names=[], timed_out_validation_checkpoint_dir_names=[],
        failed_validation_checkpoint_dir_names=[],
    ).model_dump_json()  # Ray 2.60 calls .json(), the same text


def test_the_file_name_is_rays():
    from ray.train.v2._internal.constants import CHECKPOINT_MANAGER_SNAPSHOT_FILENAME

    assert raycompat.SNAPSHOT_FILENAME == CHECKPOINT_MANAGER_SNAPSHOT_FILENAME


def test_reads_the_latest_of_rays_own_snapshot(tmp_path):
    fs = pafs.LocalFileSystem()
    assert raycompat.committed_step(fs, str(tmp_path)) is None  # no file: nothing committed
    path = tmp_path / raycompat.SNAPSHOT_FILENAME
    path.write_text(ray_snapshot_json(None))
    assert raycompat.committed_step(fs, str(tmp_path)) is None
    path.write_text(ray_snapshot_json("checkpoint_000000008", ("checkpoint_000000004",)))
    assert raycompat.committed_checkpoint_dir(fs, str(tmp_path)) == "checkpoint_000000008"
    assert raycompat.committed_step(fs, str(tmp_path)) == 8
    assert raycompat.committed_checkpoint_step(str(tmp_path)) == 8


def test_a_moved_format_fails_loudly(tmp_path):
    fs = pafs.LocalFileSystem()
    (tmp_path / raycompat.SNAPSHOT_FILENAME).write_text('{"latest": {"dir": "checkpoint_000000008"}}')
    with pytest.raises(raycompat.SnapshotFormatError, match="latest_checkpoint_result"):
        raycompat.committed_step(fs, str(tmp_path))
    (tmp_path / raycompat.SNAPSHOT_FILENAME).write_text('{"latest_checkpoint_result": {"x": 1}}')
    with pytest.raises(raycompat.SnapshotFormatError, match="checkpoint_dir_name"):
        raycompat.committed_step(fs, str(tmp_path))
    with pytest.raises(ValueError, match="not a checkpoint folder"):
        raycompat.checkpoint_step("checkpoint_2026-11-30_19-00-00.000")


def test_a_half_written_snapshot_is_read_again(tmp_path):
    """Ray rewrites the file in place: a reader can catch it empty or cut short."""
    fs = pafs.LocalFileSystem()
    path = tmp_path / raycompat.SNAPSHOT_FILENAME
    full = ray_snapshot_json("checkpoint_000000012")
    path.write_text(full[: len(full) // 2])
    finish = threading.Timer(0.2, path.write_text, args=(full,))
    finish.start()
    try:
        assert raycompat.committed_step(fs, str(tmp_path)) == 12
    finally:
        finish.join()
    path.write_text("")  # stays unreadable: an error that says so, never "nothing committed"
    with pytest.raises(raycompat.SnapshotUnreadable):
        raycompat.committed_checkpoint_dir(fs, str(tmp_path), retries=3, retry_s=0.01)


def test_wait_until_committed_returns_on_the_commit_or_at_the_timeout(tmp_path):
    fs = pafs.LocalFileSystem()
    path = tmp_path / raycompat.SNAPSHOT_FILENAME
    path.write_text(ray_snapshot_json("checkpoint_000000004"))
    commit = threading.Timer(0.3, path.write_text,
                             args=(ray_snapshot_json("checkpoint_000000008", ("checkpoint_000000004",)),))
    commit.start()
    t0 = time.monotonic()
    assert raycompat.wait_until_committed(fs, str(tmp_path), 8, timeout_s=30, poll_s=0.02) == 8
    assert time.monotonic() - t0 < 20
    commit.join()
    t0 = time.monotonic()
    assert raycompat.wait_until_committed(fs, str(tmp_path), 12, timeout_s=0.3, poll_s=0.05) == 8
    assert time.monotonic() - t0 >= 0.3
