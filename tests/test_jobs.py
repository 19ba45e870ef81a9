"""The cluster entry points: jobs/configs/*.yaml, `ray job submit ... jobs/train.py`, examples/driver.py.

The `ray` tests start a real Ray head (`ray start --head --block`) as their own process group and
submit to it through the `ray job` command line, as a user would.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from conftest import own_ray_cluster
from test_bad_input import other_cluster  # noqa: F401 - fixture

from elastic_train.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "jobs" / "configs").glob("*.yaml"))
BIN = Path(sys.executable).parent  # the venv's python, ray
EXCLUDES = json.dumps({"excludes": [".venv", ".git", "runs", "**/__pycache__", "*.egg-info"]})
JOB_TIMEOUT_S = 300


# ---- configs (unit) ----

@pytest.mark.unit
def test_job_configs_exist():
    assert {p.stem for p in CONFIGS} >= {"default", "smoke", "gpu"}


@pytest.mark.unit
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_job_config_loads_and_says_how_to_launch(path: Path):
    cfg = load_config(path)  # strict: an unknown key or a bad value raises
    header = path.read_text().split("\n", 1)[0]
    assert header.startswith("#"), f"{path.name}: no header comment"
    assert "jobs/train.py" in path.read_text(), f"{path.name}: header does not say how to launch it"
    assert cfg.run.name


@pytest.mark.unit
def test_job_default_is_the_embedded_default():
    job, embedded = load_config(REPO / "jobs" / "configs" / "default.yaml"), load_config(None)
    # Only the storage differs: a job's working directory is deleted with the Ray session.
    job.run.storage_path = embedded.run.storage_path
    assert job == embedded


@pytest.mark.unit
def test_job_default_sets_what_the_embedded_default_sets():
    """Key for key, as its header says (the loaded configs above agree on a CPU only: a
    `precision: fp32` here against the embedded `auto` would differ on GPU workers)."""
    job = yaml.safe_load((REPO / "jobs" / "configs" / "default.yaml").read_text())
    embedded = yaml.safe_load((REPO / "elastic_train" / "configs" / "default.yaml").read_text())
    assert job["run"].pop("storage_path") != embedded["run"].pop("storage_path")
    assert job == embedded


@pytest.mark.unit
def test_smoke_config_is_tiny():
    cfg = load_config(REPO / "jobs" / "configs" / "smoke.yaml")
    assert (cfg.scaling.min_workers, cfg.scaling.max_workers, cfg.scaling.use_gpu) == (2, 2, False)
    assert cfg.train.max_steps <= 10 and cfg.model.n_layer == 1 and cfg.model.d_model == 32
    assert cfg.checkpoint.every_steps < cfg.train.max_steps
    assert cfg.log.progress == "lines"


@pytest.mark.unit
def test_gpu_config_is_elastic_nccl_bf16():
    cfg = load_config(REPO / "jobs" / "configs" / "gpu.yaml")
    assert cfg.scaling.use_gpu and cfg.scaling.min_workers < cfg.scaling.max_workers
    assert (cfg.train.precision, cfg.optim.name) == ("bf16", "adamw8bit")
    assert cfg.run.storage_path.startswith("s3://") and cfg.data.path.startswith("s3://")


@pytest.mark.unit
def test_job_config_override_typo_is_named():
    with pytest.raises(ConfigError, match="optim.nonexistent"):
        load_config(REPO / "jobs" / "configs" / "smoke.yaml", ["optim.nonexistent=1"])


@pytest.mark.unit
def test_job_entry_point_exits_2_with_one_error_line(tmp_path: Path):
    """Bad input stops in jobs/train.py before Ray starts, from any working directory."""
    out = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "train.py"), "--config",
         str(REPO / "jobs" / "configs" / "smoke.yaml"), "optim.nonexistent=1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.startswith("error: ") and out.stderr.count("\n") == 1
    assert "optim.nonexistent" in out.stderr


# ---- a real Ray head and the `ray job` command line (ray) ----

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _client_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_AUTH_MODE"] = "token"  # `ray start` turns token auth on; clients must say so
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # the job's `python` is the venv's
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return env


def _run(cmd: list[str], timeout_s: float = JOB_TIMEOUT_S, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=_client_env(), capture_output=True, text=True,
                          timeout=timeout_s, **kwargs)


class Head:
    def __init__(self, gcs_port: int, dashboard_port: int) -> None:
        self.gcs_address = f"127.0.0.1:{gcs_port}"
        self.dashboard_url = f"http://127.0.0.1:{dashboard_port}"


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """`ray start --head --block` in its own process group; exactly that group is ended afterwards.
    The session's shared cluster is shut down first: two dashboards on one machine want the same
    agent port, and the head's job agent never registered ("No available agent to submit job")."""
    own_ray_cluster()
    gcs_port, dashboard_port = _free_port(), _free_port()
    # The head's fixed default ports (its dashboard agent's 52365, the client server's 10001) are
    # taken when another cluster runs on the machine (the other xdist worker's): free ones instead
    fixed = [f"--{name}={_free_port()}" for name in ("dashboard-agent-listen-port",
                                                     "ray-client-server-port")]
    # Ray's job supervisor points a job's driver at the cluster that its temp folder's
    # `ray_current_cluster` names ("auto"): in the shared /tmp/ray, the cluster started last on the
    # machine, which may be another's (test_job_submit_smoke_trains starts one). A temp folder of
    # its own keeps the head's jobs on the head; a short path, for its sockets' names.
    temp_dir = tempfile.mkdtemp(prefix="rayhead-", dir="/tmp")
    log = open(tmp_path_factory.mktemp("ray_head") / "ray_start.log", "w")
    _run([str(BIN / "ray"), "get-auth-token", "--generate"], timeout_s=60)  # no-op if one exists
    proc = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--port={gcs_port}",
         "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1", f"--temp-dir={temp_dir}",
         f"--dashboard-port={dashboard_port}", *fixed, "--num-cpus=4", "--include-dashboard=true"],
        env=_client_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    head = Head(gcs_port, dashboard_port)
    try:
        _wait_until_up(proc, head, log.name)
        yield head
    finally:
        _end_group(proc)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_until_up(proc: subprocess.Popen, head: Head, log_path: str, timeout_s: float = 480) -> None:
    """Until the head accepts a job, or its process ends. The bound only keeps a broken head from
    holding the module past pytest's own timeout: a head that started (ray_start.log: "Ray runtime
    started") took over 120 s to accept a job on a machine at load 8.5 (three Ray test sessions on
    2 cores)."""
    deadline = time.monotonic() + timeout_s
    # The last check is the event the tests need: the head's job agent accepts a job (`ray job
    # list` answers before the agent has registered: "No available agent to submit job").
    checks = [[str(BIN / "ray"), "status", "--address", head.gcs_address],
              [str(BIN / "ray"), "job", "list", "--address", head.dashboard_url],
              [str(BIN / "ray"), "job", "submit", "--address", head.dashboard_url, "--no-wait",
               "--", "true"]]
    while checks:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"Ray head did not come up; see {log_path}:\n"
                               + Path(log_path).read_text()[-3000:])
        if _run(checks[0], timeout_s=60).returncode == 0:
            checks.pop(0)
        else:
            time.sleep(1)


def _end_group(proc: subprocess.Popen) -> None:
    """End the head: SIGTERM to `ray start` (it stops its node), then SIGKILL what is left of it.

    Left: the process group, and the Ray workers, which lead process groups of their own but stay
    in the session that `start_new_session` opened for the head.
    """
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass  # seen: after a driver has trained on it, `ray start` may not stop at all
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for pid in _session_members(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _session_members(sid: int) -> list[int]:
    """Live processes of session `sid` (Linux /proc; elsewhere none are found)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            pids.append(int(stat.parent.name))
    return pids


def _submit(head: Head, submission_id: str, *args: str) -> subprocess.CompletedProcess:
    return _run([str(BIN / "ray"), "job", "submit", "--address", head.dashboard_url,
                 "--submission-id", submission_id, "--working-dir", str(REPO),
                 "--runtime-env-json", EXCLUDES, "--",
                 "python", "jobs/train.py", "--config", "jobs/configs/smoke.yaml", *args])


def _job(head: Head, verb: str, submission_id: str) -> str:
    out = _run([str(BIN / "ray"), "job", verb, "--address", head.dashboard_url, submission_id],
               timeout_s=60)
    return out.stdout + out.stderr


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.ray
def test_job_submit_smoke_trains(ray_head: Head, other_cluster: str, tmp_path: Path):  # noqa: F811
    """The smoke job on the head, with another cluster started on the machine after it (1 CPU, in
    Ray's shared temp folder, as a user's second `ray start` or another test session's): the job
    trains on the head it was submitted to, not on the cluster started last."""
    submitted = _submit(ray_head, "et-smoke", f"run.storage_path={tmp_path}", "run.name=smoke")
    logs = _job(ray_head, "logs", "et-smoke")
    assert submitted.returncode == 0, submitted.stdout[-3000:] + submitted.stderr[-3000:]
    assert "succeeded" in _job(ray_head, "status", "et-smoke")
    assert "finished: 6 steps" in logs, logs[-3000:]
    summary = _summary(tmp_path / "smoke")
    assert summary["status"] == "finished" and summary["steps"] == 6
    assert (tmp_path / "smoke" / "config.yaml").is_file()
    saved = yaml.safe_load((tmp_path / "smoke" / "config.yaml").read_text())
    assert saved["model"]["d_model"] == 32 and saved["scaling"]["min_workers"] == 2


@pytest.mark.ray
def test_job_submit_bad_key_fails_with_one_error_line(ray_head: Head, tmp_path: Path):
    submitted = _submit(ray_head, "et-bad-key", f"run.storage_path={tmp_path}", "run.name=bad",
                        "optim.nonexistent=1")
    assert submitted.returncode != 0
    assert "failed" in _job(ray_head, "status", "et-bad-key")
    logs = _job(ray_head, "logs", "et-bad-key")
    errors = [line for line in logs.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "optim.nonexistent" in errors[0], logs[-3000:]
    assert "Traceback" not in logs
    assert not (tmp_path / "bad").exists()  # stopped before anything was written


@pytest.mark.ray
def test_driver_script_joins_the_cluster(ray_head: Head, tmp_path: Path):
    env = {**_client_env(), "RAY_ADDRESS": ray_head.gcs_address}
    out = subprocess.run(
        [sys.executable, str(REPO / "examples" / "driver.py"),
         f"run.storage_path={tmp_path}", "run.name=driver", "log.progress=none"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert '"status": "finished"' in out.stdout
    assert _summary(tmp_path / "driver")["status"] == "finished"
    # It joined the running cluster instead of starting one of its own: Ray's INFO line saying so
    # is kept off the console, in the run folder's ray.log.
    assert "Connecting to existing Ray cluster" not in out.stderr + out.stdout
    assert "Connecting to existing Ray cluster" in (tmp_path / "driver" / "ray.log").read_text()
