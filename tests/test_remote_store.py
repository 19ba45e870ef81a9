"""Runs whose data and run folder live on an S3-compatible store, as on a cluster of several nodes:
a local S3 server (moto's, in a process of its own, spoken to over HTTP by pyarrow's S3 client in
the driver, the RunLog, Ray Train and the workers), named the way a MinIO or Ceph user names one,
with its endpoint, region and keys in the URI."""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pyarrow.fs as pafs
import pytest
import yaml
from conftest import TINY
from localenv import train_locally
from test_repeated_faults import COMMON, check_ledger, run_to_the_end
from uninterrupted import check_against_uninterrupted

from elastic_train import load_config
from elastic_train.cli import main
from elastic_train.cluster.prepare_ray import prepare_ray

pytestmark = [pytest.mark.ray, pytest.mark.chaos]

BUCKET = "bucket"


@pytest.fixture(scope="module")
def s3_uri(tmp_path_factory):
    """`uri(path)`: `s3://KEY:SECRET@bucket/<path>?region=...&endpoint_override=...&scheme=http`
    on a moto S3 server started for the module (the bucket made, nothing in it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(tmp_path_factory.mktemp("s3") / "server.log", "w")  # noqa: SIM115 - closed below
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=log, stderr=subprocess.STDOUT)
    options = f"region=us-east-1&endpoint_override=127.0.0.1:{port}&scheme=http"

    def uri(path: str) -> str:
        return f"s3://key:secret@{BUCKET}/{path}?{options}"

    fs, _ = pafs.FileSystem.from_uri(uri("") + "&allow_bucket_creation=true")
    deadline = time.monotonic() + 60
    while True:  # the event: the server answers (its start is an import of Flask and boto)
        try:
            fs.create_dir(BUCKET)
            break
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline, "the S3 server did not start"
            time.sleep(0.2)
    uri.fs = fs
    yield uri
    server.terminate()
    server.wait(30)
    log.close()


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
    """The run folder of `result` (a run on the store) copied to `into`, as a local run's result."""
    _, path = pafs.FileSystem.from_uri(uri)
    pafs.copy_files(path, str(into), source_filesystem=fs,
                    destination_filesystem=pafs.LocalFileSystem())
    return SimpleNamespace(summary=result.summary, run_dir=str(into),
                           checkpoint_path=str(into / Path(result.checkpoint_path).name))


def test_a_run_on_an_s3_store_recovers_twice_and_ends_on_the_uninterrupted_run(
        ray_cluster, s3_uri, tmp_path, capsys):
    """`prepare --engine ray` writes the corpus to the store; a run reads it from there and keeps
    its run folder there: a worker crashes, then the driver is stopped (SIGTERM) and the same
    command run again, which takes the folder's lease, downloads its files and resumes from the
    store's checkpoint. It ends on one process that was never interrupted, to the bit, with every
    checkpoint's data cursors and the ledger as the faults say; the staging copy on the driver's
    machine is removed once its last upload is in; `export` reads the folder from the store."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [stdlib / name for name in ("textwrap.py", "shlex.py", "fnmatch.py", "bisect.py",
                                        "heapq.py", "glob.py", "colorsys.py")]
    stats = prepare_ray(texts, s3_uri("data/corpus"), max_seq_len=128, rows_per_shard=600,
                        rows_per_block=32, progress=False)
    assert stats["rows"] > 500
    schedule = ["9:crash:1", "21:stop:0"]
    overrides = [*TINY, *COMMON, f"data.path={s3_uri('data/corpus')}",
                 f"run.storage_path={s3_uri('runs')}", "run.name=remote", "train.epochs=2",
                 "train.max_steps=1000", f"fault.schedule=[{', '.join(schedule)}]"]
    result, stops = run_to_the_end(overrides)
    assert result.summary["status"] == "finished" and result.summary["steps"] > 40
    run = s3_uri("runs/remote")
    assert result.run_dir == run  # the store's options after the run's name, not in it
    assert staging_copies("remote") == []
    local = downloaded(s3_uri.fs, run, result, tmp_path / "remote")
    assert json.loads((Path(local.run_dir) / "summary.json").read_text()) == result.summary
    reference = train_locally(load_config(None, overrides))  # reads the store's corpus too
    check_against_uninterrupted(local, reference)
    check_ledger(local, schedule, stops)

    capsys.readouterr()
    assert main(["export", run, "--output", str(tmp_path / "export")]) == 0
    assert (tmp_path / "export" / "model.safetensors").is_file()
