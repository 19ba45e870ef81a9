"""The run's folder: where it is (`<run.storage_path>/<run.name>`, local or any pyarrow.fs URI),
and its files as the RunLog actor writes them (`RunFolder`).

A run is *accepted* once its first attempt begins: the workers have built the model, restored
the checkpoint and checked its data position. Until then a fit changes nothing that an earlier
fit left: its new config (config.yaml, and dataset.json and provenance.json with it) is staged
beside as `<name>.pending` and promoted on acceptance, and in the folder of an earlier run
every other file written is journaled, so that a fit that ends before it began (a checkpoint
the workers refuse, a model that does not fit a worker) leaves that folder byte for byte as it
was: config.yaml (which `export` and `sample` read) stays the accepted one, summary.json of a
finished run stays "finished".
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow.fs as pafs

from elastic_train.config import Config, check_run_name, redact
from elastic_train.data.dataset import join_uri

PENDING = ".pending"  # a staged file's suffix until the run is accepted
# What the workers write straight into the run folder, never through the RunLog: Ray's and the
# in-place checkpoints (and Ray's checkpoint_manager_snapshot.json), the best checkpoint and its
# pointer, the in-place pointer, the compile cache. A remote run's staging copy neither downloads
# nor uploads them: uploaded every few seconds, a copy taken when the fit began would put back
# pointers and folders the workers have replaced or deleted since.
WORKER_OWNED = ("checkpoint", "best_checkpoint", "in_place_checkpoint", "compile_cache")
CONFIG_FILE = "config.yaml"  # the accepted resolved config: its presence marks an earlier run
# A store has no append: a file that grows (metrics.jsonl, a record a step: ~0.7 KB, 70 MB over
# 100k steps) is sent whole each time. While the run trains, one over PACED_BYTES waits the
# upload interval per PACED_BYTES it holds since its last upload, at most PACED_MAX_S: what the
# uploads send stays near PACED_BYTES an interval, however long the run.
PACED_BYTES = 1 << 20
PACED_MAX_S = 600.0


def run_uri(cfg: Config) -> str:
    """`<run.storage_path>/<run.name>`, absolute for a local folder."""
    check_run_name(cfg.run.name)  # the run folder lies inside storage_path, whatever built cfg
    storage = cfg.run.storage_path
    if "://" not in storage:
        storage = os.path.abspath(os.path.expanduser(storage))
    return join_uri(storage, cfg.run.name)


def split_uri(path: str) -> tuple[pafs.FileSystem, str, bool]:
    """(filesystem, path in it, is_local) for a local folder or a pyarrow.fs URI."""
    if "://" in path:
        fs, fs_path = pafs.FileSystem.from_uri(path)
        return fs, fs_path, isinstance(fs, pafs.LocalFileSystem)
    return pafs.LocalFileSystem(), os.path.abspath(path), True


STORE_TIMEOUT_S = 30.0  # a store's first answer (a probe, a listing) before it is given up


def call_within(call: Callable[[], Any], timeout_s: float) -> tuple[bool, Any]:
    """(True, `call()`) if it returned within `timeout_s`, (False, None) if not: a remote store
    whose client retries for minutes (GCS out of reach) is given up on; what `call` raises is
    raised here. It runs in a daemon thread, left behind when late."""
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # handed to the caller's thread
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name="store-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        return False, None
    returned, value = outcome[0]
    if not returned:
        raise value
    return True, value


@contextmanager
def local_copy(folder: str | os.PathLike, download: Callable[[pafs.FileSystem, str, Path], None],
               prefix: str) -> Iterator[tuple[Path, bool]]:
    """(a run folder as a local folder, whether it is remote): itself when local, else a
    temporary folder that `download(fs, path, local)` fills with what the caller reads, deleted
    on exit. Errors (ValueError) name the folder as given (the URI), never the copy."""
    shown = os.fspath(folder)
    def find() -> tuple[Any, str, bool, Any]:
        fs, path, is_local = split_uri(shown) if "://" in shown else (None, shown, True)
        return fs, path, is_local, None if is_local else fs.get_file_info(path).type

    try:  # a store that cannot be reached (no network, a bucket's region unknown): one line
        answered, found = call_within(find, STORE_TIMEOUT_S)
    except OSError as exc:
        detail = " ".join(str(exc).split())
        raise ValueError(f"run folder '{shown}' cannot be read: {detail}") from None
    if not answered:
        raise ValueError(f"run folder '{shown}' did not answer within {STORE_TIMEOUT_S:g} s; "
                         "is it reachable from here?")
    fs, path, is_local, kind = found
    if is_local:
        if not Path(path).exists():
            raise ValueError(f"run folder '{shown}' does not exist")
        yield Path(path), False
        return
    if kind == pafs.FileType.NotFound:
        raise ValueError(f"run folder '{shown}' does not exist")
    if kind != pafs.FileType.Directory:
        raise ValueError(f"'{shown}' is not a run folder: it is a file")
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        local = Path(tmp) / (PurePosixPath(path).name or "run")
        try:
            download(fs, path, local)
        except OSError as exc:
            raise ValueError(f"run folder '{shown}' is not readable: {exc}") from None
        try:
            yield local, True
        except (ValueError, FileNotFoundError) as exc:
            raise ValueError(str(exc).replace(str(local), shown)) from None


def worker_owned(name: str) -> bool:
    """Whether `name` (a path in the run folder) is written by the workers (`WORKER_OWNED`)."""
    return name.split("/", 1)[0].startswith(WORKER_OWNED)


class RunFolder:
    """Files of `<storage_path>/<name>/`; for remote storage through a local staging folder.
    Staged files, the journal and acceptance: see the module docstring. What is written has the
    secrets of its URIs masked (config/redact.py)."""

    def __init__(self, run_uri: str) -> None:
        self.uri = run_uri
        self.fs, self.remote_path, self.is_local = split_uri(run_uri)
        self._uploaded: dict[str, tuple[int, int, int]] = {}  # upload_copy's memory
        self._uploaded_at: dict[str, float] = {}  # name: time.monotonic() of its last upload
        if self.is_local:
            self.local = Path(self.remote_path)
        else:
            self.local = Path(tempfile.mkdtemp(prefix="elastic-train-run-"))
            self._download()
        self.local.mkdir(parents=True, exist_ok=True)
        for stale in self.local.glob("*" + PENDING):  # staged by a driver killed before acceptance
            stale.unlink()
        self.resuming = (self.local / CONFIG_FILE).is_file()  # an earlier fit's folder
        self.accepted = False
        self.discarded = False  # the fit ended unaccepted: nothing more is written
        self._staged: list[str] = []  # names staged, in the order they are promoted
        # name: its bytes before (a file rewritten) or its size (one appended to); None: absent
        self._journal: dict[str, bytes | int | None] = {}
        self._lock = threading.Lock()  # the RunLog takes several calls at once

    def _download(self) -> None:
        selector = pafs.FileSelector(self.remote_path, allow_not_found=True, recursive=True)
        for info in self.fs.get_file_info(selector):
            rel = os.path.relpath(info.path, self.remote_path)
            if info.type == pafs.FileType.File and not worker_owned(rel):
                dest = self.local / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                with self.fs.open_input_stream(info.path) as src:
                    dest.write_bytes(src.read())
                self._uploaded[Path(rel).as_posix()] = file_version(dest)  # the store has it

    def path(self, name: str) -> Path:
        return self.local / name

    def append(self, name: str, lines: list[str]) -> None:
        path = self.local / name
        with self._lock:
            if self.discarded:
                return
            self._remember(name, lambda: path.stat().st_size)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write("".join(redact.shown(line) + "\n" for line in lines))

    def write(self, name: str, text: str) -> None:
        path = self.local / name
        with self._lock:
            if self.discarded:
                return
            self._remember(name, path.read_bytes)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(redact.shown(text))
            os.replace(tmp, path)

    def _remember(self, name: str, before) -> None:
        """Journal a file's state before this fit first touches it (an earlier run's folder,
        until the run is accepted)."""
        if self.resuming and not self.accepted and name not in self._journal:
            self._journal[name] = before() if (self.local / name).is_file() else None

    def stage(self, name: str, text: str) -> None:
        """Write `name` as it will be once the run is accepted (at once, if it is)."""
        with self._lock:
            if self.discarded:
                return
            if not self.accepted:
                (self.local / (name + PENDING)).write_text(redact.shown(text))
                if name not in self._staged:
                    self._staged.append(name)
                return
        self.write(name, text)

    def accept(self) -> None:
        """The run is accepted: the staged files take their names, the journal is dropped."""
        with self._lock:
            if self.accepted or self.discarded:
                return
            for name in self._staged:
                os.replace(self.local / (name + PENDING), self.local / name)
            self._staged, self._journal, self.accepted = [], {}, True

    def discard(self) -> None:
        """The fit ended before it began: remove what it staged, put back every file it
        touched; nothing more is written."""
        with self._lock:
            if self.accepted or self.discarded:
                return
            self.discarded = True
            for name in self._staged:
                (self.local / (name + PENDING)).unlink(missing_ok=True)
            for name, before in self._journal.items():
                path = self.local / name
                if before is None:
                    path.unlink(missing_ok=True)
                elif isinstance(before, int):
                    os.truncate(path, before)
                else:
                    path.write_bytes(before)

    def read_json(self, name: str, default: Any) -> Any:
        path = self.local / name
        return json.loads(path.read_text()) if path.is_file() else default

    def sync(self, pace_s: float = 0.0) -> None:
        """Upload the staging copy (remote storage only; nothing once discarded). `pace_s`, the
        interval of the uploads while the run trains: a file over PACED_BYTES uploaded before
        goes once `pace_s` per PACED_BYTES it holds (at most PACED_MAX_S) has passed since;
        0 (the run's end): every file that changed."""
        if self.is_local or self.discarded:
            return
        now = time.monotonic()

        def due(name: str, size: int) -> bool:
            if not pace_s or size <= PACED_BYTES or name not in self._uploaded_at:
                return True
            return now - self._uploaded_at[name] >= min(PACED_MAX_S, pace_s * size / PACED_BYTES)

        before = dict(self._uploaded)
        upload_copy(str(self.local), self.fs, self.remote_path, self._uploaded, due)
        self._uploaded_at.update((name, now) for name, version in self._uploaded.items()
                                 if before.get(name) != version)


def file_version(path: Path) -> tuple[int, int, int]:
    """What changes when a file of the staging copy does: it is appended to (size), or replaced
    (`os.replace` of a whole new one: another inode), or written over (time)."""
    stat = path.stat()
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def upload_copy(local: str, fs: pafs.FileSystem, remote_path: str,
                uploaded: dict[str, tuple[int, int, int]] | None = None,
                due: Callable[[str, int], bool] | None = None) -> None:
    """A remote run folder's staging copy `local`, uploaded over it: every file the copy holds
    (the RunLog's, never the workers'), but no link (W&B's `latest-run`: its target goes once)
    and no file still being written (`*.tmp`, renamed into place when whole; a staged
    `*.pending`, until the run is accepted); `summary.json` last, so that its object is never
    older than the logs it sums up (report compares them). A file renamed away while this runs
    is left to the next upload. `uploaded` (name: `file_version`, kept by the caller between
    uploads) leaves out the files that have not changed since they were last uploaded: every
    upload sent the whole folder (ray.log, the config, consumed ids of earlier attempts, ...)
    every few seconds. `due(name, size)` False: a changed file waits for a later upload."""
    root = Path(local)
    files = []
    for folder, subfolders, names in os.walk(root):  # a linked folder is not entered
        subfolders[:] = sorted(d for d in subfolders if not Path(folder, d).is_symlink())
        files += [Path(folder, name) for name in sorted(names)
                  if not (name.endswith((".tmp", PENDING)) or Path(folder, name).is_symlink())]
    files.sort(key=lambda path: path == root / "summary.json")
    fs.create_dir(remote_path, recursive=True)
    for path in files:
        name = path.relative_to(root).as_posix()
        target = f"{remote_path}/{name}"
        try:
            version = file_version(path)  # before reading: a write meanwhile uploads it again
            if (uploaded is not None and uploaded.get(name) == version) or (
                    due is not None and not due(name, version[1])):
                continue
            with open(path, "rb") as source:
                if path.parent != root:
                    fs.create_dir(target.rpartition("/")[0], recursive=True)
                with fs.open_output_stream(target) as sink:
                    shutil.copyfileobj(source, sink, 1 << 20)
        except FileNotFoundError:
            continue
        if uploaded is not None:
            uploaded[name] = version


def upload_staging(local: str, run: str) -> None:
    """`upload_copy` of the staging copy `local` to run folder URI `run`, then the copy removed
    (the store holds all it had); an OSError leaves it."""
    fs, remote_path, _ = split_uri(run)
    upload_copy(local, fs, remote_path)
    shutil.rmtree(local, ignore_errors=True)
