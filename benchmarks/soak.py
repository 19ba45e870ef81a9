"""Soak: many seeded schedules of mixed faults, each run against one that was never interrupted.

    .venv/bin/python benchmarks/soak.py [--schedules 20] [--first-seed 100] [--storage DIR]

Each schedule is a seeded draw (recovery/chaos.py: three faults, kinds and ranks and steps, at
least two checkpoints apart) run as fault.schedule on the embedded GPT (tiny) over two epochs, with
2 CPU workers on a local Ray cluster. The seeds cycle through the setups: restart mode (crash,
SIGKILL from another process, driver SIGTERM then the same command again), train.sharding=fsdp
(the same kinds), in place (crash and SIGKILL; a drawn schedule may kill the last replica left,
whose replacements then restore the last checkpoint; a fault aimed at participating rank 1 while
one replica trains alone does not fire: faults_injected counts those that did). A run that
is stopped is run again until it finishes, as a user would. Each is compared with the
uninterrupted run of its setup (run once): the sample ids of every step, every step's loss,
every checkpoint's data cursors and the final weights, to the bit. Prints one JSON line per
schedule and a last one: schedules run, faults injected, recoveries, divergences (0 is the goal).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch

from elastic_train import load_config
from elastic_train.api import TrainingStopped, train
from elastic_train.data.prepare import prepare
from elastic_train.observe.summary import read_jsonl
from elastic_train.recovery.chaos import draw_fault_schedule
from elastic_train.training.checkpoint import read_shards

TINY = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "data.max_seq_len=128",
        "data.micro_batch_tokens=1024", "data.global_batch_tokens=4096", "log.progress=none",
        "scaling.health_check_interval_s=0.1", "eval.fraction=0", "checkpoint.keep_best=false",
        "data.record_ids=true", "checkpoint.every_steps=4", "checkpoint.keep=100",
        "scaling.max_failures=4", "train.epochs=2", "train.max_steps=1000"]
SETUPS = {"restart": ([], ("crash", "kill", "stop")),
          "fsdp": (["train.sharding=fsdp"], ("crash", "kill", "stop")),
          "in_place": (["fault.recovery=in_place"], ("crash", "kill"))}


def corpus(folder: Path) -> str:
    """A few standard-library modules, prepared (~1,500 rows, 22 steps an epoch)."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = ("textwrap.py", "shlex.py", "fnmatch.py", "bisect.py", "heapq.py", "glob.py", "colorsys.py")
    prepare([stdlib / n for n in names], folder, max_seq_len=128, rows_per_shard=600, rows_per_block=32)
    return str(folder)


def run_to_the_end(overrides: list[str]) -> tuple[object, int]:
    stops = 0
    while True:
        try:
            return train(load_config(None, overrides), progress=False), stops
        except TrainingStopped:
            stops += 1
            if stops > 5:
                raise


def trained(run_dir: Path) -> tuple[dict, dict, dict]:
    """(epoch, step) -> ids of the step's latest attempt; step -> loss; step -> saved cursors."""
    latest, ids = {}, {}
    lines = [r for f in sorted((run_dir / "consumed").glob("*.jsonl")) for r in read_jsonl(f)]
    for r in lines:
        latest[r["step"]] = max(latest.get(r["step"], -1), r["attempt"])
    for r in lines:
        if r["attempt"] == latest[r["step"]]:
            ids.setdefault((r["epoch"], r["step"]), []).extend(r["ids"])
    losses = {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "eval_loss" not in r}
    cursors = {}
    for folder in run_dir.glob("checkpoint_*"):
        if (folder / "state.json").is_file():
            state = json.loads((folder / "state.json").read_text())["train_state"]
            cursors[state["step"]] = state["cursors"]
    return {k: sorted(v) for k, v in ids.items()}, losses, cursors


def divergences(result, reference) -> list[str]:
    """What differs between the faulty run and the reference: an empty list when nothing does."""
    got, want = trained(Path(result.run_dir)), trained(Path(reference.run_dir))
    out = []
    if got[0] != want[0]:
        out.append(f"ids differ at steps {sorted(k for k in want[0] if got[0].get(k) != want[0][k])[:5]}")
    if got[1] != want[1]:
        out.append(f"losses differ at steps {sorted(s for s in want[1] if got[1].get(s) != want[1][s])[:5]}")
    last = max(want[1])  # an epoch's end: saved with or without its (finished) cursors
    bad = sorted(s for s in got[2] if s in want[2] and s != last and got[2][s] != want[2][s])
    if bad:
        out.append(f"cursors differ in the checkpoints of steps {bad[:5]}")
    final, ref = read_shards(result.checkpoint_path, "model"), read_shards(reference.checkpoint_path, "model")
    if final.keys() != ref.keys() or any(not torch.equal(final[k], ref[k]) for k in ref):
        out.append("final weights differ")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", type=int, default=20)
    parser.add_argument("--first-seed", type=int, default=100)
    parser.add_argument("--storage", default=None, help="folder for the runs (default: a temporary one)")
    args = parser.parse_args()
    root = Path(args.storage or tempfile.mkdtemp(prefix="soak-"))
    data = corpus(root / "data") if not (root / "data").is_dir() else str(root / "data")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    references: dict[str, object] = {}
    totals = {"schedules": 0, "faults_injected": 0, "restarts": 0, "resumes": 0, "divergences": 0}
    t0 = time.time()
    for seed in range(args.first_seed, args.first_seed + args.schedules):
        setup = list(SETUPS)[seed % len(SETUPS)]
        extra, kinds = SETUPS[setup]
        base = [*TINY, *extra, f"data.path={data}", f"run.storage_path={root / 'runs'}"]
        if setup not in references:
            references[setup], _ = run_to_the_end([*base, f"run.name=reference_{setup}"])
        steps = references[setup].summary["steps"]
        schedule = draw_fault_schedule(seed, steps, kinds, world_size=2)
        started = time.time()
        result, stops = run_to_the_end([*base, f"run.name=seed{seed}",
                                        f"fault.schedule=[{', '.join(schedule)}]"])
        fired = [e for e in read_jsonl(Path(result.run_dir) / "events.jsonl")
                 if e.get("event") == "crash_injected"]
        diverged = divergences(result, references[setup])
        s = result.summary
        line = {"seed": seed, "setup": setup, "schedule": schedule, "faults_injected": len(fired),
                "restarts": s["restarts"], "resumes": s["resumes"], "stops": stops,
                "replayed_steps": s["replayed_steps"], "status": s["status"],
                "wall_s": round(time.time() - started, 1), "divergences": diverged}
        print(json.dumps(line), flush=True)
        totals["schedules"] += 1
        totals["faults_injected"] += len(fired)
        totals["restarts"] += s["restarts"]
        totals["resumes"] += s["resumes"]
        totals["divergences"] += bool(diverged) or s["status"] != "finished"
    totals["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps({"benchmark": "soak", **totals}), flush=True)
    ray.shutdown()
    sys.exit(1 if totals["divergences"] else 0)


if __name__ == "__main__":
    main()
