"""A model that cannot train as 2 unsharded workers in this machine's memory trains with
`train.sharding=fsdp` on 2 workers through the command line (issue 29).

The size comes from the bytes per parameter per rank (BENCHMARKS.md, "Sharding: bytes per
parameter per rank", measured by sharding_memory.py), before activations, Ray and the OS:

| reduction | none, each worker | none, 2 workers | fsdp, each of 2 workers |
|---|---|---|---|
| `exact` | 24 | 48 | 32 / 2 = 16 |
| `ddp` | 20 (4 weights, 4 grads, 8 moments, 4 buckets) | 40 | 16 / 2 = 8 |

The default, the embedded GPT with 14 layers of d_model 2048 (705M parameters) and the ddp
reduction, needs 26 GiB as 2 unsharded workers (31.5 GiB with exact): more than the machine's
24 GiB in all. fsdp holds 5.3 GiB of state per worker. (The exact reduction would need a model of
540M or more to overflow 24 GiB unsharded, and then 8.3 GiB per fsdp worker before activations:
with Ray's own processes that fills the shared machine; ddp shows the same point with room
to spare.) It is not tried unsharded.

Runs `elastic-train train ... train.sharding=fsdp` (local Ray, 2 CPU workers, no periodic
checkpoint: the final one only, written without a copy of the rows: sharding.sharded_snapshot),
samples the peak resident memory (VmHWM) of the run's two training workers (the Ray processes
under this command), and reads seconds per step from the run's metrics.jsonl. Refuses to start
unless `--min-free-gib` (18) is available: the machine is shared. Prints one JSON line (the
last line of stdout).

Run: .venv/bin/python benchmarks/sharding_bigmodel.py [--layers 14 --d-model 2048 --steps 3
     --reduce ddp]
"""

# 16 GiB and ~6 minutes: run it alone, when the machine has room
# run_all: skip
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

GIB = 2**30
NONE_BYTES = {"exact": 24, "ddp": 20}  # per parameter, on each unsharded worker
FSDP_BYTES = {"exact": 32, "ddp": 16}  # per parameter, over W ranks


def parameters(layers: int, d_model: int) -> int:
    """The embedded GPT's parameter count, from a model built on the meta device."""
    from elastic_train.config import ModelConfig
    from elastic_train.training.model import build_meta_model, count_parameters

    model = build_meta_model(ModelConfig(n_layer=layers, d_model=d_model, n_head=16), 512)
    return count_parameters(model)


def vm_hwm(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakSampler:
    """The peak resident memory of each training worker under `root` (Ray's RayTrainWorker
    processes), read from VmHWM (the kernel's own high-water mark) every `interval_s`."""

    def __init__(self, root: int, interval_s: float = 0.5) -> None:
        self.root, self.interval_s = psutil.Process(root), interval_s
        self.peaks: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                children = self.root.children(recursive=True)
            except psutil.Error:
                return
            for child in children:
                try:
                    if "RayTrainWorker" not in " ".join(child.cmdline()):
                        continue
                except psutil.Error:
                    continue
                self.peaks[child.pid] = max(self.peaks.get(child.pid, 0), vm_hwm(child.pid))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--reduce", choices=["exact", "ddp"], default="ddp")
    parser.add_argument("--min-free-gib", type=float, default=18.0)
    args = parser.parse_args()
    available = psutil.virtual_memory().available / GIB
    if available < args.min_free_gib:
        sys.exit(f"error: {available:.1f} GiB available, this benchmark needs {args.min_free_gib}")
    count = parameters(args.layers, args.d_model)
    storage = Path(tempfile.mkdtemp(prefix="sharding-bigmodel-"))
    command = [str(Path(sys.executable).parent / "elastic-train"), "train",
               f"model.n_layer={args.layers}", f"model.d_model={args.d_model}", "model.n_head=16",
               "train.sharding=fsdp", f"train.grad_reduce={args.reduce}",
               f"train.max_steps={args.steps}", "data.micro_batch_tokens=512",
               "data.global_batch_tokens=1024", "checkpoint.every_steps=0", "eval.fraction=0",
               "checkpoint.keep_best=false", "log.progress=none", f"run.storage_path={storage}",
               "run.name=big"]
    t0 = time.time()
    process = subprocess.Popen(command)
    with PeakSampler(process.pid) as sampler:
        code = process.wait()
    wall_s = time.time() - t0
    run = storage / "big"
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step_time_s"] for r in lines if "step_time_s" in r]
    summary = json.loads((run / "summary.json").read_text())
    peaks = sorted(sampler.peaks.values(), reverse=True)[:2]
    print(json.dumps({
        "benchmark": "sharding_bigmodel", "exit_code": code, "status": summary.get("status"),
        "parameters": count, "layers": args.layers, "d_model": args.d_model, "reduce": args.reduce,
        "unsharded_2_workers_gib": 2 * NONE_BYTES[args.reduce] * count / GIB,
        "fsdp_state_per_worker_gib": FSDP_BYTES[args.reduce] / 2 * count / GIB,
        "worker_peak_rss_gib": [p / GIB for p in peaks], "steps": len(steps),
        "step_s": steps,
        "median_step_s_after_first": statistics.median(steps[1:]) if len(steps) > 1 else None,
        "final_loss": summary.get("final_loss"), "wall_s": wall_s, "run_dir": str(run)}))


if __name__ == "__main__":
    main()
