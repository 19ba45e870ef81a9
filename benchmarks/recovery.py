"""Recovery and checkpoint cost of elastic-train on a local Ray cluster (2 CPU workers).

One run of the default model with a checkpoint every 10 steps; worker rank 1 dies hard
(os._exit) after step 25. Reports: seconds from the death to the first step after the restart,
steps lost (trained again), the loop's blocked seconds per checkpoint as a fraction of a step, and
the goodput ledger.

    .venv/bin/python benchmarks/recovery.py [--steps 40] [--crash-at 25] [--every 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from elastic_train import load_config
from elastic_train.api import train
from elastic_train.summary import read_jsonl


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--crash-at", type=int, default=25)
    p.add_argument("--every", type=int, default=10)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as storage:
        cfg = load_config(None, [
            f"run.storage_path={storage}", "run.name=recovery", f"train.max_steps={args.steps}",
            f"checkpoint.every_steps={args.every}", f"fault.crash_at_step={args.crash_at}",
            "fault.crash_rank=1", "log.progress=none", "eval.fraction=0", "checkpoint.keep_best=false",
        ])
        result = train(cfg)
        folder = Path(result.run_dir)
        records = read_jsonl(folder / "metrics.jsonl")
        events = read_jsonl(folder / "events.jsonl")
    crash = next(e for e in events if e["event"] == "crash_injected")
    after = [r for r in records if r["attempt"] == 1]
    blocked = [e["blocked_s"] for e in events if e["event"] == "checkpoint" and not e["final"]]
    step_s = statistics.median(r["step_time_s"] for r in records)
    ledger = result.summary["ledger"]
    figures = {
        "benchmark": "recovery",
        "death_to_first_step_s": after[0]["time"] - crash["time"],
        "steps_lost": args.crash_at - (after[0]["step"] - 1),
        "checkpoint_blocked_s": statistics.mean(blocked),
        "checkpoint_blocked_fraction_of_step": statistics.mean(blocked) / step_s,
        "median_step_s": step_s,
        "goodput": ledger["goodput"],
        "ledger": {k: round(v, 3) for k, v in ledger.items()},
    }
    print(f"worker death -> first step after restart: {figures['death_to_first_step_s']:.1f} s")
    print(f"steps lost: {figures['steps_lost']} (checkpoint every {args.every})")
    print(f"loop blocked per checkpoint: {figures['checkpoint_blocked_s'] * 1e3:.1f} ms = "
          f"{figures['checkpoint_blocked_fraction_of_step']:.2%} of a {step_s:.2f} s step")
    print(f"goodput {ledger['goodput']:.2f} of {ledger['wall_s']:.0f} s wall")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
