"""A local cluster started for a run: its processes inherit the driver's import path and the
cluster's address, and our actors take the worker processes Ray prestarted (a job runtime_env
would leave those idle and start a process per actor: start-up time, and CPU for the whole run)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.ray

SCRIPT = """
import os, time
import psutil, ray
from elastic_train.api import init_ray
from elastic_train.config import load_config

def idle():  # this cluster's idle worker processes (the raylet, their parent, is our child)
    found = set()
    for p in psutil.process_iter(["cmdline"]):
        try:
            if "ray::IDLE" in " ".join(p.info["cmdline"] or []) and any(
                    q.pid == os.getpid() for q in p.parents()):
                found.add(p.pid)
        except psutil.Error:
            pass
    return found

os.environ.pop("RAY_ADDRESS", None)
os.environ["PYTHONPATH"] = "/tmp/elastic-train-test-path"
assert init_ray(load_config(None, []))
assert "RAY_ADDRESS" not in os.environ and os.environ["PYTHONPATH"] == "/tmp/elastic-train-test-path"
deadline = time.time() + 120
while len(idle()) < 2 and time.time() < deadline:  # Ray prestarts them when the driver connects
    time.sleep(0.1)
prestarted = idle()
assert len(prestarted) >= 2, prestarted

@ray.remote(num_cpus=0)
class Probe:
    def look(self):
        return (os.getpid(), os.environ.get("PYTHONPATH", ""), os.environ.get("RAY_ADDRESS"),
                ray.get_runtime_context().runtime_env)

pid, path, address, runtime_env = ray.get(Probe.remote().look.remote(), timeout=120)
assert pid in prestarted, (pid, prestarted)
assert "/tmp/elastic-train-test-path" in path.split(os.pathsep), path
gcs = ray.get_runtime_context().gcs_address
assert address == "127.0.0.1:" + gcs.rsplit(":", 1)[1], (address, gcs)  # this cluster's GCS port
assert not runtime_env, runtime_env
ray.shutdown()
print("ok")
"""


def test_a_local_cluster_hands_its_environment_down_and_reuses_prestarted_workers():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
