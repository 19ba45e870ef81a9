"""Does the cluster have room for the run's minimum of workers? Asked after ray.init, before fit.

Ray Train waits for workers that can never fit without end: min = max = 4 workers on a 2-CPU head
printed `WorkerGroupStartupTimeoutError` every 15 s for as long as anyone waited. Here the run's
need (`scaling.min_workers` x one worker's bundle: `cpus_per_worker` CPUs, a GPU with `use_gpu`,
`resources_per_worker`) is compared with the cluster's nodes, by their total resources (what is
busy now may be freed; what no node has never comes), counting the workers each node can hold.

A cluster that cannot grow is told at once, as one error naming the shortfall. One that can (an
autoscaler) may still add the nodes: the run starts and the driver's `runwatch.RunWatch` waits up
to `scaling.start_timeout_s` for its first worker group, showing what it waits for. A cluster can
grow when Ray's autoscaler has published a cluster config (node types with a max count) in the
GCS: a local cluster started by the driver never has one, nor does `ray start --head` without
`--autoscaling-config`. Read through Ray 2.60's private `ray._private.state.state.
get_max_resources_from_cluster_config` (`RAY_VERSION_READ`; Ray Train's own worker group reads
it too); tests/test_raycompat.py fails by name if it moves.
"""

from __future__ import annotations

import math
from typing import Any

import ray

from elastic_train.config import Config, ConfigError

RAY_VERSION_READ = "2.60"


def worker_bundle(cfg: Config) -> dict[str, float]:
    """What one training worker reserves."""
    s = cfg.scaling
    bundle = {"CPU": s.cpus_per_worker, **s.resources_per_worker}
    if s.use_gpu:
        bundle["GPU"] = 1.0
    return {k: v for k, v in bundle.items() if v > 0}


def workers_that_fit(bundle: dict[str, float], nodes: list[dict[str, float]]) -> int:
    """How many workers of `bundle` the nodes (each a mapping of total resources) hold."""
    total = 0
    for node in nodes:
        total += min((math.floor(node.get(k, 0.0) / v + 1e-9) for k, v in bundle.items()), default=0)
    return total


def describe_bundle(bundle: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in bundle.items())


def shortfall(cfg: Config, nodes: list[dict[str, float]]) -> str | None:
    """Why `nodes` cannot hold scaling.min_workers workers, naming need and room; None if they
    can."""
    bundle = worker_bundle(cfg)
    need = cfg.scaling.min_workers
    room = workers_that_fit(bundle, nodes)
    if room >= need:
        return None
    totals = {k: sum(n.get(k, 0.0) for n in nodes) for k in bundle}
    has = ", ".join(f"{v:g} {k}" for k, v in totals.items())
    where = f"{len(nodes)} node{'s' if len(nodes) != 1 else ''}"
    return (f"scaling.min_workers={need} needs {need} workers x {describe_bundle(bundle)}; the "
            f"cluster has {has} on {where}, room for {room}")


def alive_node_resources() -> list[dict[str, float]]:
    return [dict(n["Resources"]) for n in ray.nodes() if n["Alive"]]


def can_grow(started_here: bool) -> bool:
    """Whether the cluster may add nodes: an autoscaler has published its cluster config."""
    if started_here:
        return False
    try:
        from ray._private.state import state

        return bool(state.get_max_resources_from_cluster_config())
    except Exception:  # a Ray without it: assume an autoscaler may be there, and wait
        return True


def check_capacity(cfg: Config, started_here: bool) -> dict[str, Any]:
    """A ConfigError naming the shortfall if the cluster cannot hold the run's minimum of workers
    and cannot grow; else what was found ({"shortfall": ..., "can_grow": ...})."""
    missing = shortfall(cfg, alive_node_resources())
    grows = missing is not None and can_grow(started_here)
    if missing is not None and not grows:
        raise ConfigError(f"{missing}, and it cannot grow (no autoscaler); lower "
                          "scaling.min_workers or scaling.cpus_per_worker, or add nodes first")
    return {"shortfall": missing, "can_grow": grows}


def wait_note(cfg: Config) -> str:
    """What a run waiting for its workers waits for, as the cluster stands now."""
    nodes = alive_node_resources()
    missing = shortfall(cfg, nodes)
    if missing is not None:
        return missing
    free = ray.available_resources()
    bundle = worker_bundle(cfg)
    has = ", ".join(f"{free.get(k, 0.0):g} {k}" for k in bundle)
    return (f"{cfg.scaling.min_workers} workers x {describe_bundle(bundle)} fit the cluster's "
            f"nodes, but only {has} are free now: other runs or tasks hold the rest")
