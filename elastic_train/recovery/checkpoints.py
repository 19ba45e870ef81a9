"""Checkpoints in place (`fault.recovery=in_place`), written outside Ray's report barrier.

Ray's `ray.train.report` is a barrier over every worker: a checkpoint reported through it waits for
a replica that is not in the current quorum (dead, or a replacement still starting), which held a
survivor 58 s (issue 32); and when Ray replaces a replica it resets that barrier, so a report in
flight is dropped. So in place, a periodic checkpoint is written by one live participant (the
quorum's first) straight into the run folder, in a background thread, and committed by a pointer
file, `in_place_checkpoint.json`, replaced once the folder is whole (manifest last): a crash at any
point leaves the pointer naming a complete folder, or the one before. The other replicas do
nothing. The final checkpoint still goes through Ray (every worker is there at the end), so the
run's result names it.

A restore takes the newer of Ray's latest checkpoint and the pointer's (`newest`): a whole group
restarted by Ray, or a run resumed by name, goes on from the last checkpoint written either way.
The folders are named as Ray's (`checkpoint_<step>`), so the resume checks before a run
(preflight/resume.py) see them too. Ray's retention (`checkpoint.keep`) never sees them: the writer
keeps the newest `keep` of its own and never deletes the one Ray names as its latest.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import pyarrow.fs as pafs

from elastic_train.training.checkpoint import MANIFEST, checkpoint_name, write_checkpoint

POINTER = "in_place_checkpoint.json"  # {"checkpoint", "step", "written": [the kept, newest last]}


def dir_name(step: int) -> str:
    return checkpoint_name(step)


def read_pointer(fs: pafs.FileSystem, run_path: str) -> dict[str, Any] | None:
    """The run's in-place pointer ({checkpoint, step, written}), or None (none written yet)."""
    try:
        with fs.open_input_stream(f"{run_path}/{POINTER}") as f:
            pointer = json.loads(f.read())
    except (OSError, ValueError):
        return None
    ok = isinstance(pointer, dict) and isinstance(pointer.get("checkpoint"), str)
    return pointer if ok and isinstance(pointer.get("step"), int) else None


def is_whole(fs: pafs.FileSystem, directory: str) -> bool:
    return fs.get_file_info(f"{directory}/{MANIFEST}").type == pafs.FileType.File


def write_in_place(snap: dict[str, Any], fs: pafs.FileSystem, run_path: str, step: int, keep: int,
                   protected: Callable[[], str | None], crash_midway: bool = False) -> str | None:
    """Write `snap` (the whole state, one shard) as `checkpoint_<step>`, then point to it, then
    delete the oldest of those written in place beyond `keep` (never `protected()`'s: Ray's
    latest). Returns the folder's name; None if the pointer names a later step by then (a
    writer slowed down, or no longer the quorum's first, finished after another wrote a later
    checkpoint): the pointer is left as it is, and the folder just written is removed."""
    name = dir_name(step)
    target = f"{run_path}/{name}"
    if isinstance(fs, pafs.LocalFileSystem):
        shutil.rmtree(target, ignore_errors=True)  # an earlier writer's half (it died in it)
        write_checkpoint(snap, target, crash_midway=crash_midway)
    else:
        with tempfile.TemporaryDirectory(prefix="elastic-train-inplace-") as local:
            write_checkpoint(snap, local, crash_midway=crash_midway)
            fs.create_dir(target, recursive=True)
            pafs.copy_files(local, target, destination_filesystem=fs)
    previous = read_pointer(fs, run_path)
    if previous is not None and previous["step"] > step:
        if name not in previous.get("written", []) and name != protected():
            fs.delete_dir(target)
        return None
    written = [n for n in (previous or {}).get("written", []) if n != name] + [name]
    dropped, written = written[:-max(keep, 1)], written[-max(keep, 1):]
    pointer = {"checkpoint": name, "step": step, "written": written}
    with fs.open_output_stream(f"{run_path}/{POINTER}.tmp") as f:
        f.write(json.dumps(pointer).encode())
    fs.move(f"{run_path}/{POINTER}.tmp", f"{run_path}/{POINTER}")
    keep_also = protected()  # Ray's latest: its retention's to delete
    for old in dropped:
        if old != keep_also:
            try:
                fs.delete_dir(f"{run_path}/{old}")
            except OSError:
                pass  # gone already: nothing else refers to it
    return name


class InPlaceCheckpointWriter:
    """Writes in-place checkpoints in a background thread, one at a time (the next waits for the
    one before), so that the loop is blocked only for the snapshot. `committed(step)` is called
    once a checkpoint's pointer names it."""

    def __init__(self, fs: pafs.FileSystem, run_path: str, keep: int,
                 protected: Callable[[], str | None]) -> None:
        self.fs, self.run_path, self.keep, self.protected = fs, run_path, keep, protected
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, snap: dict[str, Any], step: int, committed: Callable[[int, float], None],
               crash_midway: bool = False) -> None:
        self.wait()

        def write() -> None:
            t0 = time.perf_counter()
            try:
                if write_in_place(snap, self.fs, self.run_path, step, self.keep, self.protected,
                                  crash_midway=crash_midway):
                    committed(step, time.perf_counter() - t0)
            except BaseException as exc:  # noqa: BLE001 - raised again by wait(), in the loop
                self._error = exc

        self._thread = threading.Thread(target=write, name="elastic-train-inplace-ckpt", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Until the write in flight ends; raises what it raised (a full disk, say)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def newest(ray_dir: str | None, ray_step: int | None, pointer: dict[str, Any] | None
           ) -> tuple[str, int] | None:
    """Which checkpoint a restore takes: (Ray's folder, its step) or (the pointer's name, its
    step), whichever is newer (Ray's on a tie: the same step, and Ray's result names it)."""
    theirs = (ray_dir, ray_step) if ray_dir is not None and ray_step is not None else None
    ours = (pointer["checkpoint"], pointer["step"]) if pointer else None
    if ours is None or (theirs is not None and theirs[1] >= ours[1]):
        return theirs
    return ours
