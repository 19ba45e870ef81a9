"""A Ray cluster that does not answer at run.address or RAY_ADDRESS: one error line, at once,
from the command line run as a user runs it (a process of its own: the tests' own processes may
have joined the session's shared cluster, which `init_ray` would use)."""

from __future__ import annotations

import os
import sys

import pytest
from conftest import TINY


@pytest.mark.unit
def test_a_cluster_that_does_not_answer_is_one_error_line_at_once(tmp_path, small_dataset):
    """run.address (or RAY_ADDRESS) where no Ray cluster listens: ray.init retried for minutes
    and the command line ended in a traceback; now one `error:` line naming the key, in
    seconds, for train and for prepare --engine ray (which writes no output). Each command is a
    process of its own, as a user's is (this one may have joined the tests' shared cluster)."""
    import socket
    import subprocess
    import time

    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cli = [sys.executable, "-m", "elastic_train.cli"]
    (tmp_path / "t.txt").write_text("some text to prepare\n" * 50)
    t0 = time.monotonic()
    for argv, extra, key in (
            (["train", *TINY, f"data.path={small_dataset}", f"run.storage_path={tmp_path / 'runs'}",
              f"run.address=127.0.0.1:{port}"], {}, "run.address"),
            (["prepare", str(tmp_path / "t.txt"), "--output", str(tmp_path / "p"), "--engine", "ray"],
             {"RAY_ADDRESS": f"127.0.0.1:{port}"}, "RAY_ADDRESS")):
        done = subprocess.run([*cli, *argv], env={**env, **extra}, capture_output=True, text=True,
                              timeout=120)
        err = done.stderr.strip().splitlines()
        assert done.returncode == 2 and err and err[-1].startswith(
            f"error: {key}: no Ray cluster answers at 127.0.0.1:{port}"), done.stderr
        assert "Traceback" not in done.stderr
    assert time.monotonic() - t0 < 60
    assert not (tmp_path / "p").exists()
