"""Padding benchmark: length-bucketed against random micro-batches on the embedded corpus.

Two figures for each batching mode, with the default plan (micro_batch_tokens 2048, shuffle_window
1024, K = 8 partitions) as seen by 2 ranks:
- real-token efficiency, real tokens / padded tokens, over one whole epoch of both ranks;
- real tokens/s of forward + backward (`elastic_train.training.step.forward_backward`, world size 1, no DDP,
  default model, one torch thread) over rank 0's first steps after a warm-up.

The two modes are timed alternately, step by step, so that load from other processes on the machine
hits both alike. CPU time (one thread) is reported next to wall time: it is the steadier figure on a
shared machine. Prints a table, then one JSON line of figures (the last line of stdout).

Run: flock /tmp/et_ray.lock .venv/bin/python benchmarks/padding.py
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from elastic_train.config import ModelConfig
from elastic_train.data.batches import MicroBatch, iter_parquet_batches
from elastic_train.data.blocks import local_rank_steps
from elastic_train.data.dataset import inspect_dataset
from elastic_train.data.plan import StreamSpec, owned_partitions
from elastic_train.data.prepare import default_corpus_dir
from elastic_train.training.losses import LossModule
from elastic_train.training.model import build_model
from elastic_train.training.step import StepSetup, forward_backward

MAX_SEQ_LEN = 512
MICRO_BATCH_TOKENS = 2048
SHUFFLE_WINDOW = 1024
NUM_PARTITIONS = 8
WORLD_SIZE = 2
SEED = 0
MODES = {"bucketed": True, "random": False}


def rank_steps(files: list[str], world_rank: int, bucketing: bool):
    """This rank's steps of epoch 0, ending at its first empty step."""
    spec = StreamSpec(NUM_PARTITIONS, MICRO_BATCH_TOKENS, SHUFFLE_WINDOW, SEED, bucketing)
    yield from local_rank_steps(files, spec, partitions=owned_partitions(world_rank, WORLD_SIZE,
                                                                          NUM_PARTITIONS))


def epoch_padding(files: list[str], bucketing: bool) -> dict[str, float]:
    """Real and padded tokens over one epoch of every rank."""
    real = padded = micro_batches = rows = 0
    steps = []
    for world_rank in range(WORLD_SIZE):
        n_steps = 0
        for step in rank_steps(files, world_rank, bucketing):
            n_steps += 1
            for mb in step:
                real += mb.real_tokens
                padded += mb.padded_tokens
                micro_batches += 1
                rows += len(mb.lengths)
        steps.append(n_steps)
    return {"real_tokens": real, "padded_tokens": padded, "efficiency": real / padded,
            "micro_batches": micro_batches, "rows": rows, "global_steps": max(steps)}


def time_step(model: torch.nn.Module, step: list[MicroBatch]) -> tuple[float, float]:
    """(wall s, cpu s) of one forward + backward over this rank's micro-batches."""
    model.zero_grad(set_to_none=True)
    targets = float(sum(mb.targets for mb in step))
    wall0, cpu0 = time.perf_counter(), time.process_time()
    forward_backward(LossModule(model), step, setup=StepSetup(device=torch.device("cpu"), world_size=1),
                     global_targets=targets)
    return time.perf_counter() - wall0, time.process_time() - cpu0


def throughput(files: list[str], warmup_steps: int, measured_steps: int) -> dict[str, dict]:
    """Real tokens/s of rank 0's first steps in each mode, timed alternately."""
    streams = {mode: rank_steps(files, 0, bucketing) for mode, bucketing in MODES.items()}
    models = {}
    for mode in MODES:
        torch.manual_seed(SEED)
        models[mode] = build_model(ModelConfig(), MAX_SEQ_LEN)
    totals = {mode: dict(real_tokens=0, padded_tokens=0, wall_s=0.0, cpu_s=0.0) for mode in MODES}
    for i in range(warmup_steps + measured_steps):
        for mode, stream in streams.items():
            step = next(stream)
            wall_s, cpu_s = time_step(models[mode], step)
            if i < warmup_steps:
                continue
            t = totals[mode]
            t["real_tokens"] += sum(mb.real_tokens for mb in step)
            t["padded_tokens"] += sum(mb.padded_tokens for mb in step)
            t["wall_s"] += wall_s
            t["cpu_s"] += cpu_s
    for t in totals.values():
        t["real_tokens_per_s"] = t["real_tokens"] / t["wall_s"]
        t["real_tokens_per_s_cpu"] = t["real_tokens"] / t["cpu_s"]
        t["padded_tokens_per_s"] = t["padded_tokens"] / t["wall_s"]
    return totals


def length_stats(files: list[str]) -> dict[str, float]:
    lengths = np.concatenate([np.asarray(b["length"]) for b in iter_parquet_batches(files)])
    return {"rows": int(len(lengths)), "mean": float(lengths.mean()),
            "p50": float(np.percentile(lengths, 50)), "p90": float(np.percentile(lengths, 90)),
            "max": int(lengths.max()), "at_max_seq_len": float((lengths == MAX_SEQ_LEN).mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=15, help="measured steps per mode")
    args = parser.parse_args()
    torch.set_num_threads(1)
    files = inspect_dataset(str(default_corpus_dir(MAX_SEQ_LEN))).files

    lengths = length_stats(files)
    padding = {mode: epoch_padding(files, bucketing) for mode, bucketing in MODES.items()}
    speed = throughput(files, args.warmup_steps, args.steps)

    print(f"corpus: {lengths['rows']} rows, length mean {lengths['mean']:.0f}, "
          f"p50 {lengths['p50']:.0f}, p90 {lengths['p90']:.0f}, max {lengths['max']} "
          f"({lengths['at_max_seq_len']:.1%} at max_seq_len)")
    print(f"plan: micro_batch_tokens {MICRO_BATCH_TOKENS}, shuffle_window {SHUFFLE_WINDOW}, "
          f"K {NUM_PARTITIONS}, {WORLD_SIZE} ranks; timing: rank 0, {args.steps} steps after "
          f"{args.warmup_steps} warm-up, 1 thread")
    print(f"{'mode':<9} {'efficiency':>10} {'rows/mb':>8} {'steps':>6} "
          f"{'real tok/s':>11} {'(cpu)':>8} {'padded tok/s':>13}")
    for mode in MODES:
        p, s = padding[mode], speed[mode]
        print(f"{mode:<9} {p['efficiency']:>10.3f} {p['rows'] / p['micro_batches']:>8.1f} "
              f"{p['global_steps']:>6} {s['real_tokens_per_s']:>11.0f} "
              f"{s['real_tokens_per_s_cpu']:>8.0f} {s['padded_tokens_per_s']:>13.0f}")
    ratio = speed["bucketed"]["real_tokens_per_s"] / speed["random"]["real_tokens_per_s"]
    ratio_cpu = speed["bucketed"]["real_tokens_per_s_cpu"] / speed["random"]["real_tokens_per_s_cpu"]
    print(f"real tokens/s bucketed / random: {ratio:.2f} (wall), {ratio_cpu:.2f} (cpu)")

    print(json.dumps({
        "benchmark": "padding",
        "efficiency_bucketed": round(padding["bucketed"]["efficiency"], 4),
        "efficiency_random": round(padding["random"]["efficiency"], 4),
        "global_steps_bucketed": padding["bucketed"]["global_steps"],
        "global_steps_random": padding["random"]["global_steps"],
        "real_tokens_per_s_bucketed": round(speed["bucketed"]["real_tokens_per_s"], 1),
        "real_tokens_per_s_random": round(speed["random"]["real_tokens_per_s"], 1),
        "real_tokens_per_s_ratio": round(ratio, 3),
        "real_tokens_per_s_cpu_ratio": round(ratio_cpu, 3),
        "padded_tokens_per_s_bucketed": round(speed["bucketed"]["padded_tokens_per_s"], 1),
        "padded_tokens_per_s_random": round(speed["random"]["padded_tokens_per_s"], 1),
        "measured_steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "micro_batch_tokens": MICRO_BATCH_TOKENS,
        "shuffle_window": SHUFFLE_WINDOW,
        "num_partitions": NUM_PARTITIONS,
        "world_size": WORLD_SIZE,
        "corpus_rows": lengths["rows"],
        "corpus_mean_length": round(lengths["mean"], 1),
    }))


if __name__ == "__main__":
    main()
