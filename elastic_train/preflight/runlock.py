"""One run at a time in a run folder.

Two drivers with the same `run.storage_path` and `run.name` (two terminals with the default run
name, a job submitted twice, a job submitted again to a second cluster while the first still
runs) would both resume from its checkpoints and write into it: each Ray's retention deleting
the other's checkpoints, each RunLog rewriting attempts.json from its own list. The second is
refused before Ray starts, naming the first.

Local storage (a shared file system too): `<storage_path>/.<run.name>.lock`, beside the run
folder so that a refused or never-begun run leaves the folder byte for byte as it was. The
driver holds an exclusive `flock` on it for the run's life; the kernel drops it when the
process ends, however it ends, so a killed driver leaves no stale lock. The file itself says
who holds it (for the refusal's message) and is never removed: removing it would let a third
driver lock a new file while the second still holds the old one.

A remote store (`s3://`, `gs://`, ...) has no locks: there the driver holds a lease,
`<storage_path>/.<run.name>.lease`, that it rewrites every `LEASE_RENEW_S` and deletes when it
ends. A driver that finds a lease watches it for `LEASE_SILENT_S`: rewritten meanwhile, its
holder is alive and the run is refused; unchanged, its holder died without deleting it (a
killed driver, a lost head node) and the lease is taken. Two drivers that start within the
same instant: each writes its lease, waits `LEASE_SETTLE_S` and reads it back, and only the
one whose lease is still there goes on. On the same Ray cluster the RunLog actor's name
refuses a second run at once as well (cluster/driver.py).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid

import pyarrow.fs as pafs

from elastic_train.config import Config, ConfigError
from elastic_train.observe.runfolder import run_uri, split_uri

logger = logging.getLogger(__name__)

LEASE_RENEW_S = 10.0  # how often a remote run's driver rewrites its lease
LEASE_SILENT_S = 35.0  # a lease not rewritten for this long is a dead driver's
LEASE_SETTLE_S = 2.0  # between writing a lease and reading it back


class RunLock:
    """The exclusive hold of a run folder for the life of one run (`with RunLock(cfg):`)."""

    def __init__(self, cfg: Config) -> None:
        self.uri = run_uri(cfg)
        fs, run_path, is_local = split_uri(self.uri)
        storage_path, _, name = run_path.rpartition("/")
        self.path = os.path.join(storage_path, f".{name}.lock") if is_local else None
        self._lease = None if is_local else _Lease(fs, f"{storage_path}/.{name}.lease", self.uri)
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        if self._lease is not None:
            self._lease.acquire()
            return self
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_text(os.pread(fd, 4096, 0))
            os.close(fd)
            raise _in_use(self.uri, holder) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_whoami()).encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._lease is not None:
            self._lease.release()
        if self._fd is not None:
            os.close(self._fd)  # drops the flock
            self._fd = None


class _Lease:
    """The remote store's stand-in for a lock (see the module docstring)."""

    def __init__(self, fs: pafs.FileSystem, path: str, uri: str) -> None:
        self.fs, self.path, self.uri = fs, path, uri
        self.mine = {**_whoami(), "lease": uuid.uuid4().hex}
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def acquire(self) -> None:
        found = self._read()
        if found is not None:
            logger.warning("run folder %s has a lease (%s): watching it up to %.0f s to see "
                           "whether that run is alive", self.uri, _holder_text(found),
                           LEASE_SILENT_S)
            deadline = time.monotonic() + LEASE_SILENT_S
            while time.monotonic() < deadline:
                self._stop.wait(1.0)
                now = self._read()
                if now is not None and now != found:  # renewed, or taken by another driver
                    raise _in_use(self.uri, _holder_text(now))
                if now is None:  # its driver ended and deleted it
                    break
        self._write()
        self._stop.wait(LEASE_SETTLE_S)
        now = self._read()
        if now is not None and json.loads(now).get("lease") != self.mine["lease"]:
            raise _in_use(self.uri, _holder_text(now))  # another driver wrote after this one
        self._renewer = threading.Thread(target=self._renew, name="run-lease", daemon=True)
        self._renewer.start()

    def release(self) -> None:
        if self._renewer is None:
            return
        self._stop.set()
        self._renewer.join()
        try:
            self.fs.delete_file(self.path)
        except OSError as exc:  # the next run waits LEASE_SILENT_S for it instead
            logger.warning("could not delete the lease %s: %s", self.path, exc)

    def _renew(self) -> None:
        while not self._stop.wait(LEASE_RENEW_S):
            try:
                self._write()
            except OSError as exc:  # a store that fails now and then: the next renewal
                logger.warning("could not renew the lease %s: %s", self.path, exc)

    def _write(self) -> None:
        self.mine["renewed"] = time.time()
        parent = self.path.rpartition("/")[0]
        if parent:
            self.fs.create_dir(parent, recursive=True)
        with self.fs.open_output_stream(self.path) as f:
            f.write(json.dumps(self.mine).encode())

    def _read(self) -> bytes | None:
        try:
            with self.fs.open_input_stream(self.path) as f:
                return f.read()
        except FileNotFoundError:
            return None


def _whoami() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}


def _in_use(uri: str, holder: str) -> ConfigError:
    return ConfigError(f"run folder {uri} is in use by another run ({holder}): wait for it to "
                       "end or stop it, or give this one another run.name")


def _holder_text(raw: bytes) -> str:
    """Who holds the lock or lease, as its file says: "pid P on H, started T"."""
    try:
        holder = json.loads(raw or b"{}")
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started"]))
        return f"pid {holder['pid']} on {holder['host']}, started {started}"
    except (ValueError, KeyError, TypeError, OSError, OverflowError):
        return "its driver has not said who it is yet"
