"""Memory benchmark: the data stream's peak memory does not grow with dataset size nor with epochs.

Each case runs in a fresh subprocess, so every peak is its own. The child streams whole epochs
through `blocks.local_rank_steps(files, ...)` as rank 0 of 2 (default plan: K = 8,
micro_batch_tokens 2048, shuffle_window 1024), dropping each step as a training loop would, and
records:
- ru_maxrss (resource.getrusage), the process's peak resident memory, and its rise above the
  baseline taken just before streaming (after imports and opening the dataset); VmHWM from
  /proc/self/status as a cross-check;
- pyarrow's memory pool peak (Arrow buffers are invisible to tracemalloc);
- the tracemalloc peak (Python and numpy allocations), in a second subprocess per case, so that
  tracemalloc's own bookkeeping does not inflate ru_maxrss.

Cases: A, the embedded corpus (one shard), 1 epoch; B, a dataset 10x larger (10 copies of the
corpus's shards, ids offset so they stay unique, in a temporary folder), 1 epoch; C, 20x, 1 epoch
(B against C shows growth with size apart from the one-off step from one shard to several); A over
3 epochs against 1. Prints a table, then one JSON line of figures (the last line of stdout).

The parent imports nothing heavy and prepares the data in a subprocess of its own: Linux keeps
ru_maxrss across exec, so a child would otherwise start from its parent's peak.

Run: flock /tmp/et_ray.lock .venv/bin/python benchmarks/memory.py
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NUM_PARTITIONS = 8
WORLD_SIZE = 2
WORLD_RANK = 0
MICRO_BATCH_TOKENS = 2048
SHUFFLE_WINDOW = 1024
MAX_SEQ_LEN = 512
SCALES = (10, 20)
GOAL_REL_DIFF = 0.10


def maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def vm_hwm_bytes() -> int:
    """Peak resident memory of this process's own address space (not inherited across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return -1


def child(dataset: str, epochs: int, trace: bool) -> None:
    """Stream `epochs` epochs of rank 0's steps and print one JSON line of peaks."""
    import tracemalloc

    import pandas  # noqa: F401  (pyarrow imports it on the first batch: keep that out of the peaks)
    import pyarrow as pa

    from elastic_train.data.blocks import local_rank_steps
    from elastic_train.data.dataset import inspect_dataset
    from elastic_train.data.plan import StreamSpec, owned_partitions

    info = inspect_dataset(dataset)
    partitions = owned_partitions(WORLD_RANK, WORLD_SIZE, NUM_PARTITIONS)
    _hold_what_a_worker_holds()
    baseline = maxrss_bytes()
    if trace:
        tracemalloc.start()
    per_epoch = []
    t0 = time.perf_counter()
    for epoch in range(epochs):
        if trace:
            tracemalloc.reset_peak()
        steps = rows = real = 0
        spec = StreamSpec(NUM_PARTITIONS, MICRO_BATCH_TOKENS, SHUFFLE_WINDOW, seed=0)
        for step in local_rank_steps(info.files, spec, partitions=partitions, epoch=epoch):
            steps += 1
            rows += sum(len(mb.ids) for mb in step)
            real += sum(mb.real_tokens for mb in step)
        record = {"epoch": epoch, "steps": steps, "rows": rows, "real_tokens": real,
                  "maxrss_bytes": maxrss_bytes(), "vm_hwm_bytes": vm_hwm_bytes(),
                  "arrow_pool_max_bytes": pa.default_memory_pool().max_memory()}
        if trace:
            record["tracemalloc_peak_bytes"] = tracemalloc.get_traced_memory()[1]
        per_epoch.append(record)
    print(json.dumps({"dataset_rows": info.rows, "files": len(info.files), "baseline_bytes": baseline,
                      "stream_s": time.perf_counter() - t0, "epochs": per_epoch}))


_WORKER_STATE: list = []


def _hold_what_a_worker_holds() -> None:
    """A training worker's fixed footprint: torch, the default model, AdamW state after one
    step on a full micro-batch. The data stream's memory comes on top of it."""
    import torch

    from elastic_train.config import ModelConfig, OptimConfig
    from elastic_train.training.model import build_model, token_loss_sum
    from elastic_train.training.optim import build_optimizer

    torch.set_num_threads(1)
    model = build_model(ModelConfig(), 512)
    optimizer = build_optimizer(model, OptimConfig(), False)
    tokens = torch.randint(0, 256, (MICRO_BATCH_TOKENS // 512, 512))
    loss, _ = token_loss_sum(model, tokens, torch.full((len(tokens),), 512))
    loss.backward()
    optimizer.step()
    _WORKER_STATE.append((model, optimizer))


def write_scaled_copy(source: Path, target: Path, copies: int) -> None:
    """`copies` copies of every shard of `source`, ids offset per copy so that they stay unique."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    shards = sorted(source.glob("*.parquet"))
    id_span = 1 + max(pc.max(pq.read_table(s, columns=["id"]).column("id")).as_py() for s in shards)
    target.mkdir(parents=True, exist_ok=True)
    n = 0
    for copy in range(copies):
        for shard in shards:
            table = pq.read_table(shard)
            i = table.schema.get_field_index("id")
            ids = pc.add(table.column("id"), pa.scalar(copy * id_span, pa.int64()))
            pq.write_table(table.set_column(i, "id", ids), target / f"part-{n:05d}.parquet")
            n += 1


def prepare_data(scratch: str) -> None:
    """The embedded corpus (prepared once and cached) and its scaled copies under `scratch`."""
    from elastic_train.data.prepare import default_corpus_dir

    corpus = default_corpus_dir(MAX_SEQ_LEN)
    paths = {"1": str(corpus)}
    for scale in SCALES:
        write_scaled_copy(corpus, Path(scratch) / f"x{scale}", scale)
        paths[str(scale)] = str(Path(scratch) / f"x{scale}")
    print(json.dumps(paths))


def run_child(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_case(dataset: str, epochs: int) -> dict:
    """Peaks of one case: ru_maxrss etc. from one subprocess, tracemalloc from another."""
    rss = run_child("--child", dataset, "--epochs", str(epochs))
    traced = run_child("--child", dataset, "--epochs", str(epochs), "--trace")
    for rec, rec_traced in zip(rss["epochs"], traced["epochs"], strict=True):
        rec["tracemalloc_peak_bytes"] = rec_traced["tracemalloc_peak_bytes"]
    return rss


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def rel(b: float, a: float) -> float:
    return round((b - a) / a, 4) if a else float("nan")


def print_table(cases: dict[str, dict]) -> None:
    print(f"stream: rank {WORLD_RANK} of {WORLD_SIZE}, K {NUM_PARTITIONS}, micro_batch_tokens "
          f"{MICRO_BATCH_TOKENS}, shuffle_window {SHUFFLE_WINDOW}; memory in MiB")
    print(f"{'case':<24} {'rows':>7} {'files':>5} {'steps':>6} {'s':>5} {'maxrss':>7} {'rise':>6} "
          f"{'VmHWM':>6} {'arrow':>6} {'tracemalloc':>11}")
    for label, r in cases.items():
        e = r["epochs"][-1]
        print(f"{label:<24} {r['dataset_rows']:>7} {r['files']:>5} "
              f"{sum(x['steps'] for x in r['epochs']):>6} {r['stream_s']:>5.1f} "
              f"{mib(e['maxrss_bytes']):>7} {mib(e['maxrss_bytes'] - r['baseline_bytes']):>6} "
              f"{mib(e['vm_hwm_bytes']):>6} {mib(e['arrow_pool_max_bytes']):>6} "
              f"{mib(e['tracemalloc_peak_bytes']):>11}")


def parent() -> None:
    scratch = tempfile.mkdtemp(prefix="et_bench_memory_")
    try:
        paths = run_child("--prepare", scratch)
        a, b, c = paths["1"], paths[str(SCALES[0])], paths[str(SCALES[1])]
        cases = {
            "A corpus, 1 epoch": run_case(a, 1),
            f"B {SCALES[0]}x corpus, 1 epoch": run_case(b, 1),
            f"C {SCALES[1]}x corpus, 1 epoch": run_case(c, 1),
            "A corpus, 3 epochs": run_case(a, 3),
        }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print_table(cases)
    ra, rb, rc, r3 = (r["epochs"][-1] for r in cases.values())
    a3 = list(cases.values())[3]["epochs"]
    figures = {
        "benchmark": "memory",
        "maxrss_a_bytes": ra["maxrss_bytes"],
        "maxrss_b_bytes": rb["maxrss_bytes"],
        "maxrss_c_bytes": rc["maxrss_bytes"],
        "maxrss_rel_diff_b_vs_a": rel(rb["maxrss_bytes"], ra["maxrss_bytes"]),
        "maxrss_rel_diff_c_vs_b": rel(rc["maxrss_bytes"], rb["maxrss_bytes"]),
        "vm_hwm_rel_diff_b_vs_a": rel(rb["vm_hwm_bytes"], ra["vm_hwm_bytes"]),
        "baseline_bytes": list(cases.values())[0]["baseline_bytes"],
        "arrow_pool_max_a_bytes": ra["arrow_pool_max_bytes"],
        "arrow_pool_max_b_bytes": rb["arrow_pool_max_bytes"],
        "arrow_pool_max_c_bytes": rc["arrow_pool_max_bytes"],
        "tracemalloc_peak_a_bytes": ra["tracemalloc_peak_bytes"],
        "tracemalloc_peak_b_bytes": rb["tracemalloc_peak_bytes"],
        "tracemalloc_peak_c_bytes": rc["tracemalloc_peak_bytes"],
        "tracemalloc_rel_diff_b_vs_a": rel(rb["tracemalloc_peak_bytes"], ra["tracemalloc_peak_bytes"]),
        "maxrss_3_epochs_bytes": r3["maxrss_bytes"],
        "maxrss_rel_diff_3_vs_1_epoch": rel(r3["maxrss_bytes"], ra["maxrss_bytes"]),
        "maxrss_after_each_epoch_bytes": [e["maxrss_bytes"] for e in a3],
        "tracemalloc_peak_each_epoch_bytes": [e["tracemalloc_peak_bytes"] for e in a3],
        "arrow_pool_max_after_each_epoch_bytes": [e["arrow_pool_max_bytes"] for e in a3],
        "rows": [r["dataset_rows"] for r in list(cases.values())[:3]],
        "rank0_rows": [r["epochs"][0]["rows"] for r in list(cases.values())[:3]],
        "goal_rel_diff": GOAL_REL_DIFF,
    }
    verdict = "met" if abs(figures["maxrss_rel_diff_b_vs_a"]) < GOAL_REL_DIFF else "NOT met"
    print(f"peak maxrss: B vs A {figures['maxrss_rel_diff_b_vs_a']:+.1%} (goal < "
          f"{GOAL_REL_DIFF:.0%}: {verdict}), C vs B {figures['maxrss_rel_diff_c_vs_b']:+.1%}; "
          f"tracemalloc peak B vs A {figures['tracemalloc_rel_diff_b_vs_a']:+.1%}")
    print(f"3 epochs vs 1: maxrss {figures['maxrss_rel_diff_3_vs_1_epoch']:+.1%}; after each epoch "
          f"maxrss {', '.join(mib(e['maxrss_bytes']) for e in a3)}, tracemalloc peak "
          f"{', '.join(mib(e['tracemalloc_peak_bytes']) for e in a3)}")
    print(json.dumps(figures))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", metavar="DATASET", help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prepare", metavar="SCRATCH", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prepare:
        prepare_data(args.prepare)
    elif args.child:
        child(args.child, args.epochs, args.trace)
    else:
        parent()


if __name__ == "__main__":
    main()
