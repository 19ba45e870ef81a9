"""cluster.yaml: valid for Ray's cluster launcher, and in step with jobs/configs/gpu.yaml."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from elastic_train.config import load_config

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
NCCL_VARS = ("NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_IB_TIMEOUT")


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load((REPO / "cluster.yaml").read_text())


@pytest.fixture(scope="module")
def cluster(raw) -> dict:
    """The config as `ray up` sees it, after Ray's own defaults and strict schema validation."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(raw))
    validate_config(prepared)  # raises on an unknown field or a wrong type
    return prepared


def _worker_types(cluster: dict) -> dict[str, dict]:
    return {name: t for name, t in cluster["available_node_types"].items()
            if name != cluster["head_node_type"]}


def _commands(cluster: dict, *keys: str) -> str:
    return "\n".join(cmd for key in keys for cmd in cluster.get(key, []))


def test_aws_head_and_one_gpu_worker_type(cluster):
    assert cluster["provider"]["type"] == "aws"
    assert cluster["head_node_type"] in cluster["available_node_types"]
    workers = _worker_types(cluster)
    assert len(workers) == 1
    (worker,) = workers.values()
    assert worker["node_config"]["InstanceType"].startswith(("g", "p"))  # GPU instance families
    assert worker["node_config"]["InstanceMarketOptions"]["MarketType"] == "spot"


def test_head_runs_no_training(cluster):
    head = cluster["available_node_types"][cluster["head_node_type"]]
    # Training workers ask for a GPU each, so they can only land where there is one.
    assert head["resources"].get("GPU", 0) == 0
    assert not head["node_config"]["InstanceType"].startswith(("g", "p"))
    assert load_config(REPO / "jobs" / "configs" / "gpu.yaml").scaling.use_gpu


def test_worker_range_matches_the_gpu_job(cluster):
    scaling = load_config(REPO / "jobs" / "configs" / "gpu.yaml").scaling
    (worker,) = _worker_types(cluster).values()
    assert (worker["min_workers"], worker["max_workers"]) == (scaling.min_workers, scaling.max_workers)
    assert cluster["max_workers"] == scaling.max_workers  # one GPU per node: nodes == workers


def test_setup_installs_this_project(cluster):
    mounts = cluster["file_mounts"]
    assert mounts.get("~/elastic_train") == "."
    setup = _commands(cluster, "setup_commands")
    assert "pip install" in setup and "-e ~/elastic_train" in setup
    for excluded in (".venv", ".git", "runs"):
        assert excluded in cluster["rsync_exclude"]


def test_nccl_env_reaches_the_workers(cluster):
    setup = _commands(cluster, "setup_commands", "worker_setup_commands")
    for var in NCCL_VARS:
        assert f"export {var}=" in setup, var
    assert "NCCL_IB_DISABLE=1" in setup
    # `ray start` runs with that environment, and the Ray workers inherit it.
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert "source ~/.elastic_train_env" in _commands(cluster, key)


def test_ray_start_commands_and_safe_defaults(cluster):
    head_start = _commands(cluster, "head_start_ray_commands")
    assert "ray start --head" in head_start and "--dashboard-host=127.0.0.1" in head_start
    assert "ray start --address=$RAY_HEAD_IP" in _commands(cluster, "worker_start_ray_commands")
    assert "RAY_AUTH_MODE=token" in _commands(cluster, "setup_commands")
    assert "~/.ray/auth_token" in cluster["file_mounts"]  # one token shared by all nodes
