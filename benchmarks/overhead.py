"""Overhead and scaling: elastic-train against plain torchrun DDP and one process, same batches.

(a) elastic-train as a user runs it: local Ray cluster, 2 CPU workers (1 thread each), the default
    train.grad_reduce=exact (float64 sums, one all-reduce per step, no DDP wrapper)
(e) the same with train.grad_reduce=ddp: torch DDP, the same gradient reduction as (b)
(b) torchrun, 2 gloo processes (1 thread each), benchmarks/_ddp_baseline.py (torch DDP)
(c) one process, 2 threads, the same script
(d) elastic-train with 1 worker (scaling against the ideal 2x)
Steady-state real tokens/s skips the first WARMUP steps; start-up (launch to first step) apart.
With --repeat R, a, b and e run R times in turn (a b e a b e ...) and each figure is the median:
the machine's load drifts over minutes, and taking turns spreads it over all three.

    .venv/bin/python benchmarks/overhead.py [--steps 30] [--repeat 1]
    .venv/bin/python benchmarks/overhead.py --levers --repeat 3 [--lever NAME] [--against REV]  # levers
    .venv/bin/python benchmarks/overhead.py --startup --repeat 5 [--against REV]  # start-up phases
    .venv/bin/python benchmarks/overhead.py --idle-ray --repeat 3  # Ray's presence alone, beside torchrun
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
WARMUP = 5
COMMON = ["checkpoint.every_steps=0", "log.progress=none", "eval.fraction=0",
          "checkpoint.keep_best=false"]  # the torchrun baseline trains on every row, evaluates none


def steady(times: list[float], tokens: list[int]) -> float:
    """Real tokens/s over steps WARMUP+1 .. end (a step's time is when it ended)."""
    return sum(tokens[WARMUP + 1:]) / (times[-1] - times[WARMUP])


def process_name(cmdline: list[str]) -> str:
    """A process by what it is: its Ray title without the method (`ray::TrainController`), else
    its script's or program's file name (`log_monitor.py`, `raylet`)."""
    args = " ".join(cmdline).split()  # a process title is one argument with spaces
    if not args:
        return "?"
    if args[0].startswith("ray::"):
        return args[0].split(".")[0]
    script = next((a for a in args[1:3] if a.endswith(".py")), None)
    return os.path.basename(script or args[0])


class CpuSampler:
    """Every 0.25 s: the CPU seconds used so far by the training processes (cmdline contains
    `match`, not `exclude`), by every other process (named by `process_name`) and by the whole
    machine (/proc/stat), to split a steady window's CPU between training and everything else."""

    def __init__(self, match: str, exclude: str = "\0") -> None:
        self.match, self.exclude, self.samples = match, exclude, []
        self._seen: dict[int, psutil.Process] = {}
        self._others: dict[int, tuple[str, list[tuple[float, float]]]] = {}  # pid: name, (time, cpu)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        while not self._stop.wait(0.25):
            now = time.time()
            for proc in psutil.process_iter(["cmdline", "cpu_times"]):
                cmd = " ".join(proc.info["cmdline"] or [])
                if self.match in cmd and self.exclude not in cmd:
                    self._seen.setdefault(proc.pid, proc)
                elif proc.info["cpu_times"] is not None:
                    # the latest name: a Ray worker takes its title after it starts
                    _, series = self._others.get(proc.pid, ("", []))
                    series.append((now, proc.info["cpu_times"].user + proc.info["cpu_times"].system))
                    self._others[proc.pid] = (process_name(proc.info["cmdline"] or []), series)
            train = 0.0
            for proc in list(self._seen.values()):
                try:
                    t = proc.cpu_times()
                    train += t.user + t.system
                except psutil.Error:
                    self._seen.pop(proc.pid, None)
            with open("/proc/stat") as f:
                ticks = [int(x) for x in f.readline().split()[1:]]
            busy = (sum(ticks) - ticks[3] - ticks[4]) / tick
            self.samples.append((now, train, busy, sum(ticks) / tick))

    def window(self, times: list[float]) -> dict:
        """CPU split over the steady steps: training CPU-s per step, training's share of the
        machine, everything else's share, and that by process name (shares of 0.1% and up)."""
        inside = [s for s in self.samples if times[WARMUP] <= s[0] <= times[-1]]
        if len(inside) < 2:
            return {}
        (t0, train0, busy0, total0), (t1, train1, busy1, total1) = inside[0], inside[-1]
        steps = sum(1 for t in times if t0 < t <= t1)
        others: dict[str, float] = {}
        for name, series in self._others.values():
            cpu = [c for t, c in series if t0 <= t <= t1]
            if len(cpu) >= 2:
                others[name] = others.get(name, 0.0) + (cpu[-1] - cpu[0]) / (total1 - total0)
        return {"train_cpu_s_per_step": (train1 - train0) / max(steps, 1),
                "train_share_of_machine": (train1 - train0) / (total1 - total0),
                "other_share_of_machine": (busy1 - busy0 - (train1 - train0)) / (total1 - total0),
                "others": {k: round(v, 4) for k, v in sorted(others.items(), key=lambda kv: -kv[1])
                           if v >= 0.001}}


def run_elastic(steps: int, workers: int, storage: str, reduce: str, *extra: str,
                code: Path = ROOT) -> dict:
    """One elastic-train run with the elastic_train package of `code` (a git worktree for
    --against: driver and workers import it first, by PYTHONPATH and working folder)."""
    name = f"overhead-{workers}w-{reduce}-{time.time_ns()}"
    start = time.time()
    with CpuSampler("RayTrainWorker") as cpu:
        subprocess.run(
            [str(ROOT / ".venv/bin/elastic-train"), "train", *COMMON, f"train.max_steps={steps}",
             f"run.storage_path={storage}", f"run.name={name}", f"scaling.min_workers={workers}",
             f"scaling.max_workers={workers}", f"train.grad_reduce={reduce}", *extra],
            check=True, capture_output=True, text=True, cwd=code,
            env={**os.environ, "PYTHONPATH": str(code)},
        )
    recs = [json.loads(x) for x in (Path(storage) / name / "metrics.jsonl").read_text().splitlines()]
    times, tokens = [r["time"] for r in recs], [r["real_tokens"] for r in recs]
    return {"tokens_per_s": steady(times, tokens), "startup_s": times[0] - start,
            "data_wait_s": sum(r["data_wait_s"] for r in recs[WARMUP:]),
            "host_ms": 1e3 * statistics.median(r["host_s"] for r in recs[WARMUP + 1:]),
            "step_ms": 1e3 * statistics.median(r["step_time_s"] for r in recs[WARMUP + 1:]),
            **cpu.window(times)}


# The CPU-gap levers (run.* keys, local cluster only), each an A/B against torchrun in the same round.
LEVERS = {
    "neither (before)": ["run.dashboard=true", "run.train_first=false"],
    "train_first": ["run.dashboard=true", "run.train_first=true"],
    "no dashboard": ["run.dashboard=false", "run.train_first=false"],
    "both (default)": ["run.dashboard=false", "run.train_first=true"],
}


def levers(steps: int, rounds: int, chosen: list[str] | None, against: str | None) -> None:
    """--levers: each round runs torchrun then every lever setting once (taking turns, so that a
    drift of the machine's load spreads over all); a setting's ratio is the median over rounds of
    its tokens/s over that round's torchrun. `chosen`: only these settings; `against`: each of
    them with that commit's code too."""
    settings = {k: v for k, v in LEVERS.items() if not chosen or k in chosen}
    with tempfile.TemporaryDirectory() as storage, worktree(against) as old:
        codes = {"": ROOT} if old is None else {"": ROOT, f" @{against}": old}
        runs: dict[str, list[dict]] = {k + c: [] for k in settings for c in codes}
        ratios: dict[str, list[float]] = {k: [] for k in runs}
        base: list[dict] = []
        for _ in range(rounds):
            b = run_baseline(steps, 2, 1)
            base.append(b)
            for k, overrides in settings.items():
                for c, code in codes.items():
                    r = run_elastic(steps, 2, storage, "exact", *overrides, code=code)
                    runs[k + c].append(r)
                    ratios[k + c].append(r["tokens_per_s"] / b["tokens_per_s"])
    print(f"| setting | ratio to torchrun (median of {rounds} rounds; each) | tokens/s | "
          "step ms | host overhead ms/step | training's share of the machine | the rest's share | "
          "start-up s |")
    print("|---|---|---|---|---|---|---|---|")
    for k, rs in runs.items():
        med = medians(rs, ("tokens_per_s", "step_ms", "host_ms", "train_share_of_machine",
                           "other_share_of_machine", "startup_s"))
        print(f"| {k} | {statistics.median(ratios[k]):.3f} ({'; '.join(f'{x:.3f}' for x in ratios[k])}) | "
              f"{med['tokens_per_s']:.0f} | {med['step_ms']:.1f} | {med['host_ms']:.1f} | "
              f"{med['train_share_of_machine']:.1%} | {med['other_share_of_machine']:.1%} | "
              f"{med['startup_s']:.1f} |")
    print(f"| torchrun | 1 | {statistics.median(b['tokens_per_s'] for b in base):.0f} | - | - | "
          f"{statistics.median(b['train_share_of_machine'] for b in base):.1%} | "
          f"{statistics.median(b['other_share_of_machine'] for b in base):.1%} | "
          f"{statistics.median(b['startup_s'] for b in base):.1f} |")
    for k, rs in {**runs, "torchrun": base}.items():
        print(f"the rest, by process ({k}; median of rounds): " + ", ".join(
            f"{name} {share:.2%}" for name, share in median_others(rs)))
    print(json.dumps({"benchmark": "overhead_levers", "rounds": rounds, "ratios": ratios,
                      "runs": runs, "torchrun": base}))


def medians(runs: list[dict], fields: tuple[str, ...]) -> dict[str, float]:
    """Each field's median over the runs that have it (a run too short for a steady window has
    no CPU split)."""
    return {f: statistics.median(r[f] for r in runs if f in r) for f in fields
            if any(f in r for r in runs)}


def median_others(runs: list[dict]) -> list[tuple[str, float]]:
    """Each process name's median share of the machine over runs (0 in a run without it)."""
    names = {n for r in runs for n in r.get("others", {})}
    shares = {n: statistics.median(r.get("others", {}).get(n, 0.0) for r in runs) for n in names}
    return sorted(((n, v) for n, v in shares.items() if v >= 0.001), key=lambda nv: -nv[1])


@contextlib.contextmanager
def worktree(rev: str | None) -> Iterator[Path | None]:
    """That commit's tree, checked out in a temporary git worktree (None: no commit asked)."""
    if rev is None:
        yield None
        return
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", folder, rev],
                       check=True, capture_output=True)
        try:
            yield Path(folder)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", folder])


# A local Ray cluster as a run has it (no dashboard), with five idle actors in the places of Ray
# Train's controller, synchronization actor, preemption watcher, autoscaling coordinator and our RunLog.
IDLE_RAY = """
import sys, ray
ray.init(address="local", num_cpus=4, include_dashboard=False)
@ray.remote(num_cpus=0)
class Idle:
    def ping(self):
        return 1
actors = [Idle.remote() for _ in range(5)]
ray.get([a.ping.remote() for a in actors])
print("ready", flush=True)
sys.stdin.read()
"""


def idle_ray(steps: int, rounds: int) -> None:
    """--idle-ray: torchrun alone, then beside an idle local Ray cluster (IDLE_RAY), taking turns:
    what Ray's presence alone costs a training loop on this machine's cores."""
    runs: dict[str, list[dict]] = {"torchrun alone": [], "torchrun beside an idle Ray": []}
    for _ in range(rounds):
        runs["torchrun alone"].append(run_baseline(steps, 2, 1))
        cluster = subprocess.Popen([sys.executable, "-c", IDLE_RAY], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            if cluster.stdout.readline().strip() != "ready":
                raise RuntimeError("the idle Ray cluster did not start")
            runs["torchrun beside an idle Ray"].append(run_baseline(steps, 2, 1))
        finally:
            cluster.stdin.close()
            cluster.wait(timeout=120)
    alone = statistics.median(r["tokens_per_s"] for r in runs["torchrun alone"])
    print(f"| run (median of {rounds}) | tokens/s | ratio | training CPU-s per step | "
          "training's share of the machine | the rest's share |")
    print("|---|---|---|---|---|---|")
    for k, rs in runs.items():
        med = medians(rs, ("tokens_per_s", "train_cpu_s_per_step", "train_share_of_machine",
                           "other_share_of_machine"))
        print(f"| {k} | {med['tokens_per_s']:.0f} | {med['tokens_per_s'] / alone:.3f} | "
              f"{med['train_cpu_s_per_step']:.3f} | {med['train_share_of_machine']:.1%} | "
              f"{med['other_share_of_machine']:.1%} |")
    for k, rs in runs.items():
        print(f"the rest, by process ({k}): " + ", ".join(
            f"{name} {share:.2%}" for name, share in median_others(rs)))
    print(json.dumps({"benchmark": "overhead_idle_ray", "rounds": rounds, "runs": runs}))


def run_baseline(steps: int, nproc: int, threads: int) -> dict:
    script = str(ROOT / "benchmarks" / "_ddp_baseline.py")
    if nproc > 1:
        cmd = [str(ROOT / ".venv/bin/torchrun"), "--standalone", f"--nproc_per_node={nproc}",
               script, f"--steps={steps}"]
    else:
        cmd = [sys.executable, script, f"--steps={steps}", f"--threads={threads}"]
    start = time.time()
    with CpuSampler("_ddp_baseline.py", exclude="torchrun") as cpu:
        out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": str(threads)}).stdout
    res = json.loads(out.strip().splitlines()[-1])
    return {"tokens_per_s": steady(res["times"], res["real_tokens"]),
            "startup_s": res["times"][0] - start, "params": res["params"],
            "allreduce_gbps": res["allreduce_gbps"], **cpu.window(res["times"])}


def median_run(runs: list[dict]) -> dict:
    keys = ("tokens_per_s", "startup_s", "train_cpu_s_per_step", "train_share_of_machine",
            "other_share_of_machine")
    return {**runs[0], **medians(runs, keys), "all_tokens_per_s": [round(r["tokens_per_s"]) for r in runs]}


STARTUP_STEPS = WARMUP + 2  # run_baseline measures a steady rate too


def startup_phases(storage: str, code: Path) -> dict[str, float]:
    """One elastic-train run of the default job to step STARTUP_STEPS, with the elastic_train
    package of `code` (driver and workers import it first: PYTHONPATH and working folder): its
    start-up phases (summary.json's `startup`, from the command to the end of the first step)."""
    name = f"startup-{time.time_ns()}"
    subprocess.run(
        [str(ROOT / ".venv/bin/elastic-train"), "train", *COMMON, f"train.max_steps={STARTUP_STEPS}",
         f"run.storage_path={storage}", f"run.name={name}"],
        check=True, capture_output=True, text=True, cwd=code,
        env={**os.environ, "PYTHONPATH": str(code)},
    )
    summary = json.loads((Path(storage) / name / "summary.json").read_text())
    return {k: v for k, v in summary["startup"].items() if k.endswith("_s")}


# A bare Ray Train run: a fresh local cluster (no dashboard) and a TorchTrainer of 2 gloo workers
# whose train function only notes the time; prints the command-to-train-function seconds (the later
# of the two ranks), the floor under any Ray Train job's start-up on this machine.
BARE_RAY_TRAIN = """
import psutil
T0 = psutil.Process().create_time()
import json, os, shutil, tempfile, time
import ray, ray.train
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
folder = tempfile.mkdtemp()
def noted():
    import torch.distributed as dist
    with open(os.path.join(folder, str(ray.train.get_context().get_world_rank())), "w") as f:
        f.write(str(time.time()))
    dist.barrier()
ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
TorchTrainer(noted, scaling_config=ScalingConfig(num_workers=2),
             run_config=RunConfig(storage_path=folder)).fit()
print(json.dumps(max(float(open(os.path.join(folder, r)).read()) for r in "01") - T0))
ray.shutdown()
shutil.rmtree(folder)
"""


def bare_ray_train_s() -> float:
    out = subprocess.run([sys.executable, "-c", BARE_RAY_TRAIN], check=True, capture_output=True,
                         text=True, env={**os.environ, "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"})
    return float(out.stdout.strip().splitlines()[-1])


def startup(rounds: int, against: str | None) -> None:
    """--startup: each round launches a bare Ray Train run (BARE_RAY_TRAIN), torchrun, then
    elastic-train (with --against REV: that commit's code too, from a git worktree, taking turns);
    prints the median of each start-up phase and the totals against torchrun's (command to the end
    of its first step) and the bare run's (command to its train function)."""
    base: list[float] = []
    with tempfile.TemporaryDirectory() as storage, worktree(against) as old:
        codes = {"this tree": ROOT} if old is None else {against: old, "this tree": ROOT}
        phases: dict[str, list[dict]] = {k: [] for k in codes}
        bare: list[float] = []
        for _ in range(rounds):
            # the bare job first: a local cluster started right after its shutdown waited an extra
            # second in ray.init (Ray's node-registration check retries once a second)
            bare.append(bare_ray_train_s())
            base.append(run_baseline(STARTUP_STEPS, 2, 1)["startup_s"])
            for k, code in codes.items():
                phases[k].append(startup_phases(storage, code))
    print(f"| phase (median of {rounds}) | " + " | ".join(codes) + " |")
    print("|---|" + "---|" * len(codes))
    for f in phases["this tree"][0]:
        print(f"| {f[:-2]} | " + " | ".join(
            f"{statistics.median(p[f] for p in runs):.2f}" for runs in phases.values()) + " |")
    torchrun = statistics.median(base)
    print(f"torchrun, command to first step: {torchrun:.2f} s (each: {'; '.join(f'{b:.2f}' for b in base)})")
    floor = statistics.median(bare)
    print(f"bare Ray Train (empty train function), command to train function: {floor:.2f} s "
          f"(each: {'; '.join(f'{b:.2f}' for b in bare)}), {floor / torchrun:.2f}x torchrun")
    for k, runs in phases.items():
        totals = [p["total_s"] for p in runs]
        each = "; ".join(f"{t:.2f}" for t in totals)
        print(f"{k}: total {statistics.median(totals):.2f} s (each: {each}), "
              f"{statistics.median(totals) / torchrun:.2f}x torchrun")
    print(json.dumps({"benchmark": "overhead_startup", "rounds": rounds, "phases": phases,
                      "torchrun_startup_s": base, "bare_ray_train_s": bare}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--levers", action="store_true", help="the CPU-gap levers' A/B instead (rounds: --repeat)")
    p.add_argument("--startup", action="store_true",
                   help="start-up phases against torchrun instead (rounds: --repeat)")
    p.add_argument("--idle-ray", action="store_true",
                   help="torchrun alone against torchrun beside an idle Ray cluster (rounds: --repeat)")
    p.add_argument("--lever", action="append", choices=list(LEVERS),
                   help="with --levers: only this setting (repeatable)")
    p.add_argument("--against", help="with --startup or --levers: also this git revision's code, "
                   "taking turns")
    args = p.parse_args()
    if args.startup:
        return startup(args.repeat, args.against)
    if args.idle_ray:
        return idle_ray(args.steps, args.repeat)
    if args.levers:
        return levers(args.steps, args.repeat, args.lever, args.against)
    runs: dict[str, list[dict]] = {"a": [], "b": [], "e": []}
    with tempfile.TemporaryDirectory() as storage:
        for _ in range(args.repeat):
            runs["a"].append(run_elastic(args.steps, 2, storage, reduce="exact"))
            runs["b"].append(run_baseline(args.steps, 2, 1))
            runs["e"].append(run_elastic(args.steps, 2, storage, reduce="ddp"))
        c = run_baseline(args.steps, 1, 2)
        d = run_elastic(args.steps, 1, storage, reduce="exact")
    a, b, e = (median_run(runs[k]) for k in "abe")
    grad_bytes = b["params"] * 4
    allreduce_s = 2 * 0.5 * grad_bytes / (b["allreduce_gbps"] * 1e9)
    figures = {
        "benchmark": "overhead",
        "elastic_2w_tokens_per_s": a["tokens_per_s"], "torchrun_2p_tokens_per_s": b["tokens_per_s"],
        "single_2t_tokens_per_s": c["tokens_per_s"], "elastic_1w_tokens_per_s": d["tokens_per_s"],
        "ratio_elastic_vs_torchrun": a["tokens_per_s"] / b["tokens_per_s"],
        "ratio_elastic_vs_single": a["tokens_per_s"] / c["tokens_per_s"],
        "elastic_2w_ddp_reduce_tokens_per_s": e["tokens_per_s"],
        "ratio_elastic_ddp_reduce_vs_torchrun": e["tokens_per_s"] / b["tokens_per_s"],
        "repeat": args.repeat,
        "all_tokens_per_s": {"a": a["all_tokens_per_s"], "b": b["all_tokens_per_s"],
                             "e": e["all_tokens_per_s"]},
        "scaling_2w_vs_ideal": a["tokens_per_s"] / (2 * d["tokens_per_s"]),
        "startup_s": {"elastic_2w": a["startup_s"], "torchrun_2p": b["startup_s"],
                      "single": c["startup_s"]},
        "elastic_2w_data_wait_s": a["data_wait_s"],
        "gradient_bytes": grad_bytes, "gloo_allreduce_gbps": b["allreduce_gbps"],
        "allreduce_s_per_step": allreduce_s,
        "cpu": {k: {f: round(v[f], 3) for f in ("train_cpu_s_per_step", "train_share_of_machine",
                                                 "other_share_of_machine") if f in v}
                for k, v in (("elastic_2w", a), ("torchrun_2p", b), ("elastic_2w_ddp_reduce", e))},
    }
    print(f"| run | steady real tokens/s (median of {args.repeat}) | start-up s |")
    print("|---|---|---|")
    print(f"| (a) elastic-train, 2 workers | {a['tokens_per_s']:.0f} | {a['startup_s']:.1f} |")
    print(f"| (b) torchrun DDP, 2 procs | {b['tokens_per_s']:.0f} | {b['startup_s']:.1f} |")
    print(f"| (c) 1 process, 2 threads | {c['tokens_per_s']:.0f} | {c['startup_s']:.1f} |")
    print(f"| (d) elastic-train, 1 worker | {d['tokens_per_s']:.0f} | - |")
    print(f"| (e) elastic-train, 2 workers, grad_reduce=ddp | {e['tokens_per_s']:.0f} | "
          f"{e['startup_s']:.1f} |")
    print(f"a/b = {figures['ratio_elastic_vs_torchrun']:.3f}, "
          f"a/c = {figures['ratio_elastic_vs_single']:.3f}, "
          f"a/(2d) = {figures['scaling_2w_vs_ideal']:.3f}, "
          f"e/b = {figures['ratio_elastic_ddp_reduce_vs_torchrun']:.3f}; gradient {grad_bytes / 1e6:.1f} MB, "
          f"gloo all-reduce {b['allreduce_gbps']:.2f} GB/s -> {allreduce_s * 1e3:.1f} ms/step")
    print("| run | training CPU-s per step | training's share of the machine | the rest's share |")
    print("|---|---|---|---|")
    for k, v in figures["cpu"].items():
        if v:
            print(f"| {k} | {v['train_cpu_s_per_step']:.3f} | {v['train_share_of_machine']:.1%} | "
                  f"{v['other_share_of_machine']:.1%} |")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
