"""Reduction and communication: exact vs ddp vs each communication hook, on a model of tens of
millions of parameters, 2 gloo processes (1 thread each), no Ray.

Every mode trains the same steps on the same batches (bytes of standard-library files, a fixed
learning rate) through `loop.train_step`, as a worker does:
  compute   no communication at all (each rank steps on its own gradient): the floor
  exact     train.grad_reduce=exact: float64 sums, one all-reduce of 8 bytes/param per step
  ddp       torch DDP, fp32 buckets all-reduced during the last backward
  fp16, bf16, powersgd   ddp with that communication hook (commhooks.py)
Per mode: median step time, all-reduced bytes per step and rank (counted at dist.all_reduce; DDP's
own bucket all-reduce, which bypasses it, is 4 bytes a parameter), `exposed_comm_s` (median step
time over compute's), and the loss at the last step. For exact, also the seconds of its all-reduce
and how often float64 summation rounded (`inexact_fraction`: the share of (parameter, addition)
pairs whose float64 sum was not exact, local accumulation and the 2-rank sum together; see
ExactGradSum's docstring).

    .venv/bin/python benchmarks/reduce.py [--steps 12] [--d-model 512] [--layers 6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from elastic_train.config import ModelConfig, load_config  # noqa: E402
from elastic_train.data.batches import pad_rows  # noqa: E402
from elastic_train.training.commhooks import ddp_kwargs, register_comm_hook  # noqa: E402
from elastic_train.training.losses import LossModule  # noqa: E402
from elastic_train.training.model import build_model, count_parameters  # noqa: E402
from elastic_train.training.reduce import ExactGradSum  # noqa: E402
from elastic_train.training.step import StepSetup, train_step

MODES = ["compute", "exact", "ddp", "fp16", "bf16", "powersgd"]
ROW_TOKENS = 64
WARMUP_STEPS = 2  # excluded from the median step time; also PowerSGD's warm-up
CPU = torch.device("cpu")


def corpus() -> np.ndarray:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = b"".join((stdlib / n).read_bytes() for n in ("textwrap.py", "shlex.py", "argparse.py"))
    return np.frombuffer(text, dtype=np.uint8).astype(np.int64)


def step_batches(tokens: np.ndarray, step: int, rank: int, rows: int, micro_batches: int):
    """This rank's micro-batches of `step`: K = 2 * micro_batches partitions, rank r owns p % 2 == r."""
    out, k = [], 2 * micro_batches
    for p in range(rank, k, 2):
        start = ((step * k + p) * rows * ROW_TOKENS) % (len(tokens) - rows * ROW_TOKENS)
        out.append(pad_rows([(p * 1000 + i, tokens[start + i * ROW_TOKENS: start + (i + 1) * ROW_TOKENS])
                             for i in range(rows)], p))
    return out


class CountingExact(ExactGradSum):
    """ExactGradSum that times its all-reduce and counts float64 additions that rounded."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        super().__init__(model, device)
        self.inexact = self.additions = 0
        self.allreduce_s: list[float] = []
        self.counting_s = 0.0  # the step time leaves it out

    @staticmethod
    def rounded(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int]:
        """(additions of nonzeros, of which rounded): Fast2Sum's error term is 0 iff exact."""
        s = a + b
        big, small = torch.where(a.abs() >= b.abs(), a, b), torch.where(a.abs() >= b.abs(), b, a)
        both = (a != 0) & (b != 0)
        return int(both.sum()), int(((small - (s - big)) != 0)[both].sum())

    def add_grads(self) -> None:
        t0 = time.perf_counter()
        grads = torch.cat([p.grad.flatten().double() for p in self.params])
        self.count(self.flat, grads)
        self.counting_s += time.perf_counter() - t0
        super().add_grads()

    def count(self, a: torch.Tensor, b: torch.Tensor) -> None:
        n, bad = self.rounded(a, b)
        self.additions, self.inexact = self.additions + n, self.inexact + bad

    def finish(self) -> None:
        t0 = time.perf_counter()
        both = [torch.empty_like(self.flat) for _ in range(2)]
        dist.all_gather(both, self.flat)  # to count the 2-rank sum's rounding
        self.count(both[0], both[1])
        self.counting_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        dist.all_reduce(self.flat)
        self.allreduce_s.append(time.perf_counter() - t0)
        for p, acc in zip(self.params, self.views, strict=True):
            p.grad = acc.to(p.dtype, copy=True)
        self.flat.zero_()


def count_all_reduce_bytes() -> list[int]:
    """Count every dist.all_reduce's bytes (hooks and the loop call it through the module)."""
    counter, original = [0], dist.all_reduce

    def counting(tensor, *args, **kwargs):
        counter[0] += tensor.numel() * tensor.element_size()
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    return counter


def build(mode: str, args) -> tuple[torch.nn.Module, torch.nn.Module, StepSetup]:
    torch.manual_seed(0)
    raw = build_model(ModelConfig(n_layer=args.layers, d_model=args.d_model, n_head=8), ROW_TOKENS)
    ExactGradSum.broadcast_parameters(raw)
    setup = StepSetup(device=CPU, world_size=2, grad_clip=1.0)
    if mode == "compute":
        return LossModule(raw), raw, StepSetup(device=CPU, world_size=1, grad_clip=1.0)
    if mode == "exact":
        return LossModule(raw), raw, StepSetup(device=CPU, world_size=2, grad_clip=1.0,
                                               exact=CountingExact(raw, CPU))
    compression = "none" if mode == "ddp" else mode
    t = load_config(None, ["train.grad_reduce=ddp", f"train.grad_compression={compression}",
                           f"train.powersgd_warmup_steps={WARMUP_STEPS}",
                           f"train.powersgd_rank={args.powersgd_rank}"]).train
    model = torch.nn.parallel.DistributedDataParallel(LossModule(raw), **ddp_kwargs(t))
    register_comm_hook(model, t)
    return model, raw, setup


def _worker(rank: int, mode: str, args, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    model, raw, setup = build(mode, args)
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-3, weight_decay=0.0)
    tokens, counter = corpus(), count_all_reduce_bytes()
    times, losses, bytes_per_step = [], [], []
    for step in range(args.steps):
        mbs = step_batches(tokens, step, rank, args.rows, args.micro_batches)
        targets = sum(mb.targets for mb in mbs) * (1 if mode == "compute" else 2)  # equal halves
        counting_s = setup.exact.counting_s if setup.exact is not None else 0.0
        before, t0 = counter[0], time.perf_counter()
        result = train_step(model, raw, optimizer, mbs, setup=setup, data_targets=targets,
                            step=step, lr=1e-3)
        counting_s = (setup.exact.counting_s if setup.exact is not None else 0.0) - counting_s
        times.append(time.perf_counter() - t0 - counting_s)
        losses.append(result.loss)
        bytes_per_step.append(counter[0] - before)
    record = {"mode": mode, "params": count_parameters(raw), "losses": losses,
              "step_s": statistics.median(times[WARMUP_STEPS:]),
              "all_reduce_bytes_per_step": statistics.median(bytes_per_step[WARMUP_STEPS:])}
    if mode == "ddp":  # DDP's own all-reduce does not go through dist.all_reduce
        record["all_reduce_bytes_per_step"] += 4 * record["params"]
    if setup.exact is not None:
        record["exact_all_reduce_s"] = statistics.median(setup.exact.allreduce_s[WARMUP_STEPS:])
        record["inexact_fraction"] = setup.exact.inexact / max(setup.exact.additions, 1)
        record["float64_additions"] = setup.exact.additions
    if rank == 0:
        Path(out).write_text(json.dumps(record))
    dist.destroy_process_group()


def run_mode(mode: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.start_processes(_worker, args=(mode, args, os.path.join(tmp, "init"), out), nprocs=2,
                           start_method="spawn")
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rows", type=int, default=1, help="rows of 64 tokens per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=2, help="per rank and step")
    parser.add_argument("--powersgd-rank", type=int, default=4)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    results = {}
    for mode in args.modes.split(","):
        results[mode] = run_mode(mode, args)
        print(f"{mode}: {results[mode]['step_s']:.2f} s a step", file=sys.stderr, flush=True)
    floor = results.get("compute", {}).get("step_s")
    reference = results.get("ddp", {}).get("losses")
    print("| mode | step s | exposed comm s | all-reduced MB/step/rank | loss at last step | vs ddp |")
    print("|---|---|---|---|---|---|")
    for mode, r in results.items():
        r["exposed_comm_s"] = r["step_s"] - floor if floor else None
        if mode == "compute":  # each rank trains its half alone: another run, another loss
            r.pop("losses")
            print(f"| {mode} | {r['step_s']:.2f} | 0 | 0 | - | - |")
            continue
        if reference:
            r["loss_vs_ddp"] = r["losses"][-1] / reference[-1] - 1
        print(f"| {mode} | {r['step_s']:.2f} | {r['exposed_comm_s'] or 0:.2f} | "
              f"{r['all_reduce_bytes_per_step'] / 1e6:.1f} | {r['losses'][-1]:.4f} | "
              f"{100 * r.get('loss_vs_ddp', 0):+.3f}% |")
    print(json.dumps({"benchmark": "reduce", "steps": args.steps, "d_model": args.d_model,
                      "layers": args.layers, "results": results}))


if __name__ == "__main__":
    main()
