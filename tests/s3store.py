"""A local S3 server for the runs of tests whose data and run folder live on an S3-compatible
store, as on a cluster of several nodes: moto's, in a process of its own, spoken to over HTTP by
pyarrow's S3 client in the driver, the RunLog, Ray Train, Ray Data and the workers; named the way a
MinIO or Ceph user names one, with its endpoint, region and keys in the URI."""

from __future__ import annotations

import glob
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pyarrow.fs as pafs
import yaml

BUCKET = "bucket"
SECRET = "Sekr3t-q9Zx"  # the secret key in the URIs: no file the run writes may hold it


@contextmanager
def s3_server(log_path: Path) -> Iterator:
    """`uri(path)`: `s3://KEY:SECRET@bucket/<path>?region=...&endpoint_override=...&scheme=http`
    on a moto S3 server started for the block (the bucket made, nothing in it; it takes any
    secret: `uri(path, secret)` names the store with another); `uri.fs` is the store's pyarrow
    filesystem."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with open(log_path, "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                   "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
        try:
            options = f"region=us-east-1&endpoint_override=127.0.0.1:{port}&scheme=http"

            def uri(path: str, secret: str = SECRET) -> str:
                return f"s3://key:{secret}@{BUCKET}/{path}?{options}"

            fs, _ = pafs.FileSystem.from_uri(uri("") + "&allow_bucket_creation=true")
            deadline = time.monotonic() + 60
            while True:  # the event: the server answers (it imports Flask and boto first)
                try:
                    fs.create_dir(BUCKET)
                    break
                except OSError:
                    assert server.poll() is None and time.monotonic() < deadline, \
                        f"the S3 server did not start: {log_path}"
                    time.sleep(0.2)
            uri.fs = fs
            yield uri
        finally:
            server.terminate()
            server.wait(30)


def files_holding(fs: pafs.FileSystem, text: str) -> list[str]:
    """The files on the store whose bytes hold `text`."""
    found = []
    for info in fs.get_file_info(pafs.FileSelector(BUCKET, recursive=True)):
        if info.type == pafs.FileType.File:
            with fs.open_input_stream(info.path) as f:
                if text.encode() in f.read():
                    found.append(info.path)
    return found


def staging_copies(run_name: str) -> list[str]:
    """The remote runs' staging copies on this machine (the RunLog's: it runs beside the
    driver) that hold a config of a run named `run_name`."""
    found = []
    for folder in glob.glob(os.path.join(tempfile.gettempdir(), "elastic-train-run-*")):
        for name in ("config.yaml", "config.yaml.pending"):
            path = Path(folder, name)
            config = yaml.safe_load(path.read_text()) if path.is_file() else None
            if isinstance(config, dict) and config.get("run", {}).get("name") == run_name:
                found.append(folder)
    return found


def downloaded(fs: pafs.FileSystem, uri: str, result, into: Path) -> SimpleNamespace:
    """The run folder of `result` (a run on the store at `uri`) copied to `into`, in the form of
    a local run's result."""
    _, path = pafs.FileSystem.from_uri(uri)
    pafs.copy_files(path, str(into), source_filesystem=fs,
                    destination_filesystem=pafs.LocalFileSystem())
    return SimpleNamespace(summary=result.summary, run_dir=str(into),
                           checkpoint_path=str(into / Path(result.checkpoint_path).name))
