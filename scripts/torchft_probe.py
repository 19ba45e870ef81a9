"""Feasibility probe for in-place recovery (issue 17): Ray Train V2 TorchftConfig + torchft Manager.

2 workers on CPU/gloo, each its own replica group (as in Ray's torchft_linear_example.py), a tiny model
trained on K canonical partitions owned by the participating rank in the quorum, gradients summed in
float64 through ``Manager.allreduce(reduce_op=SUM)`` and divided by the global target count afterwards.
One worker faults once at a chosen step (``--fault exit``: os._exit(1); ``--fault stop``: SIGSTOP itself),
fired once through a marker file in the run's storage.

Every worker appends one JSON line per step attempt to <storage>/<name>/events.jsonl (pid, step,
quorum size, participating rank, committed, times); the driver prints a summary JSON line at the end,
including whether the final weights equal a single-process reference run (torch.equal).

    PYTHONPATH=. .venv/bin/python scripts/torchft_probe.py --fault exit --steps 40 --fault-step 15
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

K = 4  # canonical partitions per step
ROWS = 8  # rows per partition per step
DIM = 16


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def partition_batch(step: int, part: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + part)
    x = torch.randn(ROWS, DIM, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    return x, y


def grad_sum_of(model, parts, step) -> tuple[torch.Tensor, float]:
    """float64 sum over `parts` of the per-partition summed-loss gradients, and the number of targets."""
    params = [p for p in model.parameters()]
    acc = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    n = 0.0
    for part in parts:
        model.zero_grad(set_to_none=True)
        x, y = partition_batch(step, part)
        loss = torch.nn.functional.mse_loss(model(x), y, reduction="sum")
        loss.backward()
        acc += torch.cat([p.grad.reshape(-1) for p in params]).double()
        n += y.numel()
    return acc, n


def apply_grad(model, opt, flat: torch.Tensor, targets: float) -> None:
    flat = (flat / targets).float()
    off = 0
    for p in model.parameters():
        p.grad = flat[off : off + p.numel()].view_as(p).clone()
        off += p.numel()
    opt.step()


def reference(steps: int) -> dict:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for s in range(steps):
        acc, n = grad_sum_of(model, range(K), s)
        apply_grad(model, opt, acc, n)
    return model.state_dict()


def train_func(config: dict) -> None:
    import ray.train
    from torch.distributed import ReduceOp
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    wrank = ctx.get_world_rank()
    run_dir = Path(config["run_dir"])
    events = run_dir / "events.jsonl"
    marker = run_dir / "fault_marker.json"
    pid = os.getpid()

    def log(**rec):
        rec.update(wrank=wrank, pid=pid, t=time.time())
        with open(events, "a") as f:
            f.write(json.dumps(rec) + "\n")

    import torch.distributed as dist

    # the default process group Ray sets up: one per replica group (size 1 here), not across replicas
    log(event="start", dist_world=dist.get_world_size() if dist.is_initialized() else None)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    pg = ProcessGroupGloo(timeout=timedelta(seconds=config["pg_timeout_s"]))
    transport = PGTransport(pg, timeout=timedelta(seconds=30), device=torch.device("cpu"))

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        log(event="healed")

    def state_dict():
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        world_size=1,
        rank=0,
        replica_id=f"probe_{wrank}",
        timeout=timedelta(seconds=config["manager_timeout_s"]),
        quorum_timeout=timedelta(seconds=120),
        checkpoint_transport=transport,
        use_async_quorum=config["async_quorum"],
    )
    log(event="manager_ready")

    steps = config["steps"]
    while manager.current_step() < steps:
        t0 = time.time()
        manager.start_quorum()
        step = manager.current_step()  # after a sync heal this is the peer's step
        n = manager.num_participants()
        prank = manager.participating_rank()
        t_q = time.time()
        parts = [p for p in range(K) if prank is not None and p % n == prank]
        acc, targets = grad_sum_of(model, parts, step)
        time.sleep(config["compute_s"])  # stand-in for a real step's compute
        if (
            config["fault"] != "none"
            and wrank == config["fault_rank"]
            and step >= config["fault_step"]
            and not marker.exists()
        ):
            marker.write_text(json.dumps({"t": time.time(), "pid": pid, "step": step, "wrank": wrank}))
            log(event="fault", step=step, kind=config["fault"])
            if config["fault"] == "exit":
                os._exit(1)
            os.kill(pid, signal.SIGSTOP)
        # one fault-tolerant collective carries the gradient sum and the scalars (targets, a check value)
        check = float(prank + 1) if prank is not None else 0.0
        buf = torch.cat([acc, torch.tensor([targets, check], dtype=torch.float64)])
        manager.allreduce(buf, reduce_op=ReduceOp.SUM).wait()
        errored = manager.errored()
        total_targets, check_sum = float(buf[-2]), float(buf[-1])
        committed = manager.should_commit()
        if committed:
            apply_grad(model, opt, buf[:-2], total_targets)
        log(
            event="step",
            step=step,
            committed=committed,
            quorum_id=manager._quorum_id,
            participants=n,
            prank=prank,
            parts=parts,
            targets=total_targets,
            check=check_sum,
            check_ok=check_sum == n * (n + 1) / 2,
            errored=repr(errored)[:300] if errored else None,
            quorum_s=round(t_q - t0, 4),
            step_s=round(time.time() - t0, 4),
        )
    torch.save(model.state_dict(), run_dir / f"final_{wrank}_{pid}.pt")
    log(event="done", step=manager.current_step())
    manager.shutdown(wait=False)


def summarize(run_dir: Path, steps: int, ref: dict) -> dict:
    ev = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]
    out: dict = {"events": len(ev)}
    marker = run_dir / "fault_marker.json"
    pids: dict = {}
    for e in ev:
        pids.setdefault(e["wrank"], [])
        if e["pid"] not in pids[e["wrank"]]:
            pids[e["wrank"]].append(e["pid"])
    out["pids_by_world_rank"] = pids
    steps_ev = [e for e in ev if e["event"] == "step"]
    out["step_attempts"] = len(steps_ev)
    out["uncommitted"] = [
        {k: e[k] for k in ("wrank", "pid", "step", "participants", "errored", "step_s")}
        for e in steps_ev
        if not e["committed"]
    ]
    out["check_all_ok"] = all(e["check_ok"] for e in steps_ev if e["committed"])
    out["quorum_sizes"] = sorted({e["participants"] for e in steps_ev})
    t_first = min(e["t"] for e in ev if e["event"] == "start")
    out["first_committed_step_after_start_s"] = round(
        min(e["t"] for e in steps_ev if e["committed"]) - t_first, 2
    )
    committed_steady = [e["step_s"] for e in steps_ev if e["committed"] and e["participants"] == 2]
    if committed_steady:
        committed_steady.sort()
        out["median_step_s_2_replicas"] = committed_steady[len(committed_steady) // 2]
    if marker.exists():
        m = json.loads(marker.read_text())
        td, dead_pid, dstep = m["t"], m["pid"], m["step"]
        out["fault"] = {"wrank": m["wrank"], "pid": dead_pid, "step": dstep}
        survivors = [e for e in steps_ev if e["wrank"] != m["wrank"] and e["t"] > td]
        surv_pids = {e["pid"] for e in survivors}
        out["survivor_pids_after_fault"] = sorted(surv_pids)
        out["survivor_same_pid"] = surv_pids <= set(pids[1 - m["wrank"]][:1])
        sc = [e for e in survivors if e["committed"]]
        if sc:
            out["death_to_survivor_next_commit_s"] = round(sc[0]["t"] - td, 2)
            out["survivor_next_commit"] = {
                k: sc[0][k] for k in ("step", "participants", "step_s", "quorum_s")
            }
        surv_fail = [e for e in survivors if not e["committed"]]
        if surv_fail:
            out["survivor_step_in_flight"] = {
                k: surv_fail[0][k] for k in ("step", "committed", "errored", "step_s")
            }
            out["death_to_survivor_failed_commit_s"] = round(surv_fail[0]["t"] - td, 2)
        repl = [e for e in ev if e["wrank"] == m["wrank"] and e["pid"] != dead_pid]
        if repl:
            out["replacement_pid"] = repl[0]["pid"]
            out["death_to_replacement_start_s"] = round(repl[0]["t"] - td, 2)
            for name in ("manager_ready", "healed"):
                r = [e for e in repl if e["event"] == name]
                if r:
                    out[f"death_to_replacement_{name}_s"] = round(r[0]["t"] - td, 2)
            rc = [e for e in repl if e["event"] == "step" and e["committed"]]
            if rc:
                out["death_to_replacement_first_commit_s"] = round(rc[0]["t"] - td, 2)
                out["replacement_first_commit"] = {k: rc[0][k] for k in ("step", "participants", "prank")}
        surv_steps = sorted({e["step"] for e in steps_ev if e["committed"] and e["wrank"] != m["wrank"]})
        out["survivor_committed_steps_contiguous"] = surv_steps == list(range(steps))
    finals = sorted(run_dir.glob("final_*.pt"))
    out["final_equal_reference"] = {
        f.name: all(torch.equal(v, ref[k]) for k, v in torch.load(f).items()) for f in finals
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--fault", choices=["none", "exit", "stop"], default="exit")
    ap.add_argument("--fault-step", type=int, default=15)
    ap.add_argument("--fault-rank", type=int, default=1)
    ap.add_argument("--compute-s", type=float, default=0.2)
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=5000)
    ap.add_argument("--join-timeout-ms", type=int, default=60000)
    ap.add_argument("--pg-timeout-s", type=float, default=30)
    ap.add_argument("--manager-timeout-s", type=float, default=30)
    ap.add_argument("--async-quorum", action="store_true")
    ap.add_argument(
        "--health-check-timeout-s",
        type=float,
        default=None,
        help="RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S (default Ray's 600 s)",
    )
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()

    if args.health_check_timeout_s is not None:
        os.environ["RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S"] = str(args.health_check_timeout_s)
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2.torch.torchft_config import TorchftConfig

    storage = Path(tempfile.mkdtemp(prefix="torchft_probe_"))
    run_dir = storage / "files"
    run_dir.mkdir()
    t0 = time.time()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=True)
    config = {
        "run_dir": str(run_dir),
        "steps": args.steps,
        "fault": args.fault,
        "fault_step": args.fault_step,
        "fault_rank": args.fault_rank,
        "compute_s": args.compute_s,
        "pg_timeout_s": args.pg_timeout_s,
        "manager_timeout_s": args.manager_timeout_s,
        "async_quorum": args.async_quorum,
    }
    trainer = TorchTrainer(
        train_loop_per_worker=train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        torch_config=TorchftConfig(
            lighthouse_kwargs={
                "min_replicas": 1,
                "heartbeat_timeout_ms": args.heartbeat_timeout_ms,
                "join_timeout_ms": args.join_timeout_ms,
            },
            backend="gloo",
        ),
        run_config=RunConfig(
            name="probe", storage_path=str(storage), failure_config=FailureConfig(max_failures=3)
        ),
    )
    error = None
    try:
        trainer.fit()
    except Exception as e:  # report, do not hide
        error = f"{type(e).__name__}: {e}"[:2000]
    wall = time.time() - t0
    ray.shutdown()
    out = {"args": vars(args), "fit_error": error, "wall_s": round(wall, 1)}
    out.update(summarize(run_dir, args.steps, reference(args.steps)))
    print("PROBE " + json.dumps(out))
    if args.keep:
        print("kept", storage)
    else:
        shutil.rmtree(storage, ignore_errors=True)


if __name__ == "__main__":
    main()
