"""Checkpoint benchmark: seconds the training loop is blocked per checkpoint, against step time.

The loop blocks only for `snapshot()` (an in-memory CPU copy); `write_checkpoint()` runs in Ray's
background upload thread. For the default model with AdamW and with bitsandbytes AdamW8bit this
measures, after one optimizer step so that the optimizer state exists:
- snapshot seconds (median of repeats) and write_checkpoint seconds to a temporary folder, and the
  checkpoint's size on disk;
- one training step: forward_backward + optimizer_step over 8 micro-batches of up to 2048 tokens
  (the first global steps of the embedded corpus at world size 1, one torch thread);
- the blocked fraction: snapshot / step time, and per step when checkpointing every 50 steps;
- optimizer state bytes per parameter (elastic_train.training.optim.optimizer_state_bytes / count_parameters).
The same for a bigger model (d_model 512, n_layer 4) without the full step: its step time is
estimated as 8 x one micro-batch's forward/backward + the optimizer step.

Not included: the `ray.train.report` barrier that follows the snapshot in a real run (it waits for
the controller's poll); the loop logs the whole blocked time as the `checkpoint` event's blocked_s.
Prints a table, then one JSON line of figures (the last line of stdout).

Run: flock /tmp/et_ray.lock .venv/bin/python benchmarks/checkpoint.py
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from elastic_train.config import Config, ModelConfig, OptimConfig
from elastic_train.data.batches import MicroBatch
from elastic_train.data.blocks import local_rank_steps
from elastic_train.data.dataset import inspect_dataset
from elastic_train.data.plan import StreamSpec
from elastic_train.data.prepare import default_corpus_dir
from elastic_train.training.checkpoint import snapshot, write_checkpoint
from elastic_train.training.losses import LossModule
from elastic_train.training.model import build_model, count_parameters
from elastic_train.training.optim import build_optimizer, optimizer_state_bytes
from elastic_train.training.step import StepSetup, TrainState, train_step

MAX_SEQ_LEN = 512
NUM_PARTITIONS = 8
MICRO_BATCH_TOKENS = 2048
CHECKPOINT_EVERY_STEPS = 50  # the config default
CPU = torch.device("cpu")
OPTIMIZERS = ("adamw", "adamw8bit")
MODELS = {"default": ModelConfig(), "d512_l4": ModelConfig(d_model=512, n_layer=4)}


def global_steps(n: int) -> list[list[MicroBatch]]:
    """The first `n` global steps of the corpus at world size 1: 8 micro-batches each."""
    files = inspect_dataset(str(default_corpus_dir(MAX_SEQ_LEN))).files
    stream = local_rank_steps(files, StreamSpec(NUM_PARTITIONS, MICRO_BATCH_TOKENS, 1024, seed=0),
                              partitions=list(range(NUM_PARTITIONS)))
    return [next(stream) for _ in range(n)]


def one_step(model, optimizer, micro_batches: list[MicroBatch]) -> tuple[float, float]:
    """One step, the loop's own `train_step`: (forward_backward s, optimizer_step s)."""
    result = train_step(LossModule(model), model, optimizer, micro_batches,
                        setup=StepSetup(device=CPU, world_size=1), step=0, lr=1e-3,
                        data_targets=float(sum(mb.targets for mb in micro_batches)))
    return result.forward_backward_s, result.optimizer_s


def state_breakdown(optimizer) -> dict[str, int]:
    """Parameters whose optimizer state is 8-bit against 32-bit (bnb keeps small tensors 32-bit)."""
    n8 = n32 = 0
    for p, state in optimizer.state.items():
        low = any(torch.is_tensor(v) and v.dtype == torch.uint8 for v in state.values())
        n8, n32 = (n8 + p.numel(), n32) if low else (n8, n32 + p.numel())
    return {"params_8bit_state": n8, "params_32bit_state": n32}


def time_checkpoint(model, optimizer, repeats: int, writes: int) -> dict[str, float]:
    """Median snapshot and write_checkpoint seconds, and the checkpoint's bytes on disk."""
    cfg = Config().to_dict()
    snap_s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        snap = snapshot(model, optimizer, None, asdict(TrainState()), cfg, 1)
        snap_s.append(time.perf_counter() - t0)
    scratch = Path(tempfile.mkdtemp(prefix="et_bench_ckpt_"))
    try:
        write_s = []
        for i in range(writes):
            t0 = time.perf_counter()
            write_checkpoint(snap, scratch / f"ckpt_{i}")
            write_s.append(time.perf_counter() - t0)
        size = sum(f.stat().st_size for f in (scratch / "ckpt_0").iterdir())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"snapshot_s": statistics.median(snap_s), "write_s": statistics.median(write_s),
            "checkpoint_bytes": size}


def bench_default(optim: str, steps: list[list[MicroBatch]], args) -> dict:
    torch.manual_seed(0)
    model = build_model(MODELS["default"], MAX_SEQ_LEN)
    optimizer = build_optimizer(model, OptimConfig(name=optim), use_gpu=False)
    one_step(model, optimizer, steps[0])  # warm-up; creates the optimizer state
    times = [one_step(model, optimizer, mbs) for mbs in steps[1:]]
    step_s = statistics.median(fb + opt for fb, opt in times)
    r = time_checkpoint(model, optimizer, args.snapshot_repeats, args.write_repeats)
    r.update(step_s=step_s, optimizer_s=statistics.median(opt for _, opt in times),
             blocked_fraction_of_step=r["snapshot_s"] / step_s,
             blocked_fraction_every_50=r["snapshot_s"] / (CHECKPOINT_EVERY_STEPS * step_s),
             write_fraction_of_step=r["write_s"] / step_s,
             params=count_parameters(model),
             state_bytes_per_param=optimizer_state_bytes(optimizer) / count_parameters(model),
             **state_breakdown(optimizer))
    return r


def bench_big(optim: str, micro_batch: MicroBatch, args) -> dict:
    """The bigger model: state bytes and checkpoint times; step time estimated from 1 micro-batch."""
    torch.manual_seed(0)
    model = build_model(MODELS["d512_l4"], MAX_SEQ_LEN)
    optimizer = build_optimizer(model, OptimConfig(name=optim), use_gpu=False)
    fb_s, opt_s = one_step(model, optimizer, [micro_batch])
    step_est_s = NUM_PARTITIONS * fb_s + opt_s
    r = time_checkpoint(model, optimizer, max(args.snapshot_repeats // 4, 3), args.write_repeats)
    r.update(step_estimate_s=step_est_s, optimizer_s=opt_s,
             blocked_fraction_of_step_estimate=r["snapshot_s"] / step_est_s,
             params=count_parameters(model),
             state_bytes_per_param=optimizer_state_bytes(optimizer) / count_parameters(model),
             **state_breakdown(optimizer))
    return r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--snapshot-repeats", type=int, default=20)
    parser.add_argument("--write-repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    steps = global_steps(args.steps + 1)
    default = {optim: bench_default(optim, steps, args) for optim in OPTIMIZERS}
    big = {optim: bench_big(optim, steps[0][0], args) for optim in OPTIMIZERS}

    print(f"default model ({default['adamw']['params']:,} params); step = 8 micro-batches of <= "
          f"{MICRO_BATCH_TOKENS} tokens, 1 thread; medians")
    print(f"{'optimizer':<10} {'step s':>7} {'snapshot s':>10} {'write s':>8} {'MiB':>6} "
          f"{'blocked/step':>12} {'/50 steps':>9} {'state B/param':>13} {'32-bit params':>13}")
    for optim, r in default.items():
        print(f"{optim:<10} {r['step_s']:>7.3f} {r['snapshot_s']:>10.4f} {r['write_s']:>8.4f} "
              f"{r['checkpoint_bytes'] / 2**20:>6.1f} {r['blocked_fraction_of_step']:>12.2%} "
              f"{r['blocked_fraction_every_50']:>9.3%} {r['state_bytes_per_param']:>13.3f} "
              f"{r['params_32bit_state']:>13,}")
    print(f"d_model 512, n_layer 4 ({big['adamw']['params']:,} params); step time estimated as "
          f"8 x one micro-batch + optimizer")
    print(f"{'optimizer':<10} {'~step s':>7} {'snapshot s':>10} {'write s':>8} {'MiB':>6} "
          f"{'blocked/step':>12} {'state B/param':>13} {'32-bit params':>13}")
    for optim, r in big.items():
        print(f"{optim:<10} {r['step_estimate_s']:>7.2f} {r['snapshot_s']:>10.4f} "
              f"{r['write_s']:>8.4f} {r['checkpoint_bytes'] / 2**20:>6.1f} "
              f"{r['blocked_fraction_of_step_estimate']:>12.2%} {r['state_bytes_per_param']:>13.3f} "
              f"{r['params_32bit_state']:>13,}")

    figures: dict = {"benchmark": "checkpoint"}
    for model_name, results in (("default", default), ("d512_l4", big)):
        for optim, r in results.items():
            for key, value in r.items():
                rounded = round(value, 6) if isinstance(value, float) else value
                figures[f"{model_name}_{optim}_{key}"] = rounded
    figures["checkpoint_every_steps"] = CHECKPOINT_EVERY_STEPS
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
