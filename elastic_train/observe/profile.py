"""A torch.profiler summary of a few steps: what the GPU runs, how long it waits, and for what.

`log.profile_steps=[first, last]` profiles those steps of rank 0 (benchmarks/gpu.py sets it) and
logs one `profile` event (events.jsonl); the bare loop of benchmarks/gpu.py summarises its own
steps with the same `summarize`, so the two read alike. The summary holds:
- the top kernels by device time (on CPU, where there are none, the top operators by CPU time);
- `gpu_idle_fraction`: the share of the profiled steps' wall time in which no kernel ran (the
  union of the kernels' intervals, clipped to the steps, against the steps' span);
- `host_syncs`: each Python call site that made the host wait for the device (`.item()`,
  `float(t)`, `.tolist()`, `nonzero`, a device-to-host copy all reach `aten::_local_scalar_dense`
  or a synchronising runtime call), with its count per step. On CPU the same call sites show
  (the op exists there too, it just does not wait), which is how they are found without a GPU.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.autograd import DeviceType

STEP_MARK = "elastic_train_step"
# operators and runtime calls after which the host has waited for the device
SYNC_NAMES = ("aten::_local_scalar_dense", "aten::nonzero", "cudaStreamSynchronize",
              "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
# kernel families by name: the reduction (NCCL, the exact sum's float64 adds), the optimizer
KERNEL_KINDS = (("reduction", ("nccl", "double")), ("optimizer", ("adam", "fused_adamw")),
                ("copy", ("memcpy", "memset")))
# Python calls that read a tensor on the host (`.tolist()` makes no operator event of its own)
SYNC_METHODS = ("<built-in method tolist of Tensor",)
_OWN_FRAMES = ("elastic_train/", "benchmarks/", "torch/optim/", "torch/nn/utils/")


def make_profiler(device: torch.device) -> torch.profiler.profile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities, with_stack=True)


def step_mark() -> contextlib.AbstractContextManager:
    """Wrap one profiled step: `summarize` measures idle time against these spans."""
    return torch.profiler.record_function(STEP_MARK)


def _is_kernel(event: Any) -> bool:
    return event.device_type == DeviceType.CUDA


def _union_in(intervals: list[tuple[float, float]], spans: list[tuple[float, float]]) -> float:
    """Length of the union of `intervals` clipped to `spans` (disjoint)."""
    total = 0.0
    for lo, hi in spans:
        clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi)
        end = lo
        for a, b in clipped:
            if b > end:
                total += b - max(a, end)
                end = b
    return total


def _call_site(event: Any) -> str:
    """The innermost Python frame of our code (or a user's) above `event`: with `with_stack`,
    Python calls are events too, parents of the operators they made."""
    parent, innermost = event.cpu_parent, None
    while parent is not None:
        name = parent.name
        if ".py(" in name:
            innermost = innermost or name
            if any(mark in name for mark in _OWN_FRAMES) and "observe/profile.py" not in name:
                return name
        parent = parent.cpu_parent
    return innermost or "?"


def summarize(prof: torch.profiler.profile, top: int = 12) -> dict[str, Any]:
    """The summary of a finished profile whose steps were wrapped in `step_mark`."""
    events = prof.events()
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == STEP_MARK)
    steps = max(len(spans), 1)
    wall_us = sum(b - a for a, b in spans)
    kernels = [e for e in events if _is_kernel(e)]
    out: dict[str, Any] = {"profiled_steps": len(spans), "step_wall_ms": wall_us / steps / 1e3}
    if kernels:
        busy = _union_in([(e.time_range.start, e.time_range.end) for e in kernels], spans)
        out["gpu_idle_fraction"] = round(1.0 - busy / max(wall_us, 1e-9), 4)
        out["gpu_busy_ms_per_step"] = busy / steps / 1e3
        out["kernels_per_step"] = len(kernels) / steps
        by_kind: dict[str, float] = {}
        for e in kernels:
            kind = next((k for k, marks in KERNEL_KINDS if any(m in e.name.lower() for m in marks)),
                        "compute")
            by_kind[kind] = by_kind.get(kind, 0.0) + (e.time_range.end - e.time_range.start) / steps / 1e3
        out["gpu_ms_per_step_by_kind"] = by_kind
    else:
        out["gpu_idle_fraction"] = None
    averages = prof.key_averages()
    if kernels:
        rows = sorted((a for a in averages if a.device_type == DeviceType.CUDA),
                      key=lambda a: -a.self_device_time_total)
        out["top_kernels"] = [{"name": a.key[:100], "ms_per_step": a.self_device_time_total / steps / 1e3,
                               "calls_per_step": a.count / steps} for a in rows[:top]]
    else:
        rows = sorted((a for a in averages if a.key.startswith("aten::")),
                      key=lambda a: -a.self_cpu_time_total)
        out["top_cpu_ops"] = [{"name": a.key[:100], "ms_per_step": a.self_cpu_time_total / steps / 1e3,
                               "calls_per_step": a.count / steps} for a in rows[:top]]
    sites: dict[str, dict[str, Any]] = {}
    for event in events:
        if event.device_type == DeviceType.CPU and (event.name.startswith(SYNC_NAMES)
                                                    or event.name.startswith(SYNC_METHODS)):
            op = event.name.split(" object at")[0]
            entry = sites.setdefault(_call_site(event), {"calls_per_step": 0.0, "op": op})
            entry["calls_per_step"] += 1 / steps
    out["host_syncs"] = [{"site": s, **v} for s, v in sorted(sites.items(),
                                                            key=lambda kv: -kv[1]["calls_per_step"])]
    out["host_syncs_per_step"] = sum(v["calls_per_step"] for v in sites.values()
                                     if v["op"].startswith(("aten::", "<built-in")))
    return out


class StepProfiler:
    """Profiles steps `first`..`last` (1-based, inclusive) of the loop; `summary` once done."""

    def __init__(self, steps: list[int], device: torch.device) -> None:
        self.first, self.last = (int(steps[0]), int(steps[-1])) if steps else (0, -1)
        self.device = device
        self.prof: torch.profiler.profile | None = None
        self.summary: dict[str, Any] | None = None

    def step(self, step: int) -> contextlib.AbstractContextManager:
        """The context of training step `step`: profiled (and marked) when in range."""
        if not self.first <= step <= self.last or self.summary is not None:
            return contextlib.nullcontext()
        if self.prof is None:
            self.prof = make_profiler(self.device)
            self.prof.__enter__()
        return step_mark()

    def after_step(self, step: int) -> dict[str, Any] | None:
        """After step `step`: the summary when it was the last profiled one, else None."""
        if self.prof is None or step < self.last or self.summary is not None:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.prof.__exit__(None, None, None)
        self.summary = summarize(self.prof)
        self.prof = None
        return self.summary
