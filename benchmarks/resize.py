"""Elastic resize on a multi-node ray.cluster_utils.Cluster: how long each kind of resize takes.

A head node (2 CPUs, no training) and two 1-CPU "slot" nodes, each with room for one worker; an
elastic run (min 1, max 2 workers, the test-sized model, the embedded corpus) and, per cycle:

- shrink: a slot node removed hard (no warning) -> seconds to the first step at 1 worker, steps lost
- grow: a slot node added -> seconds to the first step at 2 workers, steps lost
- drain: a slot node drained with a deadline (a spot notice) and removed at the deadline ->
  seconds from the deadline to the first step at 1 worker, steps lost (the run checkpoints on the
  notice and just before the deadline)

Then the run is abandoned (it would go on to the end of its epochs) and the script exits. Settings as
in tests/test_elastic.py: worker-group start timeout 10 s, resize monitor 2 s, the GCS node health
checks of cluster.yaml (1 s apart); periodic checkpoints every 20 steps.

    .venv/bin/python benchmarks/resize.py [--cycles 2] [--deadline 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

START_TIMEOUT_S = 10


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def wait_for(run_dir: Path, pred, timeout: float = 180.0) -> dict:
    """The first metrics record (in file order) that satisfies pred."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for rec in read_metrics(run_dir):
            if pred(rec):
                return rec
        time.sleep(0.05)
    raise TimeoutError("no matching step")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cycles", type=int, default=2)
    p.add_argument("--deadline", type=float, default=10.0)
    args = p.parse_args()
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.1"
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(START_TIMEOUT_S)
    # cluster.yaml's GCS health checks: a killed node is declared dead in ~5 s, not 12-15 s.
    os.environ["RAY_health_check_period_ms"] = "1000"
    os.environ["RAY_health_check_timeout_ms"] = "2000"
    import ray
    from ray.cluster_utils import Cluster
    from ray.core.generated import autoscaler_pb2

    from elastic_train import load_config
    from elastic_train.api import train

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    ray.init(address=cluster.address, log_to_driver=False)
    figures = None
    try:
        figures = measure(cluster, args, load_config, train, autoscaler_pb2)
    except BaseException:
        traceback.print_exc()
    finally:
        # Abandon the run rather than wait out its epochs: stop every node's processes, then leave
        # without joining the driver's training thread.
        try:
            ray.shutdown()
            cluster.shutdown()
        except Exception:  # noqa: BLE001 - the training thread may have reconnected; exiting anyway
            pass
        finally:
            if figures is not None:  # again, last: Ray prints its nodes' exits to stdout meanwhile
                print(json.dumps(figures))
            sys.stdout.flush()
            os._exit(0 if figures is not None else 1)


def measure(cluster, args, load_config, train, autoscaler_pb2) -> dict:
    import ray

    slots = [cluster.add_node(num_cpus=1, resources={"slot": 1}) for _ in range(2)]
    cluster.wait_for_nodes()
    storage = tempfile.mkdtemp(prefix="et-resize-")
    cfg = load_config(None, [
        "model.n_layer=1", "model.d_model=32", "model.n_head=2", "data.max_seq_len=128",
        "data.micro_batch_tokens=1024", "data.global_batch_tokens=4096", "log.progress=none",
        "eval.fraction=0", "checkpoint.keep_best=false", f"run.storage_path={storage}",
        "run.name=resize", "scaling.min_workers=1",
        "scaling.max_workers=2", "scaling.max_failures=-1", "scaling.resources_per_worker={slot: 1}",
        "scaling.cpus_per_worker=0.5", f"scaling.worker_group_start_timeout_s={START_TIMEOUT_S}",
        "scaling.resize_monitor_interval_s=2", "scaling.health_check_interval_s=0.1",
        "scaling.preemption_poll_interval_s=0.5", "checkpoint.every_steps=20",
        "train.epochs=100000", "train.max_steps=10000000",
    ])
    run_dir = Path(storage) / "resize"
    errors: list[BaseException] = []

    def run() -> None:
        try:
            train(cfg)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threading.Thread(target=run, daemon=True).start()
    results: dict[str, list[dict]] = {"shrink": [], "grow": [], "drain": []}

    def settle(world_size: int, after: float) -> dict:
        """The first step at world_size after `after` (with the steps lost: the last step trained
        before it minus the step it resumed from), once 5 more steps went by (a steady state)."""
        first = wait_for(run_dir, lambda r: r["world_size"] == world_size and r["time"] > after)
        wait_for(run_dir, lambda r: r["step"] >= first["step"] + 5)
        trained = max((r["step"] for r in read_metrics(run_dir) if r["time"] < first["time"]),
                      default=first["step"] - 1)
        return {**first, "lost": trained - (first["step"] - 1)}

    settle(2, 0.0)
    for cycle in range(args.cycles):
        # shrink: a node dies without warning
        t = time.time()
        cluster.remove_node(slots.pop(), allow_graceful=False)
        first = settle(1, t)
        results["shrink"].append({"s": first["time"] - t, "steps_lost": first["lost"]})
        # grow: a node joins
        t = time.time()
        slots.append(cluster.add_node(num_cpus=1, resources={"slot": 1}))
        first = settle(2, t)
        results["grow"].append({"s": first["time"] - t, "steps_lost": first["lost"]})
        # drain: a spot notice with a deadline, then the node is gone
        node = slots.pop()
        accepted, why = ray._raylet.GcsClient(address=cluster.address).drain_node(
            node.node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
            "spot notice (benchmark)", int((time.time() + args.deadline) * 1000))
        assert accepted, why
        time.sleep(args.deadline)
        t = time.time()
        cluster.remove_node(node, allow_graceful=False)
        first = settle(1, t)
        results["drain"].append({"s": first["time"] - t, "steps_lost": first["lost"]})
        slots.append(cluster.add_node(num_cpus=1, resources={"slot": 1}))
        settle(2, time.time())
        print(f"cycle {cycle}: " + ", ".join(f"{k} {v[-1]['s']:.1f} s / {v[-1]['steps_lost']} steps lost"
                                            for k, v in results.items()), flush=True)
    if errors:
        raise errors[0]
    recs = read_metrics(run_dir)
    step_s = statistics.median(r["step_time_s"] for r in recs)
    figures = {"benchmark": "resize", "cycles": args.cycles, "drain_deadline_s": args.deadline,
               "start_timeout_s": START_TIMEOUT_S, "median_step_s": step_s}
    print("| resize | seconds to training at the new size (each) | steps lost (each) |")
    print("|---|---|---|")
    for kind, rows in results.items():
        figures[f"{kind}_s"] = [round(r["s"], 1) for r in rows]
        figures[f"{kind}_steps_lost"] = [r["steps_lost"] for r in rows]
        figures[f"{kind}_s_max"] = round(max(r["s"] for r in rows), 1)
        print(f"| {kind} | {', '.join(str(x) for x in figures[f'{kind}_s'])} | "
              f"{', '.join(str(x) for x in figures[f'{kind}_steps_lost'])} |")
    print(json.dumps(figures), flush=True)
    return figures


if __name__ == "__main__":
    main()
