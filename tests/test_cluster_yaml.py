"""cluster.yaml: valid for Ray's cluster launcher, and in step with the GPU job configs."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from elastic_train.config import load_config

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
# Each GPU job config, and the custom resource through which its workers pick their node type.
GPU_JOBS = {"gpu.yaml": "tcp_gpu", "gpu8.yaml": "efa_gpu"}
# GPUs and network cards of the instance types cluster.yaml uses (AWS's instance type pages).
INSTANCE_GPUS = {"g5.xlarge": 1, "p4d.24xlarge": 8}
INSTANCE_NETWORK_CARDS = {"p4d.24xlarge": 4}
NET_ENV = "~/.elastic_train_net_env"


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


def _job_scaling(name: str):
    return load_config(REPO / "jobs" / "configs" / name).scaling


def _node_type_of(cluster: dict, resource: str) -> dict:
    (node_type,) = [t for t in _worker_types(cluster).values() if resource in t["resources"]]
    return node_type


def test_aws_head_and_two_gpu_worker_types(cluster):
    assert cluster["provider"]["type"] == "aws"
    assert cluster["head_node_type"] in cluster["available_node_types"]
    workers = _worker_types(cluster)
    assert set(workers) == {"gpu_worker", "gpu8_efa_worker"}
    for worker in workers.values():
        assert worker["node_config"]["InstanceType"] in INSTANCE_GPUS
    assert workers["gpu_worker"]["node_config"]["InstanceMarketOptions"]["MarketType"] == "spot"
    assert "InstanceMarketOptions" not in workers["gpu8_efa_worker"]["node_config"]  # on demand


def test_head_runs_no_training(cluster):
    head = cluster["available_node_types"][cluster["head_node_type"]]
    # Training workers ask for a GPU each, so they can only land where there is one.
    assert head["resources"].get("GPU", 0) == 0
    assert not set(head["resources"]) & set(GPU_JOBS.values())
    assert not head["node_config"]["InstanceType"].startswith(("g", "p"))
    assert all(_job_scaling(job).use_gpu for job in GPU_JOBS)


@pytest.mark.parametrize("job", sorted(GPU_JOBS))
def test_worker_range_matches_the_gpu_job(cluster, job):
    scaling = _job_scaling(job)
    resource = GPU_JOBS[job]
    assert scaling.resources_per_worker == {resource: 1}
    worker = _node_type_of(cluster, resource)  # exactly one node type offers it
    gpus = INSTANCE_GPUS[worker["node_config"]["InstanceType"]]
    assert worker["resources"][resource] == gpus  # one per GPU: every GPU of a node usable
    # The job's range in whole nodes: the autoscaler can start enough nodes for the largest world
    # size and no more, and keeps either no node up or exactly the job's minimum.
    assert scaling.min_workers % gpus == 0 and scaling.max_workers % gpus == 0
    assert worker["max_workers"] * gpus == scaling.max_workers
    assert worker["min_workers"] * gpus in (0, scaling.min_workers)


def test_cluster_bound_leaves_each_type_its_range(cluster):
    workers = _worker_types(cluster).values()
    assert cluster["max_workers"] == sum(w["max_workers"] for w in workers)


def test_efa_nodes_have_an_efa_interface_per_network_card_in_a_placement_group(cluster):
    node_config = _node_type_of(cluster, "efa_gpu")["node_config"]
    interfaces = node_config["NetworkInterfaces"]
    cards = INSTANCE_NETWORK_CARDS[node_config["InstanceType"]]
    assert [i["NetworkCardIndex"] for i in interfaces] == list(range(cards))
    assert [i["DeviceIndex"] for i in interfaces] == [0] + [1] * (cards - 1)  # card 0 holds eth0
    assert {i["InterfaceType"] for i in interfaces} == {"efa"}
    # Ray's AWS bootstrap (Ray 2.60, aws/config.py `_configure_subnets_and_groups_from_network_
    # interfaces`; it imports boto3, so restated here) wants a subnet and security groups on every
    # interface and none beside them; one subnet (one zone) and one group for all.
    assert len({i["SubnetId"] for i in interfaces}) == 1
    assert len({tuple(i["Groups"]) for i in interfaces}) == 1 and interfaces[0]["Groups"]
    assert not {"SubnetId", "SubnetIds", "SecurityGroupIds"} & set(node_config)
    assert node_config["Placement"]["GroupName"]  # a cluster placement group: low latency


def test_setup_installs_this_project(cluster):
    mounts = cluster["file_mounts"]
    assert mounts.get("~/elastic_train") == "."
    setup = _commands(cluster, "setup_commands")
    assert "pip install" in setup and "-e ~/elastic_train" in setup
    for excluded in (".venv", ".git", "runs"):
        assert excluded in cluster["rsync_exclude"]


def _net_env(cluster: dict, resource: str) -> str:
    commands = "\n".join(_node_type_of(cluster, resource).get("initialization_commands", []))
    assert f"> {NET_ENV}" in commands
    return commands


def test_each_node_type_gets_its_nccl_transport(cluster):
    tcp = _net_env(cluster, "tcp_gpu")
    for var in ("NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE=1", "NCCL_IB_TIMEOUT"):
        assert f"export {var}" in tcp, var
    assert "FI_PROVIDER" not in tcp
    efa = _net_env(cluster, "efa_gpu")
    for var in ("NCCL_SOCKET_IFNAME", "FI_PROVIDER=efa", "FI_EFA_USE_DEVICE_RDMA=1", "FI_EFA_FORK_SAFE=1"):
        assert f"export {var}" in efa, var
    assert "/opt/amazon/ofi-nccl/lib" in efa  # the NCCL plugin that drives EFA
    assert "NCCL_IB_DISABLE" not in efa and "NCCL_PROTO" not in efa


def test_nccl_env_reaches_the_workers(cluster):
    # A node type's own worker_setup_commands would replace the global setup_commands (Ray 2.60,
    # autoscaler.py `_get_node_type_specific_fields`), installs included: none may have them.
    assert not any("worker_setup_commands" in t for t in _worker_types(cluster).values())
    setup = _commands(cluster, "setup_commands")
    assert f". {NET_ENV}" in setup and "> ~/.elastic_train_env" in setup
    # `ray start` runs with that environment, and the Ray workers inherit it.
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert "source ~/.elastic_train_env" in _commands(cluster, key)


def test_ray_start_commands_and_safe_defaults(cluster):
    head_start = _commands(cluster, "head_start_ray_commands")
    assert "ray start --head" in head_start and "--dashboard-host=127.0.0.1" in head_start
    assert "ray start --address=$RAY_HEAD_IP" in _commands(cluster, "worker_start_ray_commands")
    assert "RAY_AUTH_MODE=token" in _commands(cluster, "setup_commands")
    assert "~/.ray/auth_token" in cluster["file_mounts"]  # one token shared by all nodes
