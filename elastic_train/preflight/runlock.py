"""One run at a time in a run folder.

Two drivers with the same `run.storage_path` and `run.name` (two terminals with the default run
name, a job submitted twice) would both resume from its checkpoints and write into it: each
Ray's retention deleting the other's checkpoints, each RunLog rewriting attempts.json from its
own list. The second is refused before Ray starts, naming the first.

Local storage (a shared file system too): `<storage_path>/.<run.name>.lock`, beside the run
folder so that a refused or never-begun run leaves the folder byte for byte as it was. The
driver holds an exclusive `flock` on it for the run's life; the kernel drops it when the
process ends, however it ends, so a killed driver leaves no stale lock. The file itself says
who holds it (for the refusal's message) and is never removed: removing it would let a third
driver lock a new file while the second still holds the old one. A remote store has no locks:
there the RunLog actor carries the run's name on its Ray cluster (cluster/driver.py), which
refuses a second run on the same cluster.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time

from elastic_train.config import Config, ConfigError
from elastic_train.observe.runfolder import run_uri


class RunLock:
    """The exclusive hold of a run folder for the life of one run (`with RunLock(cfg):`)."""

    def __init__(self, cfg: Config) -> None:
        self.uri = run_uri(cfg)
        storage, _, name = self.uri.rpartition("/")
        self.path = None if "://" in self.uri else os.path.join(storage, f".{name}.lock")
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        if self.path is None:
            return self
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise ConfigError(f"run folder {self.uri} is in use by another run ({holder}): "
                              "wait for it to end or stop it, or give this one another "
                              "run.name") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                  "started": time.time()}).encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops the flock
            self._fd = None


def _read_holder(fd: int) -> str:
    """Who holds the lock, as its file says: "pid P on H, started T"."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started"]))
        return f"pid {holder['pid']} on {holder['host']}, started {started}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its driver has not said who it is yet"
