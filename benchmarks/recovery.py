"""Recovery and checkpoint cost of elastic-train on a local Ray cluster (2 CPU workers).

Default: one run of the default model with a checkpoint every 10 steps; worker rank 1 dies hard
(os._exit) after step 25. Reports: seconds from the death to the first step after the restart,
steps lost (trained again), the loop's blocked seconds per checkpoint as a fraction of a step, and
the goodput ledger. `--recovery in_place` runs the same with in-place recovery (torchft): the
survivor's next committed step after the death, and the replacement's join. `--compile warm`
turns train.compile on (the restart loads the run's compile cache); `--compile cold` deletes the
caches as the worker dies, so the restart compiles again (issue 31: recovery time with compile on).

`--goodput`: for each mode (restart, then in_place), a run of `--steps` steps never interrupted,
then one with the youngest training worker process killed (SIGKILL, from outside, as a
crash-looping machine: after the first kill, the replacement; recovery/chaos.py) every
`--crash-every` seconds. Goodput = the seconds the uninterrupted run's steps would take at the
faulty run's own speed / the faulty run's seconds, both after step `--warm-up`
(`goodput_figures` says why not a plain ratio of rates); also the seconds from each kill to the
next committed step, the steps lost, and the ledger's goodput (summary.json).

    .venv/bin/python benchmarks/recovery.py [--steps 40] [--crash-at 25] [--every 10] [--recovery in_place]
        [--compile cold|warm]
    .venv/bin/python benchmarks/recovery.py --goodput [--steps 1000] [--crash-every 60] [--warm-up 30]
        [--storage DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import threading
from pathlib import Path

from elastic_train import load_config
from elastic_train.api import train
from elastic_train.observe.summary import read_jsonl
from elastic_train.recovery.chaos import FaultSchedule
from elastic_train.training.compile import CACHE_SUBFOLDER, cache_folder

BASE = ["log.progress=none", "eval.fraction=0", "checkpoint.keep_best=false"]


class ColdCache:
    """`--compile cold`: once the crash is logged, the run's compile caches (the node-local
    folder and the run folder's artifacts) are deleted before the restarted workers can read
    them, so the restart compiles from nothing, as on a node new to the run without the run
    folder's cache. The restarted attempt's `compile` events say whether it did (loaded 0)."""

    def __init__(self, cfg) -> None:
        self.folders = [Path(cache_folder(cfg)), Path(cfg.run.storage_path) / cfg.run.name / CACHE_SUBFOLDER]
        self.events = Path(cfg.run.storage_path) / cfg.run.name / "events.jsonl"
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.wait(0.02):
            if self.events.is_file() and '"crash_injected"' in self.events.read_text():
                for folder in self.folders:
                    shutil.rmtree(folder, ignore_errors=True)
                return

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def single_crash(args) -> dict:
    with tempfile.TemporaryDirectory() as storage:
        compiled = ["train.compile=true",
                    f"train.compile_cache_dir={storage}/compile_cache"] if args.compile else []
        cfg = load_config(None, [
            *BASE, f"run.storage_path={storage}", "run.name=recovery", f"train.max_steps={args.steps}",
            f"checkpoint.every_steps={args.every}", f"fault.crash_at_step={args.crash_at}",
            "fault.crash_rank=1", f"fault.recovery={args.recovery}", *compiled,
        ])
        cold = ColdCache(cfg) if args.compile == "cold" else None
        try:
            result = train(cfg)
        finally:
            if cold:
                cold.stop()
        folder = Path(result.run_dir)
        records = sorted(read_jsonl(folder / "metrics.jsonl"), key=lambda r: r["time"])
        events = read_jsonl(folder / "events.jsonl")
    crash = next(e for e in events if e["event"] == "crash_injected")
    after = [r for r in records if r["time"] > crash["time"]]
    blocked = [e["blocked_s"] for e in events if e["event"] == "checkpoint" and not e["final"]]
    step_s = statistics.median(r["step_time_s"] for r in records)
    ledger = result.summary["ledger"]
    joined = [e for e in events if e["event"] == "healed" and e["time"] > crash["time"]]
    restarted = [e for e in events if e["event"] == "compile" and e["time"] > crash["time"]]
    figures = {
        "benchmark": "recovery",
        "recovery": args.recovery,
        "compile": args.compile or "off",
        "restart_compile_events": [{k: e.get(k) for k in ("rank", "step", "loaded", "compiled",
                                                         "seeded_artifacts")} for e in restarted],
        "death_to_first_step_s": after[0]["time"] - crash["time"],
        "steps_lost": result.summary["replayed_steps"],
        "death_to_replacement_joined_s": joined[0]["time"] - crash["time"] if joined else None,
        "checkpoint_blocked_s": statistics.mean(blocked),
        "checkpoint_blocked_fraction_of_step": statistics.mean(blocked) / step_s,
        "median_step_s": step_s,
        "goodput": ledger["goodput"],
        "ledger": {k: round(v, 3) for k, v in ledger.items()},
    }
    print(f"[{args.recovery}, compile {args.compile or 'off'}] worker death -> next committed step: "
          f"{figures['death_to_first_step_s']:.1f} s")
    print(f"steps lost: {figures['steps_lost']} (checkpoint every {args.every})")
    print(f"loop blocked per checkpoint: {figures['checkpoint_blocked_s'] * 1e3:.1f} ms = "
          f"{figures['checkpoint_blocked_fraction_of_step']:.2%} of a {step_s:.2f} s step")
    print(f"goodput {ledger['goodput']:.2f} of {ledger['wall_s']:.0f} s wall")
    return figures


def timed_run(storage: str, name: str, recovery: str, steps: int, every: int,
              crash_every: float | None) -> dict:
    """One run of the default model (a finished one of that name in `storage` is reused: the
    product returns it unchanged); with `crash_every`, the fault schedule beside it."""
    cfg = load_config(None, [
        *BASE, f"run.storage_path={storage}", f"run.name={name}", f"train.max_steps={steps}",
        "train.epochs=1000", f"checkpoint.every_steps={every}", f"fault.recovery={recovery}",
        "scaling.max_failures=-1",
    ])
    killer = FaultSchedule(Path(storage) / name, crash_every) if crash_every else None
    thread = threading.Thread(target=killer.run, daemon=True) if killer else None
    if thread:
        thread.start()
    try:
        result = train(cfg)
    finally:
        if killer:
            killer.stop()
            thread.join()
    records = sorted(read_jsonl(Path(result.run_dir) / "metrics.jsonl"), key=lambda r: r["time"])
    return {"records": records, "kills": [k.time for k in killer.kills] if killer else [],
            "summary": result.summary}


def step_seconds(records: list[dict]) -> dict[int, float]:
    """An uninterrupted run's seconds per step: from the record before it to its own."""
    return {b["step"]: b["time"] - a["time"] for a, b in zip(records, records[1:], strict=False)}


def goodput_figures(clean: dict, faulty: dict, warm_up: int, steps: int) -> dict:
    """Goodput = the seconds an uninterrupted run needs for steps warm_up+1..steps, at the
    faulty run's own speed, over the faulty run's wall seconds for them (first commit of step
    warm_up to the last step).

    A step's time depends on its batch (lengths, tokens), and this machine's speed drifts by 10%
    and more between runs minutes apart: a plain ratio of two runs' rates measured the drift as
    much as the faults (restart came out at 0.99-1.01 with 10 kills and 67 steps replayed). So
    the uninterrupted run gives each step's relative cost, and the faulty run its speed: the
    median, over its undisturbed steps (the step before it committed just before it, in the same
    attempt, at full size, no kill between), of its seconds over the uninterrupted run's."""
    clean_s = step_seconds(clean["records"])
    recs, kills = faulty["records"], faulty["kills"]
    full = max(r["world_size"] for r in recs)
    last = {r["step"]: r["time"] for r in recs}  # a replayed step: its latest commit
    ratios = [(b["time"] - a["time"]) / clean_s[b["step"]]
              for a, b in zip(recs, recs[1:], strict=False)
              if b["step"] == a["step"] + 1 and b["attempt"] == a["attempt"]
              and a["world_size"] == b["world_size"] == full and last[b["step"]] == b["time"]
              and not any(a["time"] < k <= b["time"] for k in kills) and b["step"] in clean_s]
    speed = statistics.median(ratios)
    start = next(r["time"] for r in recs if r["step"] == warm_up)
    wall_s = recs[-1]["time"] - start
    ideal_s = speed * sum(clean_s[s] for s in range(warm_up + 1, steps + 1))
    clean_wall_s = clean["records"][-1]["time"] - next(r["time"] for r in clean["records"]
                                                       if r["step"] == warm_up)
    recover = [next((r["time"] for r in recs if r["time"] > k), None) for k in kills]
    s = faulty["summary"]
    return {"goodput": round(ideal_s / wall_s, 3), "wall_s": round(wall_s, 1),
            "ideal_s": round(ideal_s, 1), "speed_vs_uninterrupted": round(speed, 3),
            "undisturbed_steps": len(ratios),
            "plain_rate_ratio": round(clean_wall_s / wall_s, 3), "kills": len(kills),
            "kills_before_warm_up": sum(k < start for k in kills),
            "kill_to_next_step_s": [round(r - k, 2) for k, r in zip(kills, recover, strict=True) if r],
            "steps_lost": s["replayed_steps"], "restarts": s["restarts"],
            "ledger_goodput": round(s["ledger"]["goodput"], 3)}


def goodput(args) -> dict:
    figures: dict = {"benchmark": "recovery_goodput", "steps": args.steps, "crash_every_s": args.crash_every}
    with tempfile.TemporaryDirectory() as temporary:
        storage = args.storage or temporary
        for mode in ("restart", "in_place"):
            clean = timed_run(storage, f"{mode}_clean", mode, args.steps, args.every, None)
            shutil.rmtree(Path(storage) / f"{mode}_faulty", ignore_errors=True)
            faulty = timed_run(storage, f"{mode}_faulty", mode, args.steps, args.every, args.crash_every)
            f = figures[mode] = goodput_figures(clean, faulty, args.warm_up, args.steps)
            print(f"[{mode}] steps {args.warm_up + 1}-{args.steps}: {f['wall_s']} s with {f['kills']} "
                  f"kills, {f['ideal_s']} s uninterrupted at its speed ({f['speed_vs_uninterrupted']} "
                  f"x the uninterrupted run's) -> goodput {f['goodput']:.3f} (plain rate ratio "
                  f"{f['plain_rate_ratio']:.3f}, ledger {f['ledger_goodput']:.3f}); kill -> next "
                  f"committed step {f['kill_to_next_step_s']} s; steps lost {f['steps_lost']}")
    return figures


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--crash-at", type=int, default=25)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--recovery", choices=["restart", "in_place"], default="restart")
    p.add_argument("--goodput", action="store_true")
    p.add_argument("--crash-every", type=float, default=60.0)
    p.add_argument("--warm-up", type=int, default=30, help="--goodput: seconds counted after this step")
    p.add_argument("--storage", default=None,
                   help="--goodput: the runs' folder (default: a temporary one); uninterrupted runs "
                        "finished there before are reused, faulty ones run again")
    p.add_argument("--compile", choices=["cold", "warm"], default=None,
                   help="train.compile=true; cold: the restart finds no compile cache (ColdCache)")
    args = p.parse_args()
    if args.goodput:
        args.steps = args.steps or 1000  # about 10 minutes of faulty training on 2 cores
        figures = goodput(args)
    else:
        args.steps = args.steps or 40
        figures = single_crash(args)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
